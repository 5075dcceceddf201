"""Token sampling: greedy, temperature, top-k, top-p; a generator per sampled request (seeded by the request, or
from the engine's seed), so a request draws the same tokens whatever else shares its batch."""
from __future__ import annotations

import dataclasses
import random

import torch

from oasiskv.config import SamplingParams
from oasiskv.engine.penalties import TokenHistory, apply_penalties, token_mask


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with the excluded tokens at -inf."""
    if top_k != -1 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token if the mass strictly before it is < top_p; the top token always (a top_p below fp32's
        # smallest float compares as 0, and 0 >= 0 dropped every token: NaNs, and token 0 came out)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    return int(draw_row(logits, params, generator))


def draw_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The sampled token as a 0-d int64 tensor on the logits' device (no host sync)."""
    if params.greedy:
        return torch.argmax(logits)
    # The max subtracted first: a small temperature (1e-5 and up; below it is greedy) then divides no logit to inf
    logits = (logits - logits.max()) / params.temperature
    if params.min_p > 0:  # (the top token's logit is 0 here: its probability is 1 / sum(exp))
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    logits = apply_top_k_top_p(logits, params.top_k, params.top_p)
    probs = logits.softmax(-1)
    # exponential race: argmax(p / E), E ~ Exp(1), samples from p (one draw per vocab entry)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / noise)


class Sampler:
    reads_each_step = False  # a wrapper that must see each step's tokens on the host pauses async scheduling

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        # each sampled request draws from its own generator; an unseeded one's is seeded from this source at its
        # first draw, so no request's draws move another's (async scheduling's extra step for a request that
        # stopped draws from that request's generator alone)
        self.seed_source = random.Random(seed)
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_seen: dict[str, torch.Tensor] = {}  # request -> its prompt's token mask (repetition penalty)
        self.allowed: dict[str, torch.Tensor] = {}  # request -> its allowed_token_ids on the device, made once

    def generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if request_id not in self.generators:
            seed = self.seed_source.getrandbits(63) if params.seed is None else params.seed
            self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[request_id]

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               histories: list[TokenHistory | None] | None = None) -> list[int]:
        """logits [S, V] fp32, one row per sampling request. histories: per row, the tokens its penalties read
        (None where it has none; see engine/penalties.py)."""
        return self.sample_on_device(logits, request_ids, params, histories).tolist()

    def sample_on_device(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
                         histories: list[TokenHistory | None] | None = None) -> torch.Tensor:
        """The tokens as int64 [S] on the logits' device, without waiting for them (async scheduling reads them a
        step later). The draws are those of `sample`: the same ops on the same generators, in row order."""
        if any(p.logit_bias or p.allowed_token_ids for p in params) or \
                (histories is not None and any(h is not None for h in histories)):
            logits = self.adjusted(logits, request_ids, params, histories)
        if all(p.greedy for p in params):
            return torch.argmax(logits, dim=-1)
        return torch.stack([draw_row(logits[i], p, None if p.greedy else self.generator_for(rid, p))
                            for i, (rid, p) in enumerate(zip(request_ids, params))])

    def adjusted(self, logits, request_ids, params, histories) -> torch.Tensor:
        """A copy of the logits with each row's tokens outside allowed_token_ids at -inf, its logit_bias added, then
        its history's penalties applied, in vLLM's order (the caller's rows stay raw: logprobs are reported before
        them, as vLLM does by default)."""
        logits = logits.clone()
        for i, (rid, p, history) in enumerate(zip(request_ids, params, histories or [None] * len(params))):
            if p.allowed_token_ids:
                if rid not in self.allowed:  # (a host-to-device copy per request, not per step)
                    self.allowed[rid] = torch.tensor(p.allowed_token_ids, device=logits.device)
                allowed = self.allowed[rid]
                kept = logits[i, allowed]
                logits[i] = float("-inf")
                logits[i, allowed] = kept
            if p.logit_bias:
                ids, biases = zip(*p.logit_bias)
                logits[i, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
            if history is None:
                continue
            seen = None
            if p.repetition_penalty != 1:
                if rid not in self.prompt_seen:
                    self.prompt_seen[rid] = token_mask(history.prompt, logits.shape[-1], logits.device)
                seen = self.prompt_seen[rid]
            row = apply_penalties(logits[i], history, p, seen)
            if p.allowed_token_ids and history.banned and bool(torch.isneginf(row).all()):
                # min_tokens or bad_words banned every allowed id: the allowed ids win (a ban-free draw among them),
                # where every logit at -inf would have drawn id 0, which is not allowed
                row = apply_penalties(logits[i], dataclasses.replace(history, banned=()), p, seen)
            logits[i] = row
        return logits

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.prompt_seen.pop(request_id, None)
        self.allowed.pop(request_id, None)
