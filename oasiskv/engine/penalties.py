"""vLLM's sampling penalties and min_tokens, applied to a request's logits row before temperature, top-k/top-p and
the draw (greedy requests included, as in vLLM).

- repetition_penalty r (CTRL; transformers' RepetitionPenaltyLogitsProcessor): every token id seen in the prompt or
  the output has its logit divided by r where positive, multiplied by r where negative;
- frequency_penalty f and presence_penalty p (OpenAI's rule): logit -= f * (times the id occurs in the output)
  + p * (1 if it occurs in the output at all);
- min_tokens: while the output is shorter, EOS and the stop token ids cannot be drawn (their logits are -inf);
- bad_words: a word's last token cannot be drawn where the output ends with the word's other tokens (one-token words
  never); each word is tokenized as it is and, where that gives other tokens of the same count, after a space.

The engine hands each such request's ids over as a TokenHistory (plain ints); a request's prompt mask is built once
and kept by the sampler (Sampler.prompt_seen)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """A request's tokens, as its penalties read them."""

    prompt: list[int]
    output: list[int]
    banned: tuple[int, ...] = ()  # ids that cannot be drawn now (EOS and stop ids before min_tokens)


def token_mask(ids: list[int], vocab: int, device) -> torch.Tensor:
    """bool [vocab]: True at each id in `ids`."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    if ids:
        mask[torch.tensor(ids, dtype=torch.long, device=device)] = True
    return mask


def apply_penalties(logits: torch.Tensor, history: TokenHistory, params: SamplingParams,
                    prompt_seen: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] fp32 -> a new row with the request's penalties and bans applied. prompt_seen: the prompt's
    token_mask, where the caller keeps it (else built here)."""
    vocab, device = logits.shape[0], logits.device
    logits = logits.clone()
    counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
    if history.output:
        ids = torch.tensor(history.output, dtype=torch.long, device=device)
        counts.index_add_(0, ids, torch.ones(len(history.output), dtype=logits.dtype, device=device))
    if params.repetition_penalty != 1:
        seen = counts > 0
        seen |= prompt_seen if prompt_seen is not None else token_mask(history.prompt, vocab, device)
        r = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        # a tiny r overflows logit / r to inf, and inf - inf is NaN in the draw: the largest float ranks the same
        logits = logits.clamp(max=torch.finfo(logits.dtype).max)
    if params.frequency_penalty != 0:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty != 0:
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    banned = [t for t in history.banned if 0 <= t < vocab]  # a stop id may lie outside the vocabulary
    if banned:
        logits[torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")
    return logits


def bad_word_token_ids(tokenizer, words: tuple[str, ...], vocab: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad_words: each word's ids without special tokens, and, as a second entry, its ids
    after a space where those start with another token and are as many (the word inside a text, for tokenizers that
    mark a word's start)."""
    out = []
    for word in words:
        bare = tuple(tokenizer.encode_continuation(word.lstrip()))
        spaced = tuple(tokenizer.encode_continuation(" " + word.lstrip()))
        out += [ids for ids in (bare, spaced if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare)
                                else ()) if ids]
    bad = sorted({t for ids in out for t in ids if not 0 <= t < vocab})
    if bad:
        raise ValueError(f"bad_words tokenize to ids outside the vocabulary of {vocab}: {bad[:5]}")
    return tuple(out)


def banned_by_bad_words(word_ids: tuple[tuple[int, ...], ...], output: list[int]) -> tuple[int, ...]:
    """The ids that would complete a bad word after this output (its other tokens end the output)."""
    return tuple(ids[-1] for ids in word_ids
                 if len(ids) <= len(output) + 1 and tuple(output[len(output) - len(ids) + 1:]) == ids[:-1])
