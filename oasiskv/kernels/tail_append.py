"""Appending decode tokens' K/V to their resident tail blocks, in one launch per layer.

For each decode row b (request row r = rows[b]) whose tail block is resident:
  slot[b] = slot_of[layer, r, tail[b]]
  kv_layer[slot[b], 0/1, fill[b] - 1] = k[b] / v[b]            (x_t, the token just computed)
and, with draft K/V given (each draft sits one position after x_t, in the same block: the caller
guarantees fill[b] < block_size for every row),
  kv_layer[slot[b], 0/1, fill[b]] = draft_k[b] / draft_v[b]
Returns slot as int32 [B]. Replaces the index chain of the torch twin (lookup, casts, four scatters)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.value_checks import check_range, checks_values

__all__ = ["append_to_tails", "append_to_tails_reference"]


@triton.jit
def _append_kernel(kv_ptr, slot_of_ptr, rows_ptr, tail_ptr, fill_ptr, k_ptr, v_ptr, dk_ptr, dv_ptr, slots_out_ptr,
                   layer, s_slot_l, s_slot_r, s_kv_slot, s_k, s_dk,
                   KV_HALF: tl.constexpr, TOKEN: tl.constexpr, TOKEN_PAD: tl.constexpr, DRAFT: tl.constexpr):
    b = tl.program_id(0)
    r = tl.load(rows_ptr + b).to(tl.int64)
    tail = tl.load(tail_ptr + b).to(tl.int64)
    fill = tl.load(fill_ptr + b).to(tl.int64)
    slot = tl.load(slot_of_ptr + layer * s_slot_l + r * s_slot_r + tail)
    tl.store(slots_out_ptr + b, slot)
    e = tl.arange(0, TOKEN_PAD)  # one token's [Hkv, D] values, contiguous
    m = e < TOKEN
    base = kv_ptr + slot.to(tl.int64) * s_kv_slot + e
    tl.store(base + (fill - 1) * TOKEN, tl.load(k_ptr + b * s_k + e, mask=m), mask=m)
    tl.store(base + KV_HALF + (fill - 1) * TOKEN, tl.load(v_ptr + b * s_k + e, mask=m), mask=m)
    if DRAFT:
        tl.store(base + fill * TOKEN, tl.load(dk_ptr + b * s_dk + e, mask=m), mask=m)
        tl.store(base + KV_HALF + fill * TOKEN, tl.load(dv_ptr + b * s_dk + e, mask=m), mask=m)


def _check(kv_layer, slot_of, rows, tail, fill, k, v, draft_k, draft_v):
    if (draft_k is None) != (draft_v is None):
        raise ValueError("give both draft_k and draft_v, or neither")
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(f"kv_layer must be [slots, 2, block_size, Hkv, D], got {tuple(kv_layer.shape)}")
    if not kv_layer[0].is_contiguous():
        raise ValueError("kv_layer must be contiguous within a slot")
    if slot_of.dim() != 3 or slot_of.dtype != torch.int32:
        raise ValueError(f"slot_of must be int32 [layers, rows, blocks], got {slot_of.dtype} {tuple(slot_of.shape)}")
    b = len(rows)
    token = tuple(kv_layer.shape[3:])
    for name, t in (("k", k), ("v", v)) + ((("draft_k", draft_k), ("draft_v", draft_v)) if draft_k is not None else ()):
        if tuple(t.shape) != (b, *token) or t.dtype != kv_layer.dtype:
            raise ValueError(f"{name} must be {kv_layer.dtype} {(b, *token)}, got {t.dtype} {tuple(t.shape)}")
    if tail.shape != (b,) or fill.shape != (b,) or rows.dim() != 1:
        raise ValueError(f"rows, tail and fill must be [{b}], got {tuple(rows.shape)}, {tuple(tail.shape)} and "
                         f"{tuple(fill.shape)}")
    for name, t in (("rows", rows), ("tail", tail), ("fill", fill)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (("slot_of", slot_of), ("rows", rows), ("tail", tail), ("fill", fill), ("k", k), ("v", v)):
        if t.device != kv_layer.device:
            raise ValueError(f"{name} is on {t.device}, kv_layer on {kv_layer.device}")


def check_values_of(kv_layer, slot_of, layer: int, rows, tail, fill, draft: bool) -> None:
    """The kernel writes where these values point: each row and tail within slot_of, each slot looked up resident
    (not -1) and within kv_layer, each fill a place in the block with room for the draft after x_t."""
    check_range("layer", torch.tensor([layer]), 0, slot_of.shape[0])
    check_range("rows", rows, 0, slot_of.shape[1])
    check_range("tail", tail, 0, slot_of.shape[2])
    check_range("fill", fill, 1, kv_layer.shape[2] + (0 if draft else 1))
    if len(rows):
        check_range("the tails' slots (slot_of)", slot_of[layer, rows.long(), tail.long()], 0, kv_layer.shape[0])


def append_to_tails(kv_layer, slot_of, layer: int, rows, tail, fill, k, v, draft_k=None, draft_v=None,
                    check_values: bool | None = None) -> torch.Tensor:
    """See the module docstring. Triton on CUDA tensors and under TRITON_INTERPRET=1, else the torch twin. The
    values are checked where that costs no sync (value_checks.checks_values)."""
    _check(kv_layer, slot_of, rows, tail, fill, k, v, draft_k, draft_v)
    if checks_values(check_values, kv_layer.device):
        check_values_of(kv_layer, slot_of, layer, rows, tail, fill, draft_k is not None)
    if not (kv_layer.is_cuda or type(_append_kernel).__name__ == "InterpretedFunction"):
        return append_to_tails_reference(kv_layer, slot_of, layer, rows, tail, fill, k, v, draft_k, draft_v)
    b = len(rows)
    slots = torch.empty(b, dtype=torch.int32, device=kv_layer.device)
    if b == 0:
        return slots
    k, v = k.reshape(b, -1).contiguous(), v.reshape(b, -1).contiguous()
    draft = draft_k is not None
    dk, dv = (draft_k.reshape(b, -1).contiguous(), draft_v.reshape(b, -1).contiguous()) if draft else (k, v)
    token = k.shape[1]
    rows, tail, fill = rows.contiguous(), tail.contiguous(), fill.contiguous()  # read as [b]
    _append_kernel[(b,)](kv_layer, slot_of, rows, tail, fill, k, v, dk, dv, slots, layer, slot_of.stride(0),
                         slot_of.stride(1), kv_layer.stride(0), k.stride(0), dk.stride(0),
                         KV_HALF=kv_layer.stride(1), TOKEN=token, TOKEN_PAD=triton.next_power_of_2(token), DRAFT=draft)
    return slots


def append_to_tails_reference(kv_layer, slot_of, layer: int, rows, tail, fill, k, v, draft_k=None,
                              draft_v=None) -> torch.Tensor:
    """Torch twin of append_to_tails."""
    slots = slot_of[layer, rows.long(), tail.long()].long()
    offset = fill.long() - 1
    kv_layer[slots, 0, offset] = k
    kv_layer[slots, 1, offset] = v
    if draft_k is not None:
        kv_layer[slots, 0, offset + 1] = draft_k
        kv_layer[slots, 1, offset + 1] = draft_v
    return slots.to(torch.int32)
