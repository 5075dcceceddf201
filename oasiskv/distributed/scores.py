"""One block selection per (request, layer) across ranks.

A block's score (kernels/block_select.py) is a SUM over KV heads of the MAX over each KV head's
query heads. A rank scores its own KV heads, so:
  KV heads split      each rank holds whole groups: the score is the SUM of the ranks' scores,
                      one all-reduce (sum) of [B, blocks] fp32 per selection;
  KV heads replicated each rank holds part of one group: the MAX over the ranks sharing a KV head,
                      then the SUM over KV heads; one all-gather of [B, blocks] per selection.
Every rank then runs the same deterministic top-k on the same numbers, so the selections, and with
them the working sets and fetches, stay identical on all ranks."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


class ScoreCombiner:
    def __init__(self, world: int, kv_replicas: int, timed: bool = False):
        self.world, self.kv_replicas = world, kv_replicas
        self.timed = timed  # CPU: seconds spent in the collective (on the GPU, time it with a profiler)
        self.calls, self.bytes, self.seconds = 0, 0, 0.0

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """This rank's scores [..., blocks] fp32 (e.g. [B, blocks], or oasis's [2, B, blocks]: x_t's and
        the drafts') -> the scores of the whole model, on every rank."""
        t0 = time.perf_counter() if self.timed else 0.0
        self.calls += 1
        self.bytes += scores.numel() * scores.element_size()
        if self.kv_replicas == 1:
            dist.all_reduce(scores)
            out = scores
        else:
            parts = [torch.empty_like(scores) for _ in range(self.world)]
            dist.all_gather(parts, scores.contiguous())
            out = combine_gathered(torch.stack(parts), self.kv_replicas)
        if self.timed:
            self.seconds += time.perf_counter() - t0
        return out

    def stats(self) -> dict:
        out = {"tp_score_combines": self.calls, "tp_score_combine_bytes": self.bytes}
        if self.timed:
            out["tp_score_combine_s"] = round(self.seconds, 6)
        return out


def combine_gathered(parts: torch.Tensor, kv_replicas: int) -> torch.Tensor:
    """parts [world, ..., blocks], rank order (ranks r * replicas .. share KV head r) -> [..., blocks]."""
    world = parts.shape[0]
    per_head = parts.view(world // kv_replicas, kv_replicas, *parts.shape[1:]).amax(dim=1)
    return per_head.sum(dim=0)
