"""Residency check of oasis's current selection, with its counters, in one launch per layer.

For each decode row b (request row r = rows[b]) and its selection sel[b, :] (logical block ids, -1 = none):
  resident[b, j] = slot_of[layer, r, sel[b, j]] >= 0
  attended[b, j] = sel[b, j] if resident else -1       (misses are left out: the "skip" policy)
and five counters are added, per row into row_counts[r, :] and per layer into layer_counts[layer, :]:
  selected     valid entries
  hits         valid and resident
  misses       valid and not resident
  agree_total  valid, on rows whose prediction was made last step (fresh[b])
  agree_hits   the same, and predicted[layer, r, sel[b, j]]
With `extra` (int32 [B]) the output has one more column, attended[b, K] = extra[b]: oasis appends the block
its draft opens there, so attention reads one list with no concatenation.
The torch twin is the chain of ~20 small ops this replaces; both run on any device (the Triton kernel on
CUDA tensors and under TRITON_INTERPRET=1)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["COUNTERS", "resident_selection", "resident_selection_reference"]

COUNTERS = ("selected", "hits", "misses", "agree_hits", "agree_total")  # order of `counter_ids`


@triton.jit
def _resident_kernel(sel_ptr, slot_ptr, pred_ptr, rows_ptr, fresh_ptr, out_ptr, row_counts_ptr, layer_counts_ptr,
                     ids_ptr, extra_ptr, layer, K, s_out, s_slot_l, s_slot_r, s_pred_l, s_pred_r, s_rc, s_lc,
                     K_PAD: tl.constexpr, EXTRA: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, K_PAD)
    in_row = j < K
    sel = tl.load(sel_ptr + b * K + j, mask=in_row, other=-1)
    valid = sel >= 0
    r = tl.load(rows_ptr + b)
    slot = tl.load(slot_ptr + layer * s_slot_l + r * s_slot_r + sel, mask=valid, other=-1)
    resident = valid & (slot >= 0)
    predicted = tl.load(pred_ptr + layer * s_pred_l + r * s_pred_r + sel, mask=valid, other=0) != 0
    fresh = tl.load(fresh_ptr + b) != 0
    tl.store(out_ptr + b * s_out + j, tl.where(resident, sel, -1), mask=in_row)
    if EXTRA:
        tl.store(out_ptr + b * s_out + K, tl.load(extra_ptr + b))

    selected = tl.sum(valid.to(tl.int64), axis=0)
    hits = tl.sum(resident.to(tl.int64), axis=0)
    agree_hits = tl.where(fresh, tl.sum((valid & predicted).to(tl.int64), axis=0), 0)
    agree_total = tl.where(fresh, selected, 0)
    _add(row_counts_ptr + r * s_rc, layer_counts_ptr + layer * s_lc, ids_ptr, 0, selected)
    _add(row_counts_ptr + r * s_rc, layer_counts_ptr + layer * s_lc, ids_ptr, 1, hits)
    _add(row_counts_ptr + r * s_rc, layer_counts_ptr + layer * s_lc, ids_ptr, 2, selected - hits)
    _add(row_counts_ptr + r * s_rc, layer_counts_ptr + layer * s_lc, ids_ptr, 3, agree_hits)
    _add(row_counts_ptr + r * s_rc, layer_counts_ptr + layer * s_lc, ids_ptr, 4, agree_total)


@triton.jit
def _add(row_ptr, layer_ptr, ids_ptr, i, value):
    column = tl.load(ids_ptr + i)
    # relaxed: the counters are read only after the kernel ends, so no ordering (and no fence) is needed
    tl.atomic_add(row_ptr + column, value, sem="relaxed")
    tl.atomic_add(layer_ptr + column, value, sem="relaxed")


def _check(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts, counter_ids, layer, extra):
    if selection.dim() != 2 or selection.dtype != torch.int32:
        raise ValueError(f"selection must be int32 [B, K], got {selection.dtype} {tuple(selection.shape)}")
    b = len(selection)
    if slot_of.dim() != 3 or slot_of.dtype != torch.int32:
        raise ValueError(f"slot_of must be int32 [layers, rows, blocks], got {slot_of.dtype} {tuple(slot_of.shape)}")
    if predicted.shape != slot_of.shape or predicted.dtype != torch.bool:
        raise ValueError(f"predicted must be bool {tuple(slot_of.shape)}, got {predicted.dtype} {tuple(predicted.shape)}")
    if rows.shape != (b,) or fresh.shape != (b,) or fresh.dtype != torch.bool:
        raise ValueError(f"rows and fresh (bool) must be [{b}], got {tuple(rows.shape)} and {tuple(fresh.shape)}")
    if row_counts.dim() != 2 or layer_counts.dim() != 2 or row_counts.dtype != torch.int64 \
            or layer_counts.dtype != torch.int64:
        raise ValueError("row_counts and layer_counts must be int64 [rows, counters] and [layers, counters]")
    if counter_ids.shape != (len(COUNTERS),):
        raise ValueError(f"counter_ids must hold {len(COUNTERS)} counter columns ({', '.join(COUNTERS)})")
    if not 0 <= layer < slot_of.shape[0]:
        raise ValueError(f"layer {layer} out of range [0, {slot_of.shape[0]})")
    if extra is not None and (extra.shape != (b,) or extra.dtype != torch.int32):
        raise ValueError(f"extra must be int32 [{b}], got {extra.dtype} {tuple(extra.shape)}")
    for name, t in (("slot_of", slot_of), ("predicted", predicted), ("rows", rows), ("fresh", fresh),
                    ("row_counts", row_counts), ("layer_counts", layer_counts), ("counter_ids", counter_ids),
                    ("extra", selection if extra is None else extra)):
        if t.device != selection.device:
            raise ValueError(f"{name} is on {t.device}, selection on {selection.device}")


def resident_selection(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts, counter_ids,
                       layer: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The module docstring's `attended` (int32 [B, K], or [B, K + 1] with `extra`); adds the counters in place.
    `counter_ids` (long [5], on the device) gives the column of each of COUNTERS in row_counts / layer_counts.
    Blocks in `selection` must be < slot_of.shape[2]."""
    _check(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts, counter_ids, layer, extra)
    if not (selection.is_cuda or type(_resident_kernel).__name__ == "InterpretedFunction"):
        return resident_selection_reference(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts,
                                            counter_ids, layer, extra)
    b, k = selection.shape
    with_extra = extra is not None
    out = torch.empty(b, k + with_extra, dtype=selection.dtype, device=selection.device)
    if b == 0 or k == 0:
        if with_extra:
            out[:, k] = extra
        return out
    selection, rows, fresh = selection.contiguous(), rows.contiguous(), fresh.contiguous()  # read as [b]
    _resident_kernel[(b,)](
        selection, slot_of, predicted.view(torch.uint8), rows, fresh.view(torch.uint8), out, row_counts, layer_counts,
        counter_ids, extra.contiguous() if with_extra else rows, layer, k, out.stride(0), slot_of.stride(0),
        slot_of.stride(1), predicted.stride(0), predicted.stride(1), row_counts.stride(0), layer_counts.stride(0),
        K_PAD=triton.next_power_of_2(k), EXTRA=with_extra)
    return out


def resident_selection_reference(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts, counter_ids,
                                 layer: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of resident_selection."""
    rows = rows.long()
    valid = selection >= 0
    ids = selection.clamp(min=0).long()
    resident = valid & (slot_of[layer, rows].gather(1, ids) >= 0)
    judged = valid & fresh[:, None]
    agree = judged & predicted[layer, rows].gather(1, ids)
    values = torch.stack([valid.sum(1), resident.sum(1), (valid & ~resident).sum(1), agree.sum(1),
                          judged.sum(1)])  # [5, B]
    row_counts.index_put_((rows[None, :], counter_ids[:, None]), values, accumulate=True)
    layer_counts[layer].index_add_(0, counter_ids, values.sum(1))
    attended = torch.where(resident, selection, -1)
    return attended if extra is None else torch.cat([attended, extra[:, None]], 1)
