"""Per-request sampling parameters, shaped like vLLM's SamplingParams: every field checked on construction, so that
nothing a request asks for can fail the engine's step (oasiskv.config re-exports them)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

SEED_RANGE = (-2 ** 63, 2 ** 64)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
SAMPLING_EPS = 1e-5  # vLLM's and SGLang's: a temperature below it samples greedily


def is_integer(value) -> bool:
    """An int, or numpy's ints; not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs: from a dict (JSON's keys are strings of digits) or pairs."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = sorted((int(t), float(b)) for t, b in items if not isinstance(t, (bool, float)))
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    if len(pairs) != len(items):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
    bad = [(t, b) for t, b in pairs if t < 0 or not -100 <= b <= 100]
    if bad:
        raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {bad[:3]}")
    return tuple(pairs)


def check_truncation(size) -> None:
    if not (is_integer(size) and (size >= 1 or size == -1)):
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1 (the model's length), got {size!r}")


def left_truncated(prompt_ids: list[int], size: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `size` tokens (-1: max_model_len; None: all of them); a size
    above max_model_len is refused, as vLLM refuses it."""
    if size is None:
        return prompt_ids
    check_truncation(size)
    if size > max_model_len:
        raise ValueError(f"truncate_prompt_tokens {size} is greater than max_model_len {max_model_len}; choose a "
                         f"smaller size, or -1 for the model's length")
    return prompt_ids[-(max_model_len if size == -1 else size):]


VLLM_ONLY_FIELDS = {"spaces_between_special_tokens": (True,)}


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling, shaped like vLLM's. Keywords only: vLLM's first field is n, ours was max_tokens, so a
    positional SamplingParams(4) would silently mean another thing."""

    max_tokens: int | None = 16  # None: up to --max-model-len (the engine fills it in)
    n: int = 1  # completions per prompt (LLM.generate): choice i is seeded seed + i, as the server does
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps the stop string that ended it
    # vLLM's penalties (engine/penalties.py): presence and frequency over the output tokens, OpenAI's rule;
    # repetition (CTRL, transformers' rule) over the prompt and output tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled, and stop strings do not stop, before this many
    min_p: float = 0.0  # after temperature, tokens below min_p x the top token's probability are dropped
    # added to the token ids' logits before everything else (OpenAI's logit_bias: {id: bias in [-100, 100]});
    # kept as sorted (id, bias) pairs, so that the params stay hashable
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    # LLM.generate: each output token's logprob and this many most likely tokens (CompletionOutput.logprobs), and
    # the same for each prompt token (RequestOutput.prompt_logprobs); raw logprobs, before penalties and temperature
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # False: the text keeps the special tokens' text (EOS, chat markers)
    detokenize: bool = True  # False: no text at all (token ids only, so no stop strings), as vLLM
    # vLLM's: words the output may not contain (engine/penalties.py: bad_word_token_ids); kept as a tuple
    bad_words: tuple[str, ...] | list[str] | None = None
    # vLLM's: only these tokens can be sampled (the others' logits are -inf before everything else); kept as a tuple.
    # Where min_tokens or bad_words would ban every one of them, the bans give way
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    # vLLM's: the prompt's last k tokens only (left truncation); -1: the last --max-model-len
    truncate_prompt_tokens: int | None = None
    # vLLM's fields this engine does not honour, at the values that change nothing (VLLM_ONLY_FIELDS); another value
    # is refused by name, not ignored. best_of may equal n
    spaces_between_special_tokens: bool = True
    best_of: int | None = None

    def __post_init__(self):
        # vLLM's spellings: top_k 0 is off as -1 is, seed -1 is no seed, logprobs True is the sampled token's and 1
        if self.top_k == 0 and not isinstance(self.top_k, bool):
            object.__setattr__(self, "top_k", -1)
        if self.seed == -1 and not isinstance(self.seed, bool):
            object.__setattr__(self, "seed", None)
        if self.logprobs is True:
            object.__setattr__(self, "logprobs", 1)
        if self.bad_words is not None:  # (lists would make the params unhashable)
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            if not all(self.bad_words):  # (it would ban every token after any output, as vLLM says)
                raise ValueError("bad_words cannot contain an empty string")
            for word in self.bad_words:  # a lone surrogate (JSON's \ud800) is a str no tokenizer takes
                try:
                    word.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"bad_words must be valid Unicode: {e.reason} in {word!r}") from None
            object.__setattr__(self, "bad_words", tuple(self.bad_words) or None)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) for x in self.stop):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop is not None and "" in self.stop:  # it would match before the first token (vLLM refuses it too)
            raise ValueError("stop cannot contain an empty string")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(map(is_integer, self.stop_token_ids)):
                raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not all(map(is_integer, ids)):
                raise ValueError(f"allowed_token_ids must be a list of integers, got {ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in ids))
        self.validate()
        # numpy's ints become Python's: torch's seeding takes no other
        for name in ("max_tokens", "n", "top_k", "min_tokens", "seed", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    def validate(self) -> None:
        for name, neutral in VLLM_ONLY_FIELDS.items():
            if getattr(self, name) not in neutral:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by this engine; leave it unset")
        if self.best_of not in (None, self.n):
            raise ValueError(f"best_of other than n is not supported by this engine, got {self.best_of} with n "
                             f"{self.n}")
        for name in ("max_tokens", "n", "top_k", "min_tokens"):
            if not is_integer(getattr(self, name)) and not (name == "max_tokens" and self.max_tokens is None):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if not isinstance(getattr(self, name), numbers.Real) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        # a seed torch's generators refuse would fail the engine's step, not this request
        if self.seed is not None and not (is_integer(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.seed is not None and is_integer(self.n) and self.seed + self.n - 1 >= SEED_RANGE[1]:
            raise ValueError(f"seed {self.seed} with n {self.n}: choice i is seeded seed + i, so seed must be below "
                             f"2**64 - {self.n - 1}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need the text: detokenize=False leaves none (use stop_token_ids)")
        if not math.isfinite(self.temperature) or not math.isfinite(self.top_p):
            raise ValueError(f"temperature and top_p must be finite, got {self.temperature}, {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 1e4:  # (an infinite penalty is no rule: finite, positive)
            raise ValueError(f"repetition_penalty must be in (0, 1e4], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids >= 0, got "
                             f"{list(self.allowed_token_ids)[:5]}")
        if self.truncate_prompt_tokens is not None:
            check_truncation(self.truncate_prompt_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (is_integer(k) and 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")

    def clone(self) -> "SamplingParams":
        """vLLM's: a copy (ours are frozen: dataclasses.replace(params, field=value) makes a changed one)."""
        return dataclasses.replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def choices(self) -> list["SamplingParams"]:
        """One request's params per choice: n 1, choice i seeded seed + i (an unseeded choice's generator is seeded
        from the engine's seed source at its first draw: engine/sampler.py)."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, best_of=None, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens leaves it."""
        return left_truncated(prompt_ids, self.truncate_prompt_tokens, max_model_len)

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the request's tokens (penalties, min_tokens): each step's tokens must then be on
        the host before the next step samples, so async scheduling pauses while such a request runs."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.min_tokens > 0 or bool(self.bad_words))
