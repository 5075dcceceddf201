"""Prefill's K/V written token by token into the pinned host store, from the GPU, in one launch.

    host_kv[layer, blocks[i], 0, offsets[i]] = k[i]
    host_kv[layer, blocks[i], 1, offsets[i]] = v[i]        for every token i

host_kv is the host store [layers, blocks, 2, block_size, Hkv, D]; k and v are [T, Hkv, D] with each
token's [Hkv, D] row contiguous. On CUDA with a pinned store, one program per token stores its two
rows through the store's UVA device address (kernels/host_gather.py explains the mapping): the
bytes cross PCIe once, and nothing waits on the host. The torch form it replaces copied K and V to
pageable memory and scattered them on the CPU, synchronously, layer by layer (docs/BENCHMARKS.md,
eighth session, has the end-to-end effect on a 16K-prompt run).

The copy is of the elements' bits (integer words of the element size), so it is exact for any dtype.
It is asynchronous on the current stream: host code that reads the store must synchronise first
(device readers on other streams order themselves after it as they do for every compute-stream
write). Destinations (blocks[i], offsets[i]) must be distinct. Without CUDA: under
TRITON_INTERPRET=1 the kernel runs on CPU tensors (tests); otherwise the torch reference runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.host_gather import WORD_DTYPES, host_device_view
from oasiskv.kernels.value_checks import check_range, checks_values, interpreted

__all__ = ["store_tokens_to_host", "store_tokens_to_host_reference"]


@triton.jit
def _store_tokens_kernel(k_ptr, v_ptr, host_ptr, blocks_ptr, offsets_ptr, s_kt, s_vt,
                         layer_base, s_block, s_kind, s_token, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    block = tl.load(blocks_ptr + t).to(tl.int64)
    offset = tl.load(offsets_ptr + t).to(tl.int64)
    dst = host_ptr + layer_base + block * s_block + offset * s_token
    e = tl.arange(0, ROW_PAD)
    m = e < ROW
    tl.store(dst + e, tl.load(k_ptr + t * s_kt + e, mask=m), mask=m)
    tl.store(dst + s_kind + e, tl.load(v_ptr + t * s_vt + e, mask=m), mask=m)


def _check(k, v, host_kv, layer, blocks, offsets) -> None:
    if host_kv.dim() != 6 or host_kv.shape[2] != 2 or not host_kv.is_contiguous():
        raise ValueError(f"host_kv must be a contiguous [layers, blocks, 2, block_size, Hkv, D], "
                         f"got {tuple(host_kv.shape)}")
    row_shape = tuple(host_kv.shape[4:])
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != row_shape:
            raise ValueError(f"{name} must be [T, {row_shape[0]}, {row_shape[1]}], got {tuple(t.shape)}")
        if t.dtype != host_kv.dtype:
            raise ValueError(f"{name} is {t.dtype}, the host store {host_kv.dtype}")
        if t.shape[2] > 1 and t.stride(2) != 1 or t.shape[1] > 1 and t.stride(1) != t.shape[2]:
            raise ValueError(f"each token's [Hkv, D] row of {name} must be contiguous, got strides {t.stride()}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v hold {k.shape[0]} and {v.shape[0]} tokens")
    for name, t in (("blocks", blocks), ("offsets", offsets)):
        if t.dim() != 1 or t.shape[0] != k.shape[0] or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [{k.shape[0]}], got {t.dtype} {tuple(t.shape)}")
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k on {k.device}")
    if not 0 <= layer < host_kv.shape[0]:
        raise ValueError(f"layer {layer} out of range [0, {host_kv.shape[0]})")


def store_tokens_to_host_reference(k, v, host_kv, layer, blocks, offsets) -> None:
    """Torch twin: through pageable memory, scattered on the CPU (synchronous)."""
    _check(k, v, host_kv, layer, blocks, offsets)
    kv = host_kv[layer]
    blocks, offsets = blocks.cpu(), offsets.cpu()
    kv[blocks, 0, offsets] = k.cpu()
    kv[blocks, 1, offsets] = v.cpu()


def store_tokens_to_host(k, v, host_kv, layer, blocks, offsets, check_values: bool | None = None) -> None:
    """Writes token i's K/V to (blocks[i], offsets[i]) of `layer` in the host store (module docstring). The
    places are checked where that costs no sync (value_checks.checks_values)."""
    _check(k, v, host_kv, layer, blocks, offsets)
    blocks, offsets = blocks.contiguous(), offsets.contiguous()  # read as [i]
    if checks_values(check_values, k.device):
        check_range("blocks", blocks, 0, host_kv.shape[1])
        check_range("offsets", offsets, 0, host_kv.shape[3])
    interpret = interpreted() and not k.is_cuda
    if not (k.is_cuda and host_kv.is_pinned() or interpret):
        store_tokens_to_host_reference(k, v, host_kv, layer, blocks, offsets)
        return
    if k.shape[0] == 0:
        return
    word = WORD_DTYPES[host_kv.element_size()]
    host = host_kv.view(-1).view(word) if interpret else host_device_view(host_kv, host_kv.element_size(), k.device)
    s = host_kv.stride()
    row = s[3]  # Hkv * D elements
    _store_tokens_kernel[(k.shape[0],)](
        k.view(word), v.view(word), host, blocks, offsets, k.stride(0), v.stride(0),
        layer * s[0], s[1], s[2], s[3], ROW=row, ROW_PAD=triton.next_power_of_2(row),
        num_warps=4 if row >= 512 else 1)
