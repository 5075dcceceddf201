"""A step's new K and V into the paged pool, in one launch.

  kv_layer[slot_blocks[t], 0, slot_offsets[t]] = k[t]
  kv_layer[slot_blocks[t], 1, slot_offsets[t]] = v[t]       for every token t of the step

Torch does this as two advanced-index writes (index_put), which on the H200 took 113 us each in a 16K qwen3-8b
prefill (72 launches, two a layer: 8.1 ms of a 535 ms prefill, about 0.3 TB/s for 33 MB of K or V; 2026-12-04,
scripts/gpu_prefill_profile.py --modes dense).
Here each program copies whole token rows (kv_heads x head_dim values) of both K and V.

`kv_layer` is one layer of the pool, [blocks, 2, block_size, kv_heads, head_dim] with its last two dims contiguous;
`k`, `v` are [T, kv_heads, head_dim] with their last two dims contiguous; `slot_blocks`, `slot_offsets` are int64 [T]
on kv_layer's device. Two tokens written to one slot leave one of them there, as index_put does: the engine never
gives two tokens one slot, except padding rows of a CUDA graph, which write a scratch slot. The torch reference is
write_kv_reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.value_checks import check_range, interpreted

__all__ = ["write_kv_slots", "write_kv_reference"]

_TILE_ELEMENTS = 4096  # values a program per tensor: 4 rows of qwen3-8b's 8 x 128, 21 of SmolLM2's 3 x 64


@triton.jit
def _write_kv_kernel(kv_ptr, k_ptr, v_ptr, blocks_ptr, offsets_ptr, T, s_blk, s_kv, s_off, s_k, s_v, ROW,
                     BLOCK_ROW: tl.constexpr, ROWS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK_ROW)
    live = tok < T
    block = tl.load(blocks_ptr + tok, mask=live, other=0)
    offset = tl.load(offsets_ptr + tok, mask=live, other=0)
    m = live[:, None] & (col[None, :] < ROW)
    dst = kv_ptr + (block * s_blk + offset * s_off)[:, None] + col[None, :]
    tl.store(dst, tl.load(k_ptr + tok[:, None] * s_k + col[None, :], mask=m), mask=m)
    tl.store(dst + s_kv, tl.load(v_ptr + tok[:, None] * s_v + col[None, :], mask=m), mask=m)


def write_kv_slots(kv_layer: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes k[t] and v[t] at (slot_blocks[t], slot_offsets[t]) of kv_layer (see the module docstring). Triton on
    CUDA tensors and under TRITON_INTERPRET=1, else the torch twin."""
    _check(kv_layer, slot_blocks, slot_offsets, k, v)
    slot_blocks, slot_offsets = slot_blocks.contiguous(), slot_offsets.contiguous()  # read as [t]
    tokens = k.shape[0]
    if tokens == 0:
        return
    if not kv_layer.is_cuda:  # the slots are trusted by the kernel: checked where that costs no sync
        check_range("slot_blocks", slot_blocks, 0, kv_layer.shape[0])
        check_range("slot_offsets", slot_offsets, 0, kv_layer.shape[2])
        if not interpreted():  # no Triton driver on a CPU: the torch twin
            return write_kv_reference(kv_layer, slot_blocks, slot_offsets, k, v)
    row = k.shape[1] * k.shape[2]
    block_row = triton.next_power_of_2(row)
    per_program = max(1, _TILE_ELEMENTS // block_row)
    _write_kv_kernel[(triton.cdiv(tokens, per_program),)](
        kv_layer, k, v, slot_blocks, slot_offsets, tokens, kv_layer.stride(0), kv_layer.stride(1),
        kv_layer.stride(2), k.stride(0), v.stride(0), row, BLOCK_ROW=block_row, ROWS=per_program, num_warps=4)


def write_kv_reference(kv_layer: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> None:
    """The torch ops the policies ran before the kernel (two index_put writes)."""
    kv_layer[slot_blocks, 0, slot_offsets] = k
    kv_layer[slot_blocks, 1, slot_offsets] = v


def _check(kv_layer, slot_blocks, slot_offsets, k, v) -> None:
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(f"kv_layer must be [blocks, 2, block_size, kv_heads, head_dim], got {tuple(kv_layer.shape)}")
    row_shape = tuple(kv_layer.shape[3:])
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != row_shape:
        raise ValueError(f"k and v must be [T, {row_shape[0]}, {row_shape[1]}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if slot_blocks.shape != (k.shape[0],) or slot_offsets.shape != (k.shape[0],):
        raise ValueError(f"slot_blocks and slot_offsets must be [{k.shape[0]}] (one per token), got "
                         f"{tuple(slot_blocks.shape)} and {tuple(slot_offsets.shape)}")
    if slot_blocks.dtype != torch.int64 or slot_offsets.dtype != torch.int64:
        raise ValueError(f"slots must be int64, got {slot_blocks.dtype} and {slot_offsets.dtype}")
    if k.dtype != kv_layer.dtype or v.dtype != kv_layer.dtype:
        raise ValueError(f"k and v must be the pool's {kv_layer.dtype}, got {k.dtype} and {v.dtype}")
    if len({t.device for t in (kv_layer, slot_blocks, slot_offsets, k, v)}) != 1:
        raise ValueError("kv_layer, the slots, k and v must be on one device")
    head_dim = row_shape[1]
    for name, t in (("kv_layer", kv_layer), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or (t.shape[-2] > 1 and t.stride(-2) != head_dim):
            raise ValueError(f"{name} must be contiguous over its last two dims (kv_heads, head_dim)")
