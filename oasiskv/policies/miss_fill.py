"""Oasis's "fill" miss policy: a selected block that is not resident gives its place to the best-scoring
resident block outside the selection, so x_t still attends to up to a budget of tokens.

Under "skip" a miss shrinks x_t's attention by one block. The working set holds the previous step's
prediction, which overlaps the selection but is not equal to it, so resident blocks that x_t did not
select are at hand; x_t's own scores rank them. A step without misses attends to its selection
exactly, so with a perfect draft and the cap at 1 oasis still equals quest.

Plain torch ops on both devices: fixed shapes, no host sync, so they are captured in a step's CUDA graph."""
from __future__ import annotations

import torch


def fill_misses(attended: torch.Tensor, selection: torch.Tensor, scores: torch.Tensor, resident: torch.Tensor,
                nblocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (attended with misses filled, bool [B, K]: the places filled).

    attended:  int32 [B, K + E] (E >= 0 extra columns, kept as they are): the first K columns are `selection`
               with -1 where a selected block is not resident.
    selection: int32 [B, K], logical blocks, -1 as padding.
    scores:    fp32 [B, W], x_t's block scores (columns at or beyond a row's nblocks are ignored).
    resident:  bool [B, W], whether each logical block has a slot in the working set.
    nblocks:   int [B], x_t's logical blocks.
    The i-th miss of a row (in column order) takes the row's i-th best candidate: a resident block,
    below nblocks, not selected. Misses beyond the candidates stay -1."""
    _check(attended, selection, scores, resident, nblocks)
    batch, k = selection.shape
    width = scores.shape[1]
    miss = (selection >= 0) & (attended[:, :k] < 0)
    selected = torch.zeros(batch, width + 1, dtype=torch.bool, device=scores.device)
    selected.scatter_(1, torch.where(selection >= 0, selection, width).long(), True)  # pads land in column W
    columns = torch.arange(width, device=scores.device)
    candidate = resident & ~selected[:, :width] & (columns[None, :] < nblocks[:, None])
    ranked = torch.where(candidate, scores.float(), float("-inf"))
    top = min(k, width)
    best, order = ranked.topk(top, dim=1)
    place = miss.cumsum(1) - 1  # the i-th miss of its row takes candidate i
    rank = place.clamp(0, top - 1)
    filled = miss & (place < top) & torch.isfinite(best.gather(1, rank))
    first = torch.where(filled, order.gather(1, rank).to(attended.dtype), attended[:, :k])
    return torch.cat([first, attended[:, k:]], 1), filled


def fill_misses_reference(attended, selection, scores, resident, nblocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute-force twin of fill_misses, row by row in Python (for tests)."""
    out, filled = attended.clone(), torch.zeros(selection.shape, dtype=torch.bool)
    for b in range(selection.shape[0]):
        chosen = {int(x) for x in selection[b] if x >= 0}
        pool = [j for j in range(int(nblocks[b])) if j < scores.shape[1] and bool(resident[b, j]) and j not in chosen]
        pool.sort(key=lambda j: (-float(scores[b, j]), j))
        for i in range(selection.shape[1]):
            if selection[b, i] >= 0 and attended[b, i] < 0 and pool:
                out[b, i], filled[b, i] = pool.pop(0), True
    return out, filled


def _check(attended, selection, scores, resident, nblocks) -> None:
    batch, k = selection.shape
    if attended.dim() != 2 or attended.shape[0] != batch or attended.shape[1] < k:
        raise ValueError(f"attended must be [B, >= K] = [{batch}, >= {k}], got {tuple(attended.shape)}")
    if scores.dim() != 2 or scores.shape[0] != batch or resident.shape != scores.shape:
        raise ValueError(f"scores and resident must both be [B={batch}, W], got {tuple(scores.shape)} and "
                         f"{tuple(resident.shape)}")
    if resident.dtype != torch.bool or nblocks.shape != (batch,):
        raise ValueError(f"resident must be bool and nblocks [B={batch}], got {resident.dtype} and {tuple(nblocks.shape)}")
