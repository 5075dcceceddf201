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
its draft opens there, so attention reads one list with no concatenation. With `draft` too, the same launch
places each row's draft token as kernels/draft_kv.py's write_draft_kv does with this output as `attended`
(x_t's attended blocks are protected; the opened block in the last column has no slot when it is placed, so
protecting it too would change nothing): one launch per layer in place of two.
The torch twin is the chain of ~20 small ops this replaces; both run on any device (the Triton kernel on
CUDA tensors and under TRITON_INTERPRET=1)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.aot import compile_ahead
from oasiskv.kernels.draft_kv import (POINTERS as DRAFT_POINTERS, DraftWrite, check_draft_kv, check_draft_values,
                                      place_draft_row, placement_constants, write_draft_kv, write_draft_kv_reference)
from oasiskv.kernels.value_checks import check_range, checks_values

__all__ = ["COUNTERS", "DraftWrite", "resident_selection", "resident_selection_reference"]

COUNTERS = ("selected", "hits", "misses", "agree_hits", "agree_total")  # order of `counter_ids`


@triton.jit
def _resident_kernel(sel_ptr, slot_ptr, pred_ptr, rows_ptr, fresh_ptr, out_ptr, row_counts_ptr, layer_counts_ptr,
                     ids_ptr, extra_ptr, layer, K, s_out, s_slot_l, s_slot_r, s_pred_l, s_pred_r, s_rc, s_lc,
                     K_PAD: tl.constexpr, EXTRA: tl.constexpr):
    _resident_row(tl.program_id(0), sel_ptr, slot_ptr, pred_ptr, rows_ptr, fresh_ptr, out_ptr, row_counts_ptr,
                  layer_counts_ptr, ids_ptr, extra_ptr, layer, K, s_out, s_slot_l, s_slot_r, s_pred_l, s_pred_r, s_rc,
                  s_lc, K_PAD, EXTRA)


@triton.jit
def _resident_draft_kernel(sel_ptr, slot_ptr, pred_ptr, rows_ptr, fresh_ptr, out_ptr, row_counts_ptr,
                           layer_counts_ptr, ids_ptr, extra_ptr, layer, K, s_out, s_slot_l, s_slot_r, s_pred_l,
                           s_pred_r, s_rc, s_lc,
                           kv_ptr, block_of_ptr, used_ptr, tail_ptr, offset_ptr, k_ptr, v_ptr, step_ptr,
                           s_bl, s_br, s_ul, s_ur, s_kv_slot, s_k, W, K_PAD: tl.constexpr, CHUNK: tl.constexpr,
                           KV_HALF: tl.constexpr, TOKEN: tl.constexpr, TOKEN_PAD: tl.constexpr,
                           BLOCK_W: tl.constexpr, IDX_BITS: tl.constexpr, KEEP_CODE: tl.constexpr):
    """_resident_kernel with `extra` (the opened blocks), then kernels/draft_kv.py's placement of row b's draft
    with x_t's attended blocks (the output row just written) as protected. Row b's placement writes only its own
    request row of the tables (rows are distinct); the barrier puts its loads and stores after this row's slot_of
    loads and output stores."""
    b = tl.program_id(0)
    _resident_row(b, sel_ptr, slot_ptr, pred_ptr, rows_ptr, fresh_ptr, out_ptr, row_counts_ptr, layer_counts_ptr,
                  ids_ptr, extra_ptr, layer, K, s_out, s_slot_l, s_slot_r, s_pred_l, s_pred_r, s_rc, s_lc, K_PAD, True)
    tl.debug_barrier()
    place_draft_row(b, out_ptr + b * s_out, K, slot_ptr, rows_ptr, extra_ptr, layer, s_slot_l, s_slot_r,
                    kv_ptr, block_of_ptr, used_ptr, tail_ptr, offset_ptr, k_ptr, v_ptr, step_ptr,
                    s_bl, s_br, s_ul, s_ur, s_kv_slot, s_k, W, CHUNK, KV_HALF, TOKEN, TOKEN_PAD, BLOCK_W, IDX_BITS,
                    KEEP_CODE)


@triton.jit
def _resident_row(b, sel_ptr, slot_ptr, pred_ptr, rows_ptr, fresh_ptr, out_ptr, row_counts_ptr, layer_counts_ptr,
                  ids_ptr, extra_ptr, layer, K, s_out, s_slot_l, s_slot_r, s_pred_l, s_pred_r, s_rc, s_lc,
                  K_PAD: tl.constexpr, EXTRA: tl.constexpr):
    """Row b's output and counters."""
    j = tl.arange(0, K_PAD)
    in_row = j < K
    sel = tl.load(sel_ptr + b * K + j, mask=in_row, other=-1)
    valid = sel >= 0
    r = tl.load(rows_ptr + b)
    slot = tl.load(slot_ptr + layer * s_slot_l + r * s_slot_r + sel, mask=valid, other=-1)
    resident = valid & (slot >= 0)
    predicted = tl.load(pred_ptr + layer * s_pred_l + r * s_pred_r + sel, mask=valid, other=0) != 0
    fresh = tl.load(fresh_ptr + b) != 0
    attended = tl.where(resident, sel, -1)
    tl.store(out_ptr + b * s_out + j, attended, mask=in_row)
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


def _check(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts, counter_ids, layer, extra, draft):
    if selection.dim() != 2 or selection.dtype != torch.int32:
        raise ValueError(f"selection must be int32 [B, K], got {selection.dtype} {tuple(selection.shape)}")
    b = len(selection)
    if slot_of.dim() != 3 or slot_of.dtype != torch.int32:
        raise ValueError(f"slot_of must be int32 [layers, rows, blocks], got {slot_of.dtype} {tuple(slot_of.shape)}")
    if predicted.shape != slot_of.shape or predicted.dtype != torch.bool:
        raise ValueError(f"predicted must be bool {tuple(slot_of.shape)}, "
                         f"got {predicted.dtype} {tuple(predicted.shape)}")
    if rows.shape != (b,) or fresh.shape != (b,) or fresh.dtype != torch.bool:
        raise ValueError(f"rows and fresh (bool) must be [{b}], got {tuple(rows.shape)} and {tuple(fresh.shape)}")
    if row_counts.dim() != 2 or layer_counts.dim() != 2 or row_counts.dtype != torch.int64 \
            or layer_counts.dtype != torch.int64:
        raise ValueError("row_counts and layer_counts must be int64 [rows, counters] and [layers, counters]")
    if counter_ids.shape != (len(COUNTERS),):
        raise ValueError(f"counter_ids must hold {len(COUNTERS)} counter columns ({', '.join(COUNTERS)})")
    for name, t in (("rows", rows), ("counter_ids", counter_ids)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if not 0 <= layer < slot_of.shape[0]:
        raise ValueError(f"layer {layer} out of range [0, {slot_of.shape[0]})")
    if layer >= layer_counts.shape[0]:
        raise ValueError(f"layer {layer} out of layer_counts' rows [0, {layer_counts.shape[0]})")
    if extra is not None and (extra.shape != (b,) or extra.dtype != torch.int32):
        raise ValueError(f"extra must be int32 [{b}], got {extra.dtype} {tuple(extra.shape)}")
    for name, t in (("slot_of", slot_of), ("predicted", predicted), ("rows", rows), ("fresh", fresh),
                    ("row_counts", row_counts), ("layer_counts", layer_counts), ("counter_ids", counter_ids),
                    ("extra", selection if extra is None else extra)):
        if t.device != selection.device:
            raise ValueError(f"{name} is on {t.device}, selection on {selection.device}")
    if draft is not None:
        if extra is None:
            raise ValueError("draft needs extra: the block each draft opens, or -1")
        check_draft_kv(*draft.arguments(slot_of, layer, rows, extra, selection))  # selection: the output's rows, dtype


def resident_selection(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts, counter_ids,
                       layer: int, extra: torch.Tensor | None = None, draft: DraftWrite | None = None,
                       check_values: bool | None = None) -> torch.Tensor:
    """The module docstring's `attended` (int32 [B, K], or [B, K + 1] with `extra`); adds the counters in place.
    `counter_ids` (long [5], on the device) gives the column of each of COUNTERS in row_counts / layer_counts.
    Blocks in `selection` must be < slot_of.shape[2]. With `draft` (needs `extra`, the opened blocks, and
    int64 `rows`, distinct) also writes the drafts' K/V, in place on its tables and `slot_of`. The ids are checked
    where that costs no sync (value_checks.checks_values)."""
    _check(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts, counter_ids, layer, extra, draft)
    if checks_values(check_values, selection.device):
        check_values_of(selection, slot_of, rows, row_counts, layer_counts, counter_ids)
        if draft is not None:
            check_draft_values(draft.kv_layer, slot_of, layer, rows, draft.tail_slots, extra, draft.offset)
    if not (selection.is_cuda or type(_resident_kernel).__name__ == "InterpretedFunction"):
        return resident_selection_reference(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts,
                                            counter_ids, layer, extra, draft)
    b, k = selection.shape
    with_extra = extra is not None
    out = torch.empty(b, k + with_extra, dtype=selection.dtype, device=selection.device)
    if b == 0 or k == 0:
        if with_extra:
            out[:, k] = extra
        if draft is not None:
            write_draft_kv(*draft.arguments(slot_of, layer, rows, extra, out))
        return out
    selection, rows, fresh = selection.contiguous(), rows.contiguous(), fresh.contiguous()  # read as [b]
    args = (selection, slot_of, predicted.view(torch.uint8), rows, fresh.view(torch.uint8), out, row_counts,
            layer_counts, counter_ids, extra.contiguous() if with_extra else rows, layer, k, out.stride(0),
            slot_of.stride(0), slot_of.stride(1), predicted.stride(0), predicted.stride(1), row_counts.stride(0),
            layer_counts.stride(0))
    k_pad = max(2, triton.next_power_of_2(k))
    if draft is None:
        _resident_kernel[(b,)](*args, K_PAD=k_pad, EXTRA=with_extra)
    else:
        values, constants = draft.launch_args()
        _resident_draft_kernel[(b,)](*args, *values, K_PAD=k_pad, **constants, num_warps=4)
    return out


def check_values_of(selection, slot_of, rows, row_counts, layer_counts, counter_ids) -> None:
    """The kernel reads slot_of and predicted at each selected block of each row, and adds to row_counts' row of
    each row at each counter column (and to layer_counts at those columns)."""
    check_range("selection", selection, -1, slot_of.shape[2])
    check_range("rows (of slot_of and row_counts)", rows, 0, min(slot_of.shape[1], row_counts.shape[0]))
    check_range("counter_ids (columns of row_counts and layer_counts)", counter_ids, 0,
                min(row_counts.shape[1], layer_counts.shape[1]))


def resident_selection_reference(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts, counter_ids,
                                 layer: int, extra: torch.Tensor | None = None,
                                 draft: DraftWrite | None = None) -> torch.Tensor:
    """Torch twin of resident_selection: with `draft`, the residency check, then write_draft_kv_reference."""
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
    attended = attended if extra is None else torch.cat([attended, extra[:, None]], 1)
    if draft is not None:
        write_draft_kv_reference(*draft.arguments(slot_of, layer, rows, extra, attended))
    return attended


_POINTERS = {"sel_ptr": "*i32", "slot_ptr": "*i32", "pred_ptr": "*u8", "rows_ptr": "*i64", "fresh_ptr": "*u8",
             "out_ptr": "*i32", "row_counts_ptr": "*i64", "layer_counts_ptr": "*i64", "ids_ptr": "*i64",
             "extra_ptr": "*i32", **DRAFT_POINTERS}


def compile_for(arch: int, width: int, k: int, token: int = 1024, block_size: int = 16):
    """_resident_draft_kernel compiled ahead of time (kernels/aot.py), for a selection of `k` blocks,
    `width` slots per row, `token` values per K (Hkv * D) and `block_size` tokens per block."""
    meta = dict(K_PAD=max(2, triton.next_power_of_2(k)), **placement_constants(width, token, block_size * token))
    return compile_ahead(_resident_draft_kernel, _POINTERS, meta, arch)
