"""Fused block selection and prefetch planning: one Triton program per row, one launch per call.

:func:`select_blocks_fused` returns exactly what :func:`select_blocks_padded` returns (same rule,
same tie-break), in one kernel instead of ~15 torch ops. :func:`predict_prefetch` is that selection
plus, in the same launch, its bool mask and the blocks to fetch: the predicted blocks not resident,
highest score first, at most ``cap`` (oasis's draft step).

How a row is selected. Each score becomes an integer rank (:func:`_rank_key`: ordered like the fp32
score; NaN and -inf as the lowest finite score, +inf as the largest finite one, -0 as +0). The
threshold T of the ``need`` best ranks is found bit by bit (32 passes of compare-and-count over the
row, held in registers; skipped when every candidate is needed: short rows, few misses); ranks above
T are taken, and of the ranks equal to T the first ones in the row (lower block ids) fill the rest.
The chosen blocks are written in row order (ascending ids) at their running count, then -1 padding:
no sort.

Sizes: rows of up to ``MAX_BLOCKS`` blocks and ``K`` up to ``MAX_K``; larger calls take the torch
path, as do CPU tensors unless this module was imported with ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.selection_rule import _check_select_args, _check_select_values, select_blocks_padded
from oasiskv.kernels.value_checks import check_range, checks_values

__all__ = ["select_blocks_fused", "plan_prefetch_reference", "predict_prefetch",
           "predict_prefetch_reference", "blocks_mask"]

MAX_BLOCKS = 8192  # blocks per row held in one program's registers (128K tokens at 16 per block)
MAX_K = 1024  # widest selection or fetch list


@triton.jit
def _rank_key(x):
    """fp32 -> int64 in [1, 2^32), ordered like x; NaN and -inf rank as the lowest finite value,
    +inf as the largest finite one, -0 as +0 (sign and magnitude of the fp32 bits)."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    nan = mag > 0x7F800000
    mag = tl.minimum(mag, 0x7F7FFFFF)  # inf and NaN -> the largest finite magnitude
    negative = ((bits < 0) | nan) & (mag != 0)
    return tl.where(negative, -mag, mag).to(tl.int64) + 0x7F800000


@triton.jit
def _top_in_order(u, need):
    """bool mask of the `need` largest entries of u (int64, > 0 for candidates, 0 for the others);
    among equal values the earlier entries win. No search when every candidate is needed."""
    chosen = u > 0
    if need < tl.sum(chosen.to(tl.int32), axis=0):
        threshold = tl.full([], 0, tl.int64)
        step = tl.full([], 1 << 31, tl.int64)
        for _ in range(32):  # the largest threshold with at least `need` entries >= it
            trial = threshold + step
            enough = tl.sum((u >= trial).to(tl.int32), axis=0) >= need
            threshold = tl.where(enough, trial, threshold)
            step = step >> 1
        above = u > threshold
        tied = (u == threshold).to(tl.int32)
        ties_before = tl.cumsum(tied, axis=0) - tied
        chosen = above | ((tied != 0) & (ties_before < need - tl.sum(above.to(tl.int32), axis=0)))
    return chosen


@triton.jit
def _store_in_order(out_ptr, chosen, ids, count, width, BLOCK_W: tl.constexpr):
    """Row out[:width] = the ids where chosen, in order, then -1 (count = how many are chosen)."""
    position = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + position, ids, mask=chosen)
    p = tl.arange(0, BLOCK_W)
    tl.store(out_ptr + p, tl.full([BLOCK_W], -1, tl.int32), mask=(p >= count) & (p < width))


@triton.jit
def _resident_row(res_ptr, layer_ptr, rows_ptr, r, s_res_l, s_res_r, INDEXED: tl.constexpr):
    """Start of row r of the residency table: resident[r] or slot_of[layer_of[r], rows[r]]."""
    if INDEXED:
        layer = tl.load(layer_ptr + r).to(tl.int64)
        row = tl.load(rows_ptr + r).to(tl.int64)
        return res_ptr + layer * s_res_l + row * s_res_r
    return res_ptr + r.to(tl.int64) * s_res_r


@triton.jit
def _is_resident(value, SLOTS: tl.constexpr):
    if SLOTS:
        return value >= 0
    return value != 0


@triton.jit
def _select_kernel(scores_ptr, s_sc_r, s_sc_j, n_ptr, counts_ptr, out_ptr, s_out_r,
                   max_blocks, k, budget, sink, local,
                   res_ptr, layer_ptr, rows_ptr, s_res_l, s_res_r, s_res_j,
                   fetch_ptr, s_fetch_r, cap, mask_ptr, s_mask_r, mask_width,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_CAP: tl.constexpr,
                   MASK_TILES: tl.constexpr, PLAN: tl.constexpr, INDEXED: tl.constexpr, SLOTS: tl.constexpr):
    # One program per row: the selection (sink, local window, top scores), and with PLAN its
    # bool mask and the fetch list (selected, not resident, best `cap` scores).
    r = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    n = tl.load(n_ptr + r).to(tl.int32)
    count = tl.minimum(n, budget)
    valid = (j < n) & (j < max_blocks)
    forced = valid & ((j < sink) | (j >= n - local))
    x = tl.load(scores_ptr + r.to(tl.int64) * s_sc_r + j * s_sc_j, mask=valid, other=0.0).to(tl.float32)
    u = tl.where(valid & ~forced, _rank_key(x), 0)
    chosen = forced | _top_in_order(u, count - tl.sum(forced.to(tl.int32), axis=0))
    tl.store(counts_ptr + r, count)
    _store_in_order(out_ptr + r.to(tl.int64) * s_out_r, chosen, j, count, k, BLOCK_K)
    if PLAN:
        row_mask = mask_ptr + r.to(tl.int64) * s_mask_r
        tl.store(row_mask + j, chosen, mask=j < mask_width)
        for tile in tl.static_range(1, MASK_TILES):  # the columns past BLOCK_N: none selected
            tl.store(row_mask + tile * BLOCK_N + j, tl.zeros([BLOCK_N], tl.int1), mask=tile * BLOCK_N + j < mask_width)
        base = _resident_row(res_ptr, layer_ptr, rows_ptr, r, s_res_l, s_res_r, INDEXED)
        resident = _is_resident(tl.load(base + j * s_res_j, mask=chosen, other=0), SLOTS)
        wanted = chosen & ~resident & (x > float("-inf"))
        fetched = tl.minimum(cap, tl.sum(wanted.to(tl.int32), axis=0))
        best = _top_in_order(tl.where(wanted, _rank_key(x), 0), fetched)
        _store_in_order(fetch_ptr + r.to(tl.int64) * s_fetch_r, best, j, fetched, cap, BLOCK_CAP)


# ---------------------------------------------------------------------------------------- dispatch
def _triton_runs(device: torch.device) -> bool:
    # The interpreter is chosen when triton.jit runs (module import), so ask the kernel object.
    return device.type == "cuda" or type(_select_kernel).__name__ == "InterpretedFunction"


def _fits(device: torch.device, max_blocks: int, k: int) -> bool:
    return _triton_runs(device) and max_blocks <= MAX_BLOCKS and k <= MAX_K


def _warps(block: int) -> int:
    """A warp per 256 entries of a row, 4 to 16 (sm_90: 80 registers at 2048/8, a little spill at 8192/16)."""
    return max(4, min(16, block // 256))


# ---------------------------------------------------------------------------------------- residency
def _residency(rows_of: int, width: int, device, resident=None, slot_of=None, layer_of=None, rows=None):
    """(table, layer_of, rows, strides (layer, row, block), indexed, slots) for the kernels; checks. `width`: the
    scores' N, the blocks whose residency the kernels read."""
    if (resident is None) == (slot_of is None):
        raise ValueError("give either resident (bool [R, N]) or slot_of with layer_of and rows")
    if resident is not None:
        if resident.dim() != 2 or resident.dtype != torch.bool or resident.shape[0] != rows_of \
                or resident.shape[1] < width:
            raise ValueError(f"resident must be bool [R={rows_of}, N>={width}], got {resident.dtype} "
                             f"{tuple(resident.shape)}")
        if resident.device != device:
            raise ValueError(f"resident is on {resident.device}, scores on {device}")
        return resident, resident, resident, (0, resident.stride(0), resident.stride(1)), False, False
    if slot_of.dim() != 3 or slot_of.dtype != torch.int32 or slot_of.shape[2] < width:
        raise ValueError(f"slot_of must be int32 [layers, rows, blocks>={width}], got {slot_of.dtype} "
                         f"{tuple(slot_of.shape)}")
    for name, t in (("layer_of", layer_of), ("rows", rows)):
        if t is None or t.dim() != 1 or t.shape[0] != rows_of or t.is_floating_point():
            raise ValueError(f"{name} must be an integer [R={rows_of}] tensor, got "
                             f"{None if t is None else (t.dtype, tuple(t.shape))}")
    for name, t in (("slot_of", slot_of), ("layer_of", layer_of), ("rows", rows)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, scores on {device}")
    if checks_values(None, device):  # on CPU tensors: a sync per call on CUDA
        check_range("layer_of", layer_of, 0, slot_of.shape[0])
        check_range("rows", rows, 0, slot_of.shape[1])
    return slot_of, layer_of.contiguous(), rows.contiguous(), slot_of.stride(), True, True  # kernels read [i]


def _resident_of(prediction_ids, resident=None, slot_of=None, layer_of=None, rows=None):
    """bool [R, K]: whether each listed block is resident (torch)."""
    if resident is not None:
        return resident.gather(1, prediction_ids)
    return slot_of[layer_of.long(), rows.long()].gather(1, prediction_ids) >= 0


def _check_prediction(scores, prediction, cap):
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores must be a float [R, N] tensor, got {scores.dtype} {tuple(scores.shape)}")
    if prediction.dim() != 2 or prediction.dtype != torch.int32 or prediction.shape[0] != scores.shape[0]:
        raise ValueError(f"prediction must be int32 [R={scores.shape[0]}, K], got {prediction.dtype} "
                         f"{tuple(prediction.shape)}")
    if prediction.device != scores.device:
        raise ValueError(f"prediction is on {prediction.device}, scores on {scores.device}")
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    if prediction.device.type == "cpu" and prediction.numel() and int(prediction.max()) >= scores.shape[1]:
        raise ValueError(f"prediction ids must be < N = {scores.shape[1]}, got {int(prediction.max())}")


# ---------------------------------------------------------------------------------------- selection
def select_blocks_fused(scores: torch.Tensor, num_blocks_per_seq: torch.Tensor, budget_blocks: int,
                        sink_blocks: int, local_blocks: int, *, check_values: bool | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_blocks_padded` (same arguments, same result) in one kernel launch."""
    _check_select_args(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks)
    rows, max_blocks = scores.shape
    k = min(budget_blocks, max_blocks)
    if not _fits(scores.device, max_blocks, k) or rows == 0 or k == 0:
        return select_blocks_padded(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks,
                                    check_values=check_values)
    return _launch_select(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks, check_values)[:2]


def _launch_select(scores, n, budget, sink, local, check_values, cap=0, residency=None, mask_width=0):
    rows, max_blocks = scores.shape
    dev = scores.device
    if check_values if check_values is not None else n.device.type == "cpu":
        _check_select_values(n, max_blocks)
    n = n.to(dev).contiguous()  # read as n[r]
    k = min(budget, max_blocks)
    counts = torch.empty(rows, dtype=torch.int32, device=dev)
    out = torch.empty(rows, k, dtype=torch.int32, device=dev)
    plan = residency is not None
    fetch = torch.empty(rows, cap, dtype=torch.int32, device=dev)
    mask = torch.empty(rows, mask_width, dtype=torch.bool, device=dev)
    table, layer_of, row_ids, strides, indexed, slots = residency if plan else (counts, counts, counts, (0, 0, 0),
                                                                               False, True)
    block_n = triton.next_power_of_2(max_blocks)
    _select_kernel[(rows,)](
        scores, scores.stride(0), scores.stride(1), n, counts, out, out.stride(0),
        max_blocks, k, budget, sink, local,
        table, layer_of, row_ids, *strides,
        fetch, fetch.stride(0), cap, mask, mask.stride(0), mask_width,
        BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k), BLOCK_CAP=triton.next_power_of_2(max(cap, 1)),
        MASK_TILES=triton.cdiv(mask_width, block_n), PLAN=plan, INDEXED=indexed, SLOTS=slots,
        num_warps=_warps(block_n),
    )
    return counts, out, mask, fetch


# ---------------------------------------------------------------------------------------- prefetch plan
def plan_prefetch_reference(scores: torch.Tensor, prediction: torch.Tensor, cap: int, *, resident=None,
                            slot_of=None, layer_of=None, rows=None) -> torch.Tensor:
    """The prefetch list of :func:`predict_prefetch` in torch: per row, the blocks of `prediction` that are
    not resident and whose score is neither NaN nor -inf, the `cap` best, as the kernel ranks them: higher
    score first, the lower block id on a tie; listed in ascending block order as the kernel stores them (the
    order places them in the working set's slots), -1 after. Residency: `resident` bool [R, N], or `slot_of`
    read at [layer_of[r], rows[r]]."""
    _check_prediction(scores, prediction, cap)
    _residency(len(scores), scores.shape[1], scores.device, resident, slot_of, layer_of, rows)
    ids = prediction.clamp(min=0).long()
    score = scores.float().gather(1, ids)
    wanted = (prediction >= 0) & ~_resident_of(ids, resident, slot_of, layer_of, rows) & ~score.isnan()
    key = torch.where(wanted, score, float("-inf"))
    # a stable sort by score over the entries in ascending id order breaks ties towards the lower id
    by_id = torch.where(prediction >= 0, prediction, torch.iinfo(torch.int32).max).argsort(dim=1, stable=True)
    ranked = key.gather(1, by_id).sort(dim=1, descending=True, stable=True)
    width = min(cap, key.shape[1])
    best = by_id.gather(1, ranked.indices[:, :width])
    last = torch.iinfo(torch.int32).max
    listed = torch.where(ranked.values[:, :width] > float("-inf"), prediction.gather(1, best), last).sort(dim=1).values
    return torch.where(listed == last, -1, listed)


# ---------------------------------------------------------------------------------------- both at once
def blocks_mask(blocks: torch.Tensor, width: int) -> torch.Tensor:
    """bool [R, width]: the ids listed in `blocks` (int32 [R, K], -1 = none, ids < width)."""
    mask = torch.zeros(len(blocks), width + 1, dtype=torch.bool, device=blocks.device)
    mask.scatter_(1, torch.where(blocks >= 0, blocks.long(), width), True)
    return mask[:, :width]


def predict_prefetch_reference(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks, cap,
                               mask_width, **residency) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`predict_prefetch`."""
    _, prediction = select_blocks_padded(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks)
    return prediction, blocks_mask(prediction, mask_width), plan_prefetch_reference(scores, prediction, cap,
                                                                                    **residency)


def predict_prefetch(scores: torch.Tensor, num_blocks_per_seq: torch.Tensor, budget_blocks: int,
                     sink_blocks: int, local_blocks: int, cap: int, mask_width: int, *, resident=None,
                     slot_of=None, layer_of=None, rows=None, check_values: bool | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch for oasis's draft: the selection (:func:`select_blocks_fused`), its bool mask
    (bool [R, mask_width], mask_width >= N) and its prefetch list (:func:`plan_prefetch_reference` in torch).
    Returns (prediction int32 [R, K], mask, fetch int32 [R, min(cap, K)])."""
    _check_select_args(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks)
    rows_of, max_blocks = scores.shape
    if mask_width < max_blocks:
        raise ValueError(f"mask_width ({mask_width}) must be >= the number of blocks N ({max_blocks})")
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    residency_args = dict(resident=resident, slot_of=slot_of, layer_of=layer_of, rows=rows)
    residency = _residency(rows_of, max_blocks, scores.device, **residency_args)
    k = min(budget_blocks, max_blocks)
    if not _fits(scores.device, max_blocks, k) or rows_of == 0 or k == 0:
        return predict_prefetch_reference(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks,
                                          cap, mask_width, **residency_args)
    _, prediction, mask, fetch = _launch_select(scores, num_blocks_per_seq, budget_blocks, sink_blocks,
                                                local_blocks, check_values, min(cap, k), residency, mask_width)
    return prediction, mask, fetch
