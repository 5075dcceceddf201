"""The draft token's K/V, in one launch per layer: placed where x_{t+1}'s will go.

For each decode row b (request row r = rows[b]) with its draft at in-block offset offset[b]:
  - opened[b] = -1: the draft sits in x_t's tail block, so its K/V go to tail_slots[b];
  - opened[b] = o >= 0: x_t filled its tail and the draft opens logical block o. Unless o already has a
    slot, it gets one of row r's slots in this layer: the victim is the first of the row's slots by
    (empty first, then least recently used, ties to the lower index), never one that holds a block listed
    in attended[b, :] (x_t attends to those in this step). The victim's old block loses its slot, o
    gets it, and the slot's last_used becomes `step`. The draft's K/V go to that slot.
This is `WorkingSet.place` for one wanted block per row, with the attended blocks as the protected set
(kv/working_set.py, kernels/ws_place.py: the same tables and the same victim order), followed by the
K/V write. Tables (spare column last):
  slot_of   int32 [layers, rows, max_blocks + 1]   global slot of each logical block, -1 if not resident
  block_of  int32 [layers, rows, width + 1]        logical block held by each slot of a row, -1 if empty
  last_used int64 [layers, rows, width + 1]        step at which each slot was last wanted
The Triton kernel runs on CUDA tensors and under TRITON_INTERPRET=1; the torch twin elsewhere."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from oasiskv.kernels.aot import compile_ahead
from oasiskv.kernels.value_checks import check_range, checks_values
from oasiskv.kernels.ws_place import check_tables

__all__ = ["DraftWrite", "check_draft_values", "place_draft_row", "write_draft_kv", "write_draft_kv_reference"]


@triton.jit
def _draft_kv_kernel(slot_of_ptr, rows_ptr, opened_ptr, att_ptr, layer, s_sl, s_sr, s_att, K,
                     kv_ptr, block_of_ptr, used_ptr, tail_ptr, offset_ptr, k_ptr, v_ptr, step_ptr,
                     s_bl, s_br, s_ul, s_ur, s_kv_slot, s_k, W, CHUNK: tl.constexpr,
                     KV_HALF: tl.constexpr, TOKEN: tl.constexpr, TOKEN_PAD: tl.constexpr, BLOCK_W: tl.constexpr,
                     IDX_BITS: tl.constexpr, KEEP_CODE: tl.constexpr):
    b = tl.program_id(0)
    place_draft_row(b, att_ptr + b * s_att, K, slot_of_ptr, rows_ptr, opened_ptr, layer, s_sl, s_sr,
                    kv_ptr, block_of_ptr, used_ptr, tail_ptr, offset_ptr, k_ptr, v_ptr, step_ptr,
                    s_bl, s_br, s_ul, s_ur, s_kv_slot, s_k, W, CHUNK, KV_HALF, TOKEN, TOKEN_PAD, BLOCK_W, IDX_BITS,
                    KEEP_CODE)


@triton.jit
def place_draft_row(b, att_row_ptr, K, slot_of_ptr, rows_ptr, opened_ptr, layer, s_sl, s_sr,
                    kv_ptr, block_of_ptr, used_ptr, tail_ptr, offset_ptr, k_ptr, v_ptr, step_ptr,
                    s_bl, s_br, s_ul, s_ur, s_kv_slot, s_k, W, CHUNK: tl.constexpr,
                    KV_HALF: tl.constexpr, TOKEN: tl.constexpr, TOKEN_PAD: tl.constexpr, BLOCK_W: tl.constexpr,
                    IDX_BITS: tl.constexpr, KEEP_CODE: tl.constexpr):
    """Row b's placement and K/V write (the module docstring). `att_row_ptr`: the row's K protected blocks in
    memory (-1 = none), read CHUNK at a time: the slots are compared with one chunk per pass, so the compare's
    [BLOCK_W, CHUNK] stays small however many slots and blocks there are (a whole [BLOCK_W, K] compare spills
    out of the registers). Called by _draft_kv_kernel and, after the residency check, by kernels/residency.py's
    fused kernel, which must make its own stores of the list visible first (a barrier)."""
    row = tl.load(rows_ptr + b).to(tl.int64)
    opened = tl.load(opened_ptr + b).to(tl.int64)
    slot = tl.load(tail_ptr + b).to(tl.int64)
    if opened >= 0:
        slot_row = slot_of_ptr + layer * s_sl + row * s_sr
        block_row = block_of_ptr + layer * s_bl + row * s_br
        used_row = used_ptr + layer * s_ul + row * s_ur
        current = tl.load(slot_row + opened).to(tl.int64)
        if current >= 0:
            slot = current
        else:
            j = tl.arange(0, BLOCK_W)
            held = tl.load(block_row + j, mask=j < W, other=-1)
            listed = tl.zeros([BLOCK_W], tl.int32)
            for start in range(0, K, CHUNK):
                c = start + tl.arange(0, CHUNK)
                attended = tl.load(att_row_ptr + c, mask=c < K, other=-1)
                listed = tl.maximum(listed, tl.max((held[:, None] == attended[None, :]).to(tl.int32), axis=1))
            keep = (held >= 0) & (listed != 0)
            used = tl.load(used_row + j, mask=j < W, other=0)
            code = tl.where(held < 0, 0, used + 1)  # an empty slot first, then by last use
            code = tl.where(keep | (j >= W), KEEP_CODE, code)
            victim = tl.min((code << IDX_BITS) | j.to(tl.int64), axis=0) & (BLOCK_W - 1)
            old = tl.load(block_row + victim)
            if old >= 0:
                tl.store(slot_row + old, -1)
            tl.store(block_row + victim, opened.to(tl.int32))
            slot = row * W + victim
            tl.store(slot_row + opened, slot.to(tl.int32))
        tl.store(used_row + (slot - row * W), tl.load(step_ptr))
    offset = tl.load(offset_ptr + b).to(tl.int64)
    e = tl.arange(0, TOKEN_PAD)  # one token's [Hkv, D] values, contiguous
    m = e < TOKEN
    base = kv_ptr + slot * s_kv_slot + offset * TOKEN + e
    tl.store(base, tl.load(k_ptr + b * s_k + e, mask=m), mask=m)
    tl.store(base + KV_HALF, tl.load(v_ptr + b * s_k + e, mask=m), mask=m)


class DraftWrite(NamedTuple):
    """write_draft_kv's arguments but those a residency check shares with it (slot_of, layer, rows; its extra
    column is `opened` and its output `attended`): what kernels/residency.py needs to do the write too."""
    kv_layer: torch.Tensor
    block_of: torch.Tensor
    last_used: torch.Tensor
    tail_slots: torch.Tensor
    offset: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    step: torch.Tensor

    def arguments(self, slot_of, layer: int, rows, opened, attended) -> tuple:
        """write_draft_kv's positional arguments."""
        return (self.kv_layer, slot_of, self.block_of, self.last_used, layer, rows, self.tail_slots, opened,
                self.offset, attended, self.k, self.v, self.step)

    def launch_args(self) -> tuple[tuple, dict]:
        """place_draft_row's arguments from kv_ptr on (a launch's runtime values, then its constants)."""
        b, width = len(self.tail_slots), self.block_of.shape[2] - 1
        k, v = self.k.reshape(b, -1).contiguous(), self.v.reshape(b, -1).contiguous()
        values = (self.kv_layer, self.block_of, self.last_used, self.tail_slots.contiguous(), self.offset.contiguous(),
                  k, v, self.step, self.block_of.stride(0), self.block_of.stride(1), self.last_used.stride(0),
                  self.last_used.stride(1), self.kv_layer.stride(0), k.stride(0), width)
        return values, placement_constants(width, k.shape[1], self.kv_layer.stride(1))


def placement_constants(width: int, token: int, kv_half: int) -> dict:
    """place_draft_row's compile-time arguments: `token` values per K (Hkv * D), `kv_half` elements from a
    slot's K to its V."""
    block_w = max(2, triton.next_power_of_2(width))
    idx_bits = block_w.bit_length() - 1
    return dict(CHUNK=max(2, _COMPARE_ELEMENTS // block_w), KV_HALF=kv_half, TOKEN=token,
                TOKEN_PAD=triton.next_power_of_2(token), BLOCK_W=block_w, IDX_BITS=idx_bits,
                KEEP_CODE=(1 << (62 - idx_bits)) - 1)


_COMPARE_ELEMENTS = 8192  # slots x protected blocks compared at once when a draft's block needs a slot


def write_draft_kv(kv_layer, slot_of, block_of, last_used, layer: int, rows, tail_slots, opened, offset, attended,
                   k, v, step, check_values: bool | None = None) -> None:
    """See the module docstring; in place on kv_layer and the three tables. `rows` long [B], `tail_slots`
    int [B], `opened` int32 [B], `offset` int [B], `attended` int32 [B, K] (-1 = none), `k`/`v` [B, Hkv, D],
    `step` a 0-d int64 tensor. The ids are checked where that costs no sync (value_checks.checks_values)."""
    check_draft_kv(kv_layer, slot_of, block_of, last_used, layer, rows, tail_slots, opened, offset, attended, k, v,
                   step)
    if checks_values(check_values, kv_layer.device):
        check_draft_values(kv_layer, slot_of, layer, rows, tail_slots, opened, offset)
    if not (kv_layer.is_cuda or type(_draft_kv_kernel).__name__ == "InterpretedFunction"):
        return write_draft_kv_reference(kv_layer, slot_of, block_of, last_used, layer, rows, tail_slots, opened,
                                        offset, attended, k, v, step)
    if len(rows) == 0:
        return None
    attended, rows, opened = attended.contiguous(), rows.contiguous(), opened.contiguous()  # read as [b]
    values, constants = DraftWrite(kv_layer, block_of, last_used, tail_slots, offset, k, v, step).launch_args()
    _draft_kv_kernel[(len(rows),)](
        slot_of, rows, opened, attended, layer, slot_of.stride(0), slot_of.stride(1), attended.stride(0),
        attended.shape[1], *values, **constants, num_warps=4)
    return None


def write_draft_kv_reference(kv_layer, slot_of, block_of, last_used, layer: int, rows, tail_slots, opened, offset,
                             attended, k, v, step) -> None:
    """Torch twin of write_draft_kv: every row at once, with no host sync."""
    rows = rows.long()
    spare_block, width = slot_of.shape[2] - 1, block_of.shape[2] - 1
    base = rows * width
    opens = opened >= 0
    o = torch.where(opens, opened.long(), spare_block)  # no block opened -> the spare column (holds -1)
    current = slot_of[layer, rows, o].long()
    miss = opens & (current < 0)
    held = block_of[layer, rows, :width].long()  # [B, W]
    keep = (held >= 0) & (held[:, :, None] == attended[:, None, :].long()).any(2)
    code = torch.where(held < 0, 0, last_used[layer, rows, :width] + 1)
    code = code.masked_fill(keep, torch.iinfo(torch.int64).max)
    victim = torch.where(miss, code.argmin(1), width)  # argmin: the first of equal minima, the lower index
    old = block_of[layer, rows, victim].long()
    slot_of[layer, rows, torch.where(miss & (old >= 0), old, spare_block)] = -1
    block_of[layer, rows, victim] = torch.where(miss, o, -1).to(torch.int32)
    slot = torch.where(miss, base + victim, current)
    slot_of[layer, rows, torch.where(miss, o, spare_block)] = torch.where(miss, slot, -1).to(torch.int32)
    touched = torch.where(opens, slot - base, width)  # rows that open nothing rewrite their spare column as is
    last_used[layer, rows, touched] = torch.where(opens, step, last_used[layer, rows, touched])
    dst = torch.where(opens, slot, tail_slots.long())
    kv_layer[dst, 0, offset.long()] = k
    kv_layer[dst, 1, offset.long()] = v
    return None


def check_draft_kv(kv_layer, slot_of, block_of, last_used, layer, rows, tail_slots, opened, offset, attended, k, v,
                   step) -> None:
    """write_draft_kv's input checks (kernels/residency.py uses them too)."""
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2 or not kv_layer[0].is_contiguous():
        raise ValueError(f"kv_layer must be [slots, 2, block_size, Hkv, D], contiguous within a slot, "
                         f"got {tuple(kv_layer.shape)}")
    check_tables(slot_of, block_of, last_used)
    if not 0 <= layer < slot_of.shape[0]:
        raise ValueError(f"layer {layer} out of range [0, {slot_of.shape[0]})")
    b = len(rows)
    if rows.shape != (b,) or rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64 [B], got {rows.dtype} {tuple(rows.shape)}")
    for name, t in (("tail_slots", tail_slots), ("opened", opened), ("offset", offset)):
        if t.shape != (b,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int [{b}], got {t.dtype} {tuple(t.shape)}")
    if attended.dim() != 2 or attended.shape[0] != b or attended.dtype != torch.int32:
        raise ValueError(f"attended must be int32 [{b}, K], got {attended.dtype} {tuple(attended.shape)}")
    token = tuple(kv_layer.shape[3:])
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (b, *token) or t.dtype != kv_layer.dtype:
            raise ValueError(f"{name} must be {kv_layer.dtype} {(b, *token)}, got {t.dtype} {tuple(t.shape)}")
    if not isinstance(step, torch.Tensor) or step.dim() != 0 or step.dtype != torch.int64:
        raise ValueError("step must be a 0-d int64 tensor")
    for name, t in (("slot_of", slot_of), ("block_of", block_of), ("last_used", last_used), ("rows", rows),
                    ("tail_slots", tail_slots), ("opened", opened), ("offset", offset), ("attended", attended),
                    ("k", k), ("v", v), ("step", step)):
        if t.device != kv_layer.device:
            raise ValueError(f"{name} is on {t.device}, kv_layer on {kv_layer.device}")


def check_draft_values(kv_layer, slot_of, layer: int, rows, tail_slots, opened, offset) -> None:
    """The kernel writes where these point: each row within slot_of, each tail slot and each opened block's slot
    within kv_layer, each offset within a block, each opened block -1 or a column of slot_of but the spare
    (kernels/residency.py uses this too)."""
    check_range("rows", rows, 0, slot_of.shape[1])
    check_range("tail_slots", tail_slots, 0, kv_layer.shape[0])
    check_range("offset", offset, 0, kv_layer.shape[2])
    check_range("opened", opened, -1, slot_of.shape[2] - 1)
    opens = opened >= 0
    check_range("the opened blocks' slots (slot_of)", slot_of[layer, rows[opens], opened[opens].long()], -1,
                kv_layer.shape[0])


POINTERS = {"kv_ptr": "*fp16", "slot_of_ptr": "*i32", "block_of_ptr": "*i32", "used_ptr": "*i64", "rows_ptr": "*i64",
            "tail_ptr": "*i32", "opened_ptr": "*i32", "offset_ptr": "*i64", "att_ptr": "*i32", "k_ptr": "*fp16",
            "v_ptr": "*fp16", "step_ptr": "*i64"}  # as the engine passes them, for compile_for


def compile_for(arch: int, width: int, token: int = 1024, block_size: int = 16):
    """_draft_kv_kernel compiled ahead of time (kernels/aot.py) for `width` slots per row, `token` values per K
    (Hkv * D) and `block_size` tokens per block (the attended list is read from memory, any length)."""
    meta = placement_constants(width, token, block_size * token)
    return compile_ahead(_draft_kv_kernel, POINTERS, meta, arch)
