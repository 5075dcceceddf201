"""Offline API shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass, field
from typing import Sequence

from tqdm.auto import tqdm

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SchedulerConfig, draft_of_speculative_config
from oasiskv.sampling_params import MAX_LOGPROBS, SamplingParams, is_integer
from oasiskv.engine.engine import LLMEngine
from oasiskv.engine.logprobs import LogprobSampler, TokenLogprob, prompt_logprobs
from oasiskv.engine.request import Request

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


@dataclass
class Logprob:
    """vLLM's: a token's logprob, its rank in its row (1: the most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None  # SamplingParams.logprobs: per token, it and the top k
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it; None for EOS
    cumulative_logprob: float | None = None  # the sampled tokens' logprobs summed (with SamplingParams.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # SamplingParams.prompt_logprobs; first: None

    @classmethod
    def from_requests(cls, reqs: list[Request]) -> "RequestOutput":
        """One prompt's choices (n of them); the request id and metrics are the first choice's."""
        req = reqs[0]
        completions = [CompletionOutput(i, r.output_text, list(r.output_token_ids), r.finish_reason,
                                        stop_reason=r.stop_reason) for i, r in enumerate(reqs)]
        metrics = {"num_preemptions": req.num_preemptions, **req.kv_stats}
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
        if req.finish_time is not None:
            metrics["latency_s"] = req.finish_time - req.arrival_time
        return cls(req.request_id, req.prompt, list(req.prompt_token_ids), completions,
                   all(r.finished for r in reqs), metrics)


ANY = object()
# vLLM's LLM(...) arguments with no counterpart here, and the values that change nothing here (ANY: every value).
# Another value is refused, naming the argument, rather than ignored: the user would get what they did not ask for.
VLLM_ONLY_ARGUMENTS = {
    "trust_remote_code": ANY,  # no model code is loaded from a checkpoint here
    "disable_log_stats": ANY, "download_dir": ANY,  # (nothing is downloaded)
    "swap_space": ANY,  # a preempted request is recomputed, never swapped
    "enable_chunked_prefill": (None, True),  # prefill is always chunked (--max-num-batched-tokens)
    "enable_prefix_caching": (None, False), "quantization": (None,), "kv_cache_dtype": ("auto",),
    "cpu_offload_gb": (0,), "revision": (None,), "tokenizer_revision": (None,), "task": ("auto", "generate"),
}


def without_vllm_only(kwargs: dict) -> dict:
    """kwargs less VLLM_ONLY_ARGUMENTS at values that change nothing; max_logprobs within this engine's cap, and
    speculative_config as --draft / --draft-model."""
    out = {}
    for key, value in kwargs.items():
        allowed = VLLM_ONLY_ARGUMENTS.get(key)
        if key == "max_logprobs":
            if not (is_integer(value) and 0 <= value <= MAX_LOGPROBS):
                raise TypeError(f"max_logprobs: this engine returns at most {MAX_LOGPROBS} logprobs, got {value!r}")
        elif key == "speculative_config":
            if value is not None:
                out["draft"], out["draft_model"] = draft_of_speculative_config(value)
        elif allowed is None:
            out[key] = value
        elif allowed is not ANY and value not in allowed:
            raise TypeError(f"{key}={value!r} is not supported by this engine (it takes {allowed!r} only)")
    return out


def split_kwargs(kwargs: dict) -> EngineConfig:
    """Accepts flat vLLM-style keyword arguments and sorts them into the config chain."""
    sections = {"cache": CacheConfig, "scheduler": SchedulerConfig, "kv": KVConfig}
    nested = {name: {} for name in sections}
    top = {}
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - set(sections)
    for name, value in without_vllm_only(kwargs).items():
        key = {"kv_mode": "mode", "kv_budget": "budget"}.get(name, name)
        owner = next((n for n, c in sections.items() if key in {f.name for f in dataclasses.fields(c)}), None)
        if owner:
            nested[owner][key] = value
        elif key in engine_fields:
            top[key] = value
        else:
            raise TypeError(f"unknown engine argument {key!r}")
        field_type = next(f.type for f in dataclasses.fields(sections.get(owner, EngineConfig)) if f.name == key)
        if isinstance(value, str) and "str" not in str(field_type):  # "256" for 256 fails far from here
            raise TypeError(f"engine argument {name} takes {field_type}, got the string {value!r}")
    return EngineConfig(**top, **{n: sections[n](**v) for n, v in nested.items()})


def chat_messages(conv, index: int) -> list[dict]:
    """A conversation checked as the server checks one (its ChatMessage model: a known role, content a string or a
    list of text parts), as the template's {"role", "content"} dicts."""
    if not isinstance(conv, (list, tuple)) or not conv:
        raise ValueError(f"conversation {index}: a chat is a non-empty list of {{'role', 'content'}} dicts, got "
                         f"{reprlib.repr(conv)}")
    from pydantic import ValidationError  # (the server's extra: an offline run without chat needs neither)

    from oasiskv.server.protocol import ChatMessage

    out = []
    for j, m in enumerate(conv):
        try:
            message = ChatMessage.model_validate(m)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'message'}: {err['msg']}" for err in e.errors())
            raise ValueError(f"conversation {index}, message {j}: {problems}") from None
        out.append({"role": message.role, "content": message.text()})
    return out


def prompt_of(prompt, index: int):
    """vLLM's prompt dicts ({"prompt": text}, {"prompt_token_ids": ids}) as text or ids; others as they are."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"} or set(prompt) == {"prompt_token_ids"}:
        return next(iter(prompt.values()))
    raise ValueError(f"prompt {index}: a dict prompt holds 'prompt' (text) or 'prompt_token_ids' alone; this engine "
                     f"takes no other fields, got {sorted(prompt)}")


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(split_kwargs({"model": model, **kwargs}))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:  # vLLM's name
        return self.engine

    def close(self) -> None:
        """Stops the engine's tensor-parallel ranks now, not at garbage collection (a new one can then start)."""
        self.engine.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation_config.json values (--generation-config), else SamplingParams()."""
        return SamplingParams(**self.engine.generation.sampling)

    def get_tokenizer(self):
        """vLLM's: the transformers tokenizer (apply_chat_template(..., tokenize=False), __call__, decode(...));
        a random-weight model's byte tokenizer where it has none."""
        return getattr(self.engine.tokenizer, "hf", self.engine.tokenizer)

    def generate(self, prompts: str | dict | Sequence[str | dict] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority=None) -> list[RequestOutput]:
        """prompts as vLLM takes them: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}, or a list."""
        priorities = priority if isinstance(priority, (list, tuple)) else [priority]
        if lora_request is not None or any(p not in (None, 0) for p in priorities):
            raise ValueError("lora_request and priority are not supported by this engine; leave them unset")
        if hasattr(prompts, "tolist"):  # a tensor or an array: one prompt of ids, or a batch of them
            prompts = prompts.tolist()
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and
                                                is_integer(prompts[0])):
            prompts = [prompts]
        if isinstance(prompts, (list, tuple)):
            prompts = [prompt_of(p, i) for i, p in enumerate(prompts)]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts: a string, a list of token ids, or a list of either; got "
                             f"{type(prompts).__name__}")
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        wrong = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise ValueError(f"sampling_params: a SamplingParams or a list of them, got {type(wrong).__name__}")
        if any(sp.prompt_logprobs is not None for sp in params) and self.engine.tp:
            raise ValueError("prompt_logprobs needs the whole model in this process (not with tensor parallelism)")
        groups: list[list[str]] = []  # per prompt, its choices' request ids
        try:
            for p, sp in zip(prompts, params):
                groups.append([])
                for choice in sp.choices():
                    groups[-1].append(self.engine.add_request(p, choice))
                    if sp.logprobs is not None:
                        self._logprob_sampler().wanted[groups[-1][-1]] = sp.logprobs
        except ValueError as e:
            self._discard([rid for g in groups for rid in g])  # all or nothing: a bad prompt queues none
            raise ValueError(f"prompt {len(groups) - 1}: {e}") from e
        outputs = self._run(groups, use_tqdm)
        try:
            for out, group, sp in zip(outputs, groups, params):
                self._add_logprobs(out, group, sp)
        finally:  # after an error too (a prompt_logprobs forward out of memory): async scheduling pauses while any
            self._forget_logprobs([rid for g in groups for rid in g])  # request wants logprobs
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's: chat_template replaces the model's; chat_template_kwargs reach the template (e.g. Qwen3's
        enable_thinking)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages: a list of {{'role', 'content'}} dicts, or a list of such lists; got "
                             f"{reprlib.repr(messages)}")
        if not isinstance(chat_template_kwargs, (dict, type(None))):
            raise ValueError(f"chat_template_kwargs: a dict of the template's variables, got "
                             f"{reprlib.repr(chat_template_kwargs)}")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        # as vLLM: chat_template_kwargs override the named options (a key in both was a TypeError)
        options = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, **(chat_template_kwargs or {})}
        texts = [self.tokenizer.render_chat(chat_messages(conv, i), **options) for i, conv in enumerate(conversations)]
        outputs = self.generate([self.tokenizer.encode_continuation(t) for t in texts], sampling_params, use_tqdm,
                                lora_request)
        for out, text in zip(outputs, texts):
            out.prompt = text  # vLLM's: the rendered conversation
        return outputs

    def _run(self, groups: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        ids = [rid for g in groups for rid in g]
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm, leave=False)
        try:
            while self.engine.has_unfinished():
                bar.update(len(self.engine.step()))
        except BaseException:  # an error or Ctrl-C: the next call must not run (or wait on) this call's requests
            self._discard(ids)
            raise
        finally:
            bar.close()
        return [RequestOutput.from_requests([self.engine.pop_finished(i) for i in g]) for g in groups]

    def _discard(self, ids: list[str]) -> None:
        self.engine.discard(ids)
        self._forget_logprobs(ids)

    def _forget_logprobs(self, ids: list[str]) -> None:
        if isinstance(self.engine.sampler, LogprobSampler):
            for rid in ids:
                self.engine.sampler.drop(rid)

    def _logprob_sampler(self) -> LogprobSampler:
        """The engine's sampler, wrapped once so that it records the logprobs of the requests that want them."""
        if not isinstance(self.engine.sampler, LogprobSampler):
            self.engine.sampler = LogprobSampler(self.engine.sampler)
        return self.engine.sampler

    def _add_logprobs(self, out: RequestOutput, group: list[str], sp: SamplingParams) -> None:
        if sp.logprobs is not None:
            sampler = self._logprob_sampler()
            for choice, rid in zip(out.outputs, group):
                taken = sampler.take(rid)
                choice.logprobs = [self._logprob_dict(lp, sp.detokenize) for lp in taken]
                choice.cumulative_logprob = sum(lp.logprob for lp in taken)
        if sp.prompt_logprobs is not None:
            found = prompt_logprobs(self.engine.model, out.prompt_token_ids, sp.prompt_logprobs, self.engine.device)
            out.prompt_logprobs = [None if lp is None else self._logprob_dict(lp, sp.detokenize) for lp in found]

    def _logprob_dict(self, lp: TokenLogprob, detokenize: bool = True) -> dict[int, Logprob]:
        """vLLM's shape: the token itself first, then the top k (a token in both is listed once). Each token's text
        is vLLM's decoded_token: the token decoded alone, special tokens kept (the engine's decode drops them); None
        without detokenize."""
        decode = self.get_tokenizer().decode
        text = decode if detokenize else (lambda ids: None)
        out = {lp.token_id: Logprob(lp.logprob, lp.rank, text([lp.token_id]))}
        for rank, (token, value) in enumerate(lp.top, start=1):
            out.setdefault(token, Logprob(value, rank, text([token])))
        return out
