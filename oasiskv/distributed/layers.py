"""Parallel layers. Column-parallel linears need no layer of their own: each rank keeps a slice of
the output rows in a plain Linear. Row-parallel linears sum their partial outputs over ranks;
the vocabulary is split into equal ranges (the last padded with zero rows) for the embedding, whose
partial lookups are summed, and the LM head, whose logits are gathered."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from oasiskv.models.linear import linear


class RowParallelLinear(nn.Linear):
    """Input columns split across ranks: y = all_reduce(x_local @ W_local^T). No bias (it would be
    added once per rank)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; tokens outside the range look up zeros."""

    def __init__(self, weight: torch.Tensor, start: int, real_rows: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.real_rows = start, real_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.real_rows)
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        dist.all_reduce(out)
        return out


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary range, gathered from all ranks and cut to the vocabulary."""

    def __init__(self, weight: nn.Parameter, vocab_size: int):
        super().__init__()
        self.weight, self.vocab_size = weight, vocab_size  # may be the embedding's (tied) parameter

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = linear(hidden, self.weight)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]
