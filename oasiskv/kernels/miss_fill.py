"""Oasis's "fill" miss policy in one launch per layer: a selected block that is not resident gives its
place to the best-scoring resident block outside the selection, so x_t still attends to up to a budget.

Under "skip" a miss shrinks x_t's attention by one block. The working set holds the previous step's
prediction, which overlaps x_t's selection but is not equal to it, so resident blocks x_t did not select are
at hand, and x_t's own scores rank them. A row without misses keeps its selection exactly, so with a
perfect draft and the cap at 1 oasis still equals quest.

For decode row b (request row r = rows[b]):
  miss[b, j]   = selection[b, j] >= 0 and attended[b, j] < 0           (j < K)
  candidates   = blocks held in block_of[r, :] (the layer's slots), below nblocks[b], not in attended[b, :K]
  the i-th miss of the row (in column order) takes the i-th best candidate: higher score first, the lower
  block id on a tie; candidates scored -inf are never taken, and misses past the candidates stay -1.
Columns of `attended` past K (oasis's opened block) are copied unchanged. Returns the filled `attended` and
the count of places filled per row. With `counters`, those counts are also added to the policy's counter tables
(row_counts[rows[b], column] and layer_counts[layer, column]) in the same launch, as the residency kernel adds its
own: without them, each layer's counts took a chain of small launches.

The kernel loops once per miss of its row, each pass a max and a min over the row's slots; it finds the slots
`attended` already holds a few columns at a time (the compare's size stays bounded as the working set grows).
The torch twin runs on the CPU; the tests check both against a row-by-row brute force."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from oasiskv.kernels.aot import compile_ahead
from oasiskv.kernels.value_checks import check_range, checks_values

__all__ = ["FillCounters", "fill_misses", "fill_misses_reference"]


@dataclass(frozen=True)
class FillCounters:
    """Where fill_misses adds the places it filled: row_counts int64 [rows, counters] (a request row each),
    layer_counts int64 [layers, counters], both in column `column`, the layer's row `layer`."""

    row_counts: torch.Tensor
    layer_counts: torch.Tensor
    column: int
    layer: int


@triton.jit
def _fill_kernel(att_ptr, sel_ptr, score_ptr, block_of_ptr, rows_ptr, nblocks_ptr, out_ptr, count_ptr,
                 row_counts_ptr, layer_counts_ptr, column, layer, s_rc, s_lc,
                 K, E, S, s_att, s_sel, s_score, s_block_of, s_out,
                 K_PAD: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                 COUNT: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, K_PAD)
    sel = tl.load(sel_ptr + b * s_sel + j, mask=j < K, other=-1)
    att = tl.load(att_ptr + b * s_att + j, mask=j < K, other=-1)
    e = tl.arange(0, E_PAD)
    tl.store(out_ptr + b * s_out + K + e, tl.load(att_ptr + b * s_att + K + e, mask=e < E), mask=e < E)

    miss = (sel >= 0) & (att < 0)
    misses = tl.sum(miss.to(tl.int32), axis=0)
    place = tl.cumsum(miss.to(tl.int32), axis=0) - 1  # the i-th miss takes candidate i

    r = tl.load(rows_ptr + b).to(tl.int64)
    n = tl.load(nblocks_ptr + b)
    s = tl.arange(0, S_PAD)
    held = tl.load(block_of_ptr + r * s_block_of + s, mask=s < S, other=-1)
    taken = tl.zeros([S_PAD], dtype=tl.int32)
    c = tl.arange(0, CHUNK)
    for start in range(0, K, CHUNK):  # a [S_PAD, CHUNK] compare at a time: one of [S_PAD, K_PAD] spilled so
        # badly at 513 slots that ptxas ran for minutes
        part = tl.load(att_ptr + b * s_att + start + c, mask=start + c < K, other=-1)
        hit = (held[:, None] == part[None, :]) & (part[None, :] >= 0)
        taken = tl.maximum(taken, tl.max(hit.to(tl.int32), axis=1))
    taken = taken > 0
    free = (held >= 0) & (held < n) & ~taken
    score = tl.load(score_ptr + b * s_score + held, mask=free, other=float("-inf"))
    free = free & (score > float("-inf"))

    out = att
    filled = tl.zeros([K_PAD], dtype=tl.int32)
    for i in range(misses):
        best = tl.max(tl.where(free, score, float("-inf")), axis=0)
        pick = tl.min(tl.where(free & (score == best), held, 2147483647), axis=0)
        here = miss & (place == i)
        here = here & (tl.where(here, best, float("-inf")) > float("-inf"))  # no candidate left: stays -1
        out = tl.where(here, pick, out)
        filled += here.to(tl.int32)
        free = free & (held != pick)
    tl.store(out_ptr + b * s_out + j, out, mask=j < K)
    total = tl.sum(filled, axis=0)
    tl.store(count_ptr + b, total)
    if COUNT:  # relaxed: the counters are read only after the kernel ends
        tl.atomic_add(row_counts_ptr + r * s_rc + column, total.to(tl.int64), sem="relaxed")
        tl.atomic_add(layer_counts_ptr + layer * s_lc + column, total.to(tl.int64), sem="relaxed")


def fill_misses(attended: torch.Tensor, selection: torch.Tensor, scores: torch.Tensor, block_of: torch.Tensor,
                rows: torch.Tensor, nblocks: torch.Tensor, counters: FillCounters | None = None,
                num_warps: int = 4, check_values: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """attended int32 [B, K + E], selection int32 [B, K], scores fp32 [B, W] (x_t's block scores; every block
    held below nblocks must be < W), block_of int32 [R, S] (the layer's slots per request row), rows int [B]
    (distinct), nblocks int32 [B]. Returns (attended filled, int32 [B] places filled), as the module docstring
    says, and adds the places to `counters` if given. Four warps with compares of 8192 pairs measured fastest on
    the H200 at 129 and 513 slots (scripts/gpu_fill_bench.py, which times the others through `num_warps`). The rows
    and held blocks are checked where that costs no sync (value_checks.checks_values)."""
    _check(attended, selection, scores, block_of, rows, nblocks, counters)
    if checks_values(check_values, attended.device):
        check_values_of(scores, block_of, rows, nblocks, counters)
    if not (attended.is_cuda or type(_fill_kernel).__name__ == "InterpretedFunction"):
        return fill_misses_reference(attended, selection, scores, block_of, rows, nblocks, counters)
    batch, k = selection.shape
    extra = attended.shape[1] - k
    out = torch.empty_like(attended)
    if batch == 0 or k == 0:
        out.copy_(attended)
        return out, torch.zeros(batch, dtype=torch.int32, device=attended.device)
    counts = torch.empty(batch, dtype=torch.int32, device=attended.device)  # the kernel writes every row's
    # without counters, COUNT=False compiles the atomics out and the table arguments are never read
    tables = ((counters.row_counts, counters.layer_counts, counters.column, counters.layer,
               counters.row_counts.stride(0), counters.layer_counts.stride(0)) if counters
              else (counts, counts, 0, 0, 0, 0))
    _fill_kernel[(batch,)](attended, selection, scores, block_of, rows.contiguous(), nblocks.contiguous(), out,
                           counts, *tables, k, extra, block_of.shape[1], attended.stride(0), selection.stride(0),
                           scores.stride(0), block_of.stride(0), out.stride(0), COUNT=counters is not None,
                           **_constants(k, block_of.shape[1], extra), num_warps=num_warps)
    return out, counts


def _constants(k: int, slots: int, extra: int) -> dict:
    k_pad, s_pad = max(2, triton.next_power_of_2(k)), max(2, triton.next_power_of_2(slots))
    return dict(K_PAD=k_pad, S_PAD=s_pad, E_PAD=max(2, triton.next_power_of_2(max(extra, 1))),
                CHUNK=max(2, min(k_pad, _COMPARE_ELEMENTS // s_pad)))


_COMPARE_ELEMENTS = 8192  # slots x selected columns compared at once (a pass of [256, 32] at 129 slots)


_POINTERS = {"att_ptr": "*i32", "sel_ptr": "*i32", "score_ptr": "*fp32", "block_of_ptr": "*i32", "rows_ptr": "*i64",
             "nblocks_ptr": "*i32", "out_ptr": "*i32", "count_ptr": "*i32", "row_counts_ptr": "*i64",
             "layer_counts_ptr": "*i64"}


def compile_for(arch: int, slots: int, k: int):
    """_fill_kernel compiled ahead of time (kernels/aot.py), counting, for a selection of `k` blocks, `slots`
    working-set slots per row and oasis's one extra column."""
    return compile_ahead(_fill_kernel, _POINTERS, dict(**_constants(k, slots, 1), COUNT=True), arch, num_warps=4)


def fill_misses_reference(attended, selection, scores, block_of, rows, nblocks,
                          counters: FillCounters | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of fill_misses: fixed shapes, no host sync (it also runs inside a CUDA graph)."""
    _check(attended, selection, scores, block_of, rows, nblocks, counters)
    batch, k = selection.shape
    width = scores.shape[1]
    head = attended[:, :k]
    miss = (selection >= 0) & (head < 0)
    held = block_of[rows.long()].long()  # [B, S]
    resident = _mark(held, width)
    taken = _mark(head.long(), width)
    columns = torch.arange(width, device=scores.device)
    free = resident & ~taken & (columns[None, :] < nblocks[:, None])
    ranked = torch.where(free, scores.float(), float("-inf"))
    best, order = torch.sort(ranked, dim=1, descending=True, stable=True)  # ties: the lower block first
    place = miss.cumsum(1) - 1
    top = min(k, width)
    pick = place.clamp(0, top - 1)
    filled = miss & (place < top) & torch.isfinite(best[:, :top].gather(1, pick))
    head = torch.where(filled, order.gather(1, pick).to(attended.dtype), head)
    counts = filled.sum(1, dtype=torch.int32)
    if counters:
        counters.row_counts[:, counters.column].index_add_(0, rows.long(), counts.long())
        counters.layer_counts[counters.layer, counters.column] += counts.sum()
    return torch.cat([head, attended[:, k:]], 1), counts


def _mark(blocks: torch.Tensor, width: int) -> torch.Tensor:
    """bool [B, width]: which of columns 0..width-1 appear in `blocks` (int [B, N]; -1 and ids >= width ignored)."""
    inside = (blocks >= 0) & (blocks < width)
    marks = torch.zeros(blocks.shape[0], width + 1, dtype=torch.bool, device=blocks.device)
    return marks.scatter_(1, torch.where(inside, blocks, width), True)[:, :width]


def _check(attended, selection, scores, block_of, rows, nblocks, counters=None) -> None:
    if selection.dim() != 2 or selection.dtype != torch.int32:
        raise ValueError(f"selection must be int32 [B, K], got {selection.dtype} {tuple(selection.shape)}")
    batch, k = selection.shape
    if attended.dim() != 2 or attended.dtype != torch.int32 or attended.shape[0] != batch or attended.shape[1] < k:
        raise ValueError(f"attended must be int32 [B, >= K] = [{batch}, >= {k}], got {attended.dtype} "
                         f"{tuple(attended.shape)}")
    if scores.dim() != 2 or scores.shape[0] != batch or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [B={batch}, W], got {scores.dtype} {tuple(scores.shape)}")
    if block_of.dim() != 2 or block_of.dtype != torch.int32:
        raise ValueError(f"block_of must be int32 [rows, slots], got {block_of.dtype} {tuple(block_of.shape)}")
    if rows.shape != (batch,) or nblocks.shape != (batch,):
        raise ValueError(f"rows and nblocks must be [B={batch}], got {tuple(rows.shape)} and {tuple(nblocks.shape)}")
    for name, t in (("rows", rows), ("nblocks", nblocks)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (("selection", selection), ("scores", scores), ("block_of", block_of), ("rows", rows),
                    ("nblocks", nblocks)):
        if t.device != attended.device:
            raise ValueError(f"{name} is on {t.device}, attended on {attended.device}")
    if attended.stride(1) != 1 or selection.stride(1) != 1 or scores.stride(1) != 1 or block_of.stride(1) != 1:
        raise ValueError("attended, selection, scores and block_of must be contiguous along their last dimension")
    if counters is not None:
        _check_counters(counters, attended.device)


def check_values_of(scores, block_of, rows, nblocks, counters=None) -> None:
    """The kernel reads block_of's row of each rows[b] (and adds to its row of row_counts), and the score of each
    block held there below nblocks[b]."""
    high = block_of.shape[0] if counters is None else min(block_of.shape[0], counters.row_counts.shape[0])
    check_range("rows", rows, 0, high)
    held = block_of[rows.long()]
    read = (held >= 0) & (held < nblocks[:, None])
    check_range("blocks held below nblocks (block_of)", held[read], 0, scores.shape[1])


def _check_counters(c: FillCounters, device: torch.device) -> None:
    for name, table in (("row_counts", c.row_counts), ("layer_counts", c.layer_counts)):
        if table.dim() != 2 or table.dtype != torch.int64 or table.stride(1) != 1 or table.device != device:
            raise ValueError(f"counters.{name} must be int64 [n, counters], contiguous in its last dimension, on "
                             f"{device}; got {table.dtype} {tuple(table.shape)} on {table.device}")
    if not (0 <= c.column < c.row_counts.shape[1] and c.column < c.layer_counts.shape[1]
            and 0 <= c.layer < c.layer_counts.shape[0]):
        raise ValueError(f"counters: column {c.column} or layer {c.layer} is outside the tables")
