"""Logprobs of sampled tokens (a wrapper around the engine's sampler sees every logits row it samples
from) and of prompt tokens (one cache-free forward of the model over the prompt: the server's `echo`, the offline
API's prompt_logprobs). The server's response shapes are in server/logprobs.py.

Both are log_softmax of the model's raw logits, before temperature, top-k and top-p, as in vLLM."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from oasiskv.policies.dense import causal_attention


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens, most likely first
    rank: int = 1  # the token's rank in its row: how many tokens are at least as likely (ties ahead, as in vLLM)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logits [N, V] -> for row i: the logprob of token_ids[i] and the ks[i] most likely tokens.
    One log_softmax, one gather, one topk and one copy to the host for all rows."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(token_ids, dtype=torch.long, device=rows.device)
    chosen_rows = rows.gather(1, targets[:, None])
    ranks = (rows >= chosen_rows).sum(dim=1).tolist()
    chosen = chosen_rows.squeeze(1).tolist()
    top_values, top_ids = [[]] * len(token_ids), [[]] * len(token_ids)
    if max(ks, default=0):
        values, ids = torch.topk(rows, max(ks), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [TokenLogprob(t, lp, list(zip(top_ids[i][:k], top_values[i][:k])), ranks[i])
            for i, (t, lp, k) in enumerate(zip(token_ids, chosen, ks))]


class LogprobSampler:
    """Stands in for `engine.sampler`: samples with the engine's own sampler, then records the logprobs
    of the sampled token for the requests that asked for them. Runs on the engine thread only."""

    def __init__(self, inner):
        self.inner = inner
        self.wanted: dict[str, int] = {}  # request id -> how many top logprobs
        self.recorded: dict[str, list[TokenLogprob]] = defaultdict(list)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params, *args, **kwargs) -> list[int]:
        tokens = self.inner.sample(logits, request_ids, params, *args, **kwargs)
        rows = [i for i, rid in enumerate(request_ids) if rid in self.wanted]
        if rows:
            ks = [self.wanted[request_ids[i]] for i in rows]
            found = token_logprobs(logits[rows], [int(tokens[i]) for i in rows], ks)
            for i, lp in zip(rows, found):
                self.recorded[request_ids[i]].append(lp)
        return tokens

    @property
    def reads_each_step(self) -> bool:
        """While a request wants logprobs, each step's tokens are read before the next is planned (async
        scheduling pauses): the logprobs are taken here, from `sample`, beside the tokens they belong to."""
        return bool(self.wanted)

    def take(self, request_id: str) -> list[TokenLogprob]:
        return self.recorded.pop(request_id, [])

    def drop(self, request_id: str) -> None:
        self.wanted.pop(request_id, None)
        self.recorded.pop(request_id, None)

    def __getattr__(self, name):  # forget(), generators, ...: the engine's sampler answers
        return getattr(self.inner, name)


class CausalNoCache:
    """Attention backend for a forward without a KV cache: plain causal attention over the input."""

    def attend(self, layer, q, k, v):
        return causal_attention(q, k, v, q.shape[-1] ** -0.5)


@torch.inference_mode()
def prompt_logprobs(model, token_ids: list[int], k: int, device, rows_per_chunk: int = 256
                    ) -> list[TokenLogprob | None]:
    """Logprob of each prompt token given the ones before it; the first has none (None)."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    hidden, _ = model(ids, torch.arange(len(ids), device=device), CausalNoCache())
    out: list[TokenLogprob | None] = [None]
    for start in range(0, len(ids) - 1, rows_per_chunk):  # position p predicts token p + 1
        end = min(start + rows_per_chunk, len(ids) - 1)
        out += token_logprobs(model.logits(hidden[start:end]), token_ids[start + 1:end + 1], [k] * (end - start))
    return out
