"""Working-set placement in one launch: the fused twin of `WorkingSet.place_reference` (kv/working_set.py).

Tables (one working set, spare column last, see kv/working_set.py):
  slot_of   int32 [layers, rows, max_blocks + 1]   global slot of each logical block, -1 if not resident
  block_of  int32 [layers, rows, width + 1]        logical block held by each slot of a row, -1 if empty
  last_used int64 [layers, rows, width + 1]        step at which each slot was last wanted
A placement of R table rows (`rows` long [R], `layer` an int or a long [R] of each row's layer) with
`wanted` int32 [R, K] (-1 = none, distinct within a row) and `protect` bool [R, P]:
  - a wanted block is a miss when it has no slot;
  - victims of a row: its slots ordered by (empty first, then last_used, protected last; ties by slot
    index), the k-th miss of the row in column order takes the k-th victim;
  - the victim's old block loses its slot, the missed block gets it (slot id = row * width + index);
  - every wanted slot's last_used becomes `step` (an int, or a 0-d long tensor read on the device).
Returns (miss bool [R, K], slots int32 [R, K], -1 where nothing is wanted), and with `host_tables`
(int32 [R, T]: each row's host block of each logical block) also the copy lists that fill the misses
(allowed by `only`, bool [R, K] or [R, 1]): src = host_tables[row, wanted], dst = slot, -1 for no copy.

One program per row does it all: loads the row's wanted slots and its slot table, orders the slots
with one `tl.sort` over keys (age code << index bits | slot index) so that ties fall to the lower
index (as a stable argsort does), hands victims out by a cumulative count of the misses, then writes
the evictions, assignments and the touch. No host sync, fixed shapes: capturable in a CUDA graph.
The key packing holds exactly when last_used and step lie in [-1, 2**(62 - log2(width)) - 2)
(about 2**51 steps at width 1024): they are decode-step counters.
Runs compiled on CUDA tensors and interpreted on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.aot import compile_ahead
from oasiskv.kernels.value_checks import check_range, checks_values

__all__ = ["place_fused", "fused_place_runs"]


@triton.jit(do_not_specialize=["layer_val", "step_val"])
def _ws_place_kernel(
    slot_of_ptr, block_of_ptr, last_used_ptr, rows_ptr, layer_ptr, layer_val,
    wanted_ptr, protect_ptr, step_ptr, step_val, miss_ptr, slots_ptr,
    host_ptr, only_ptr, src_ptr, dst_ptr,
    s_sl, s_sr, s_bl, s_br, s_ul, s_ur, s_want, s_prot, s_host, s_or, s_ok,
    K, W, M, P,
    LAYER_PER_ROW: tl.constexpr, STEP_IN_PTR: tl.constexpr, COPIES: tl.constexpr, ONLY: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, IDX_BITS: tl.constexpr, KEEP_CODE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    if LAYER_PER_ROW:
        layer = tl.load(layer_ptr + i).to(tl.int64)
    else:
        layer = layer_val.to(tl.int64)
    if STEP_IN_PTR:
        step = tl.load(step_ptr)
    else:
        step = step_val.to(tl.int64)
    slot_row = slot_of_ptr + layer * s_sl + row * s_sr
    block_row = block_of_ptr + layer * s_bl + row * s_br
    used_row = last_used_ptr + layer * s_ul + row * s_ur

    # the wanted blocks and their current slots
    k = tl.arange(0, BLOCK_K)
    wanted = tl.load(wanted_ptr + i * s_want + k, mask=k < K, other=-1)
    valid = wanted >= 0
    w = tl.where(valid, wanted, M).to(tl.int64)
    slots = tl.load(slot_row + w, mask=valid, other=-1)
    miss = valid & (slots < 0)

    # the row's slots, best victim first
    j = tl.arange(0, BLOCK_W)
    in_w = j < W
    held = tl.load(block_row + j, mask=in_w, other=-1)
    used = tl.load(used_row + j, mask=in_w, other=0)
    known = (held >= 0) & (held < P)
    keep = known & (tl.load(protect_ptr + i * s_prot + held, mask=known, other=0) != 0)
    code = tl.where(held < 0, 0, used + 1)  # age -1 for an empty slot, else last_used; +1
    code = tl.where(keep | (j >= W), KEEP_CODE, code)
    order = tl.sort((code << IDX_BITS) | j.to(tl.int64)) & (BLOCK_W - 1)
    rank = tl.minimum(tl.maximum(tl.cumsum(miss.to(tl.int32), 0) - 1, 0), BLOCK_W - 1)
    victim = tl.gather(order, rank, 0)

    # evict the victims' blocks, give their slots to the misses, touch every wanted slot
    old = tl.load(block_row + victim, mask=miss, other=-1)
    tl.store(slot_row + old, tl.full([BLOCK_K], -1, tl.int32), mask=miss & (old >= 0))
    tl.debug_barrier()
    tl.store(block_row + victim, wanted, mask=miss)
    new = row * W + victim
    tl.store(slot_row + w, new.to(tl.int32), mask=miss)
    slots = tl.where(miss, new.to(tl.int32), slots)
    touched = tl.where(valid, slots.to(tl.int64) - row * W, W)  # none -> the spare column, as the reference
    tl.store(used_row + touched, tl.zeros([BLOCK_K], tl.int64) + step, mask=k < K)
    tl.store(miss_ptr + i * K + k, miss.to(tl.int8), mask=k < K)
    tl.store(slots_ptr + i * K + k, slots, mask=k < K)

    if COPIES:
        copy = miss
        if ONLY:
            copy = copy & (tl.load(only_ptr + i * s_or + k * s_ok, mask=k < K, other=0) != 0)
        src = tl.load(host_ptr + i * s_host + w, mask=copy, other=-1)
        tl.store(src_ptr + i * K + k, tl.where(copy, src, -1), mask=k < K)
        tl.store(dst_ptr + i * K + k, tl.where(copy, slots, -1), mask=k < K)


def fused_place_runs(device: torch.device) -> bool:
    """Whether `place_fused` can run on `device`: compiled on CUDA, interpreted on the CPU."""
    # the interpreter is chosen when triton.jit runs (module import), so ask the kernel object
    return device.type == "cuda" or type(_ws_place_kernel).__name__ == "InterpretedFunction"


def place_fused(slot_of: torch.Tensor, block_of: torch.Tensor, last_used: torch.Tensor, layer: int | torch.Tensor,
                rows: torch.Tensor, wanted: torch.Tensor, protect: torch.Tensor, step: int | torch.Tensor,
                host_tables: torch.Tensor | None = None, only: torch.Tensor | None = None,
                check_values: bool | None = None):
    """One placement (see the module docstring), in place on the three tables. Returns (miss, slots),
    and with `host_tables` (miss, slots, src, dst). The ids and each row's room for its misses are checked where
    that costs no sync (value_checks.checks_values): the kernel writes where they point."""
    check_tables(slot_of, block_of, last_used)
    _check_request(slot_of, layer, rows, wanted, protect, step)
    r, k = wanted.shape
    dev = wanted.device
    if host_tables is not None:
        _check_copies(wanted, host_tables, only)
    if checks_values(check_values, dev):
        check_values_of(slot_of, layer, rows, wanted, host_tables)
        check_room(slot_of, block_of, layer, rows, wanted, protect)
    miss = torch.empty(r, k, dtype=torch.int8, device=dev)
    slots = torch.empty(r, k, dtype=torch.int32, device=dev)
    src, dst = (torch.empty_like(slots), torch.empty_like(slots)) if host_tables is not None else (slots, slots)
    width = block_of.shape[2] - 1
    if r and k:
        _launch(slot_of, block_of, last_used, layer, rows, wanted, protect, step, miss, slots,
                host_tables, only, src, dst, width)
    if host_tables is None:
        return miss.view(torch.bool), slots
    return miss.view(torch.bool), slots, src, dst


def _launch(slot_of, block_of, last_used, layer, rows, wanted, protect, step, miss, slots,
            host_tables, only, src, dst, width) -> None:
    r, k = wanted.shape
    per_row, step_in_ptr = isinstance(layer, torch.Tensor), isinstance(step, torch.Tensor)
    rows = rows.contiguous()  # read as rows[i]: a stride-0 view (an expanded list) would be read past its end
    layer = layer.contiguous() if per_row else layer
    copies, has_only = host_tables is not None, only is not None
    meta = _meta(width, k, per_row, step_in_ptr, copies, has_only)
    only = only.expand(r, k).view(torch.uint8) if has_only else wanted
    host_tables = host_tables if copies else wanted
    _ws_place_kernel[(r,)](
        slot_of, block_of, last_used, rows, layer if per_row else rows, 0 if per_row else layer,
        wanted, protect.view(torch.uint8), step if step_in_ptr else last_used, 0 if step_in_ptr else step,
        miss, slots, host_tables, only, src, dst,
        slot_of.stride(0), slot_of.stride(1), block_of.stride(0), block_of.stride(1),
        last_used.stride(0), last_used.stride(1), wanted.stride(0), protect.stride(0), host_tables.stride(0),
        only.stride(0), only.stride(1),
        k, width, slot_of.shape[2] - 1, protect.shape[1], **meta,
    )


def _meta(width: int, k: int, per_row: bool, step_in_ptr: bool, copies: bool, has_only: bool) -> dict:
    """The kernel's compile-time arguments (and warps) for a placement's shape and argument kinds."""
    block_w = max(2, triton.next_power_of_2(width))
    idx_bits = block_w.bit_length() - 1
    return dict(LAYER_PER_ROW=per_row, STEP_IN_PTR=step_in_ptr, COPIES=copies, ONLY=has_only,
                BLOCK_K=max(2, triton.next_power_of_2(k)), BLOCK_W=block_w, IDX_BITS=idx_bits,
                KEEP_CODE=(1 << (63 - idx_bits)) - 1, num_warps=4 if block_w >= 512 else 1)


_POINTERS = {"slot_of_ptr": "*i32", "block_of_ptr": "*i32", "last_used_ptr": "*i64", "rows_ptr": "*i64",
             "layer_ptr": "*i64", "wanted_ptr": "*i32", "protect_ptr": "*u8", "step_ptr": "*i64", "miss_ptr": "*i8",
             "slots_ptr": "*i32", "host_ptr": "*i32", "only_ptr": "*u8", "src_ptr": "*i32", "dst_ptr": "*i32"}


def compile_for(arch: int, width: int, k: int, copies: bool = True):
    """Compiles the kernel ahead of time for CUDA compute capability `arch` (90: H100/H200) with no GPU
    present (Triton's bundled ptxas), per-row layers and a device step: checks that the GPU lowering
    (sort, gather, cumsum) builds where the interpreter cannot tell. Needs TRITON_INTERPRET unset."""
    meta = _meta(width, k, True, True, copies, copies)
    warps = meta.pop("num_warps")
    return compile_ahead(_ws_place_kernel, _POINTERS, meta, arch, warps, scalars={"step_val": "i64"})


def check_tables(slot_of, block_of, last_used) -> None:
    """The working-set tables' dtypes, shapes, strides and device (kernels/draft_kv.py uses them too)."""
    for name, t, dtype in (("slot_of", slot_of, torch.int32), ("block_of", block_of, torch.int32),
                           ("last_used", last_used, torch.int64)):
        if t.dim() != 3 or t.dtype != dtype or t.stride(2) != 1:
            raise ValueError(f"{name} must be {dtype} [layers, rows, columns] with unit last stride, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if last_used.shape != block_of.shape or slot_of.shape[:2] != block_of.shape[:2]:
        raise ValueError(f"tables disagree: slot_of {tuple(slot_of.shape)}, block_of {tuple(block_of.shape)}, "
                         f"last_used {tuple(last_used.shape)}")
    if block_of.shape[2] < 2 or block_of.shape[2] - 1 > 1 << 14:
        raise ValueError(f"block_of needs 1 to 16384 slots per row plus the spare column, got {block_of.shape[2]}")
    if slot_of.device != block_of.device or last_used.device != block_of.device:
        raise ValueError("slot_of, block_of and last_used must be on one device")


def _check_request(slot_of, layer, rows, wanted, protect, step) -> None:
    dev = slot_of.device
    if wanted.dim() != 2 or wanted.dtype != torch.int32 or wanted.stride(1) != 1:
        raise ValueError(f"wanted must be int32 [R, K] with unit last stride, got {wanted.dtype} {tuple(wanted.shape)}")
    r = wanted.shape[0]
    if rows.shape != (r,) or rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64 [{r}] (one per row of wanted), got {rows.dtype} {tuple(rows.shape)}")
    if protect.dim() != 2 or protect.shape[0] != r or protect.dtype != torch.bool or protect.stride(1) != 1:
        raise ValueError(f"protect must be bool [{r}, num_blocks] with unit last stride, "
                         f"got {protect.dtype} {tuple(protect.shape)}")
    if isinstance(layer, torch.Tensor) and (layer.shape != (r,) or layer.dtype != torch.int64):
        raise ValueError(f"layer must be an int or an int64 [{r}], got {layer.dtype} {tuple(layer.shape)}")
    if isinstance(step, torch.Tensor) and (step.dim() != 0 or step.dtype != torch.int64):
        raise ValueError(f"step must be an int or a 0-d int64 tensor, got {step.dtype} {tuple(step.shape)}")
    if not isinstance(layer, torch.Tensor) and not 0 <= layer < slot_of.shape[0]:
        raise ValueError(f"layer {layer} out of range [0, {slot_of.shape[0]})")
    for name, t in (("rows", rows), ("wanted", wanted), ("protect", protect), ("layer", layer), ("step", step)):
        if isinstance(t, torch.Tensor) and t.device != dev:
            raise ValueError(f"{name} is on {t.device}, the tables on {dev}")


def check_values_of(slot_of, layer, rows, wanted, host_tables) -> None:
    """Each layer and row within slot_of, each wanted block -1 or one of its columns but the spare, and within
    host_tables' columns when the copies are listed."""
    if isinstance(layer, torch.Tensor):
        check_range("layer", layer, 0, slot_of.shape[0])
    check_range("rows", rows, 0, slot_of.shape[1])
    check_range("wanted", wanted, -1, slot_of.shape[2] - 1)
    if host_tables is not None:
        check_range("wanted blocks (host_tables columns)", wanted[wanted >= 0], 0, host_tables.shape[1])


def check_room(slot_of, block_of, layer, rows, wanted, protect) -> None:
    """Each row's misses at most its slots not protected: the kernel hands the k-th miss the k-th victim, so more
    misses than victims would give two blocks one slot, or a slot past the row."""
    lay = layer[:, None] if isinstance(layer, torch.Tensor) else layer
    miss = (wanted >= 0) & (slot_of[lay, rows[:, None], wanted.clamp(min=0).long()] < 0)
    width, p = block_of.shape[2] - 1, protect.shape[1]
    held = block_of[lay, rows[:, None], torch.arange(width, device=block_of.device)].long()
    known = (held >= 0) & (held < p)
    padded = torch.cat([protect, protect.new_zeros(len(protect), 1)], 1)  # column p: a block not known
    room = width - (known & padded.gather(1, torch.where(known, held, p))).sum(1)
    over = (miss.sum(1) > room).nonzero().flatten()
    if len(over):
        i = int(over[0])
        raise ValueError(f"row {int(rows[i])} wants {int(miss[i].sum())} blocks without a slot but has only "
                         f"{int(room[i])} slots not protected: the protected blocks and the misses must fit in the "
                         f"row's {width} slots")


def _check_copies(wanted, host_tables, only) -> None:
    r, k = wanted.shape
    if host_tables.dim() != 2 or host_tables.shape[0] != r or host_tables.dtype != torch.int32 \
            or host_tables.stride(1) != 1:
        raise ValueError(f"host_tables must be int32 [{r}, blocks] with unit last stride, "
                         f"got {host_tables.dtype} {tuple(host_tables.shape)}")
    if only is not None and (only.dtype != torch.bool or only.dim() != 2 or only.shape[0] != r
                             or only.shape[1] not in (1, k)):
        raise ValueError(f"only must be bool [{r}, {k}] or [{r}, 1], got {only.dtype} {tuple(only.shape)}")
    if host_tables.device != wanted.device or (only is not None and only.device != wanted.device):
        raise ValueError("host_tables and only must be on the tables' device")
