"""Block copies between the host store and the GPU pool, one kernel launch per list of chunks.

Layouts (DESIGN.md "Memory layout"):
  host_kv [layers, host_blocks, 2, block_size, Hkv, D]  pinned host memory on GPU machines
  gpu_kv  [layers, slots,       2, block_size, Hkv, D]  the GPU pool
One (layer, block) is one contiguous chunk of 2 * block_size * Hkv * D elements (Qwen3-8B bf16:
64 KiB): the unit of transfer.

gather_host_blocks   host_kv[layer_ids[i], src_blocks[i]] -> gpu_kv[layer_ids[i], dst_slots[i]]
store_blocks_to_host gpu_kv[layer_ids[i], src_slots[i]]   -> host_kv[layer_ids[i], dst_blocks[i]]

On CUDA with a pinned host store both run one Triton kernel that touches the pinned host memory
directly through its UVA device address (zero-copy): each program copies one chunk (or a share of
one) with 16-byte vector loads/stores, reinterpreting the data as int32 words, so the copy is
bit-exact for any dtype. This replaces one cudaMemcpyAsync per chunk (launch-bound: ~6.6 us each)
with one launch that runs at PCIe speed (see /work/shared/DESIGN.md "Transfer physics").

How the device gets at host memory: a pinned tensor (cudaHostAlloc, as torch's pin_memory does)
is mapped into the device address space under UVA at the same address, so the host pointer is
itself a valid device pointer. `host_device_view` wraps it as a CUDA tensor through the
`__cuda_array_interface__` protocol (torch.as_tensor), which Triton accepts like any CUDA tensor
(the reference probe does the same through CuPy's UnownedMemory; this needs no CuPy). Triton's
launcher also translates the pointer with cuPointerGetAttribute(DEVICE_POINTER), so systems where the
device address differs from the host address are handled too.

Per (source, destination) pair of tensor OBJECTS the launcher caches its plan (word views, the
mapped host view, strides), so pass the same pool / host-store tensors on every call rather than
fresh views of them. Both functions launch on the current CUDA stream, or on `stream` when given (the engine's copy
stream); they never synchronise. The caller keeps index tensors alive until the stream has passed
the copy (record_stream or hold a reference) and orders readers with an event. Indices are not
range-checked on the GPU (that would need a sync); they are checked when given on the CPU.
Destination (layer, slot) pairs must be distinct within one call. An entry whose source or
destination index is -1 is skipped, so callers can pass fixed-size lists built on the device.

Without CUDA: under TRITON_INTERPRET=1 the same kernel runs on CPU tensors (tests); otherwise the
torch reference (`gather_host_blocks_reference`, `store_blocks_to_host_reference`) does the work.
A CUDA pool with an unpinned CPU host store falls back to an indexed copy through pageable memory
(slow: ~9 GB/s, and synchronous), with a one-time warning.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
import triton
import triton.language as tl

from oasiskv.kernels.device_info import num_sms
from oasiskv.kernels.value_checks import interpreted

__all__ = [
    "gather_host_blocks",
    "gather_host_blocks_reference",
    "host_device_view",
    "store_blocks_to_host",
    "store_blocks_to_host_reference",
]


@triton.jit
def _copy_chunks_kernel(
    src_ptr, dst_ptr, layer_ptr, src_idx_ptr, dst_idx_ptr,
    src_layer_stride, dst_layer_stride,  # in words; the block stride is CHUNK (contiguous tensors)
    n,  # entries: program p of grid axis 0 copies entries p, p + P, p + 2P, ... (P programs on that axis)
    CHUNK: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, EVEN: tl.constexpr,
):
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        _copy_chunk(src_ptr, dst_ptr, layer_ptr, src_idx_ptr, dst_idx_ptr, src_layer_stride, dst_layer_stride,
                    i, tl.program_id(1), CHUNK, TILE, SPLITS, EVEN)


@triton.jit
def _copy_chunk(src_ptr, dst_ptr, layer_ptr, src_idx_ptr, dst_idx_ptr, src_layer_stride, dst_layer_stride, i, part,
                CHUNK: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, EVEN: tl.constexpr):
    layer = tl.load(layer_ptr + i).to(tl.int64)
    s = tl.load(src_idx_ptr + i).to(tl.int64)
    d = tl.load(dst_idx_ptr + i).to(tl.int64)
    ok = (s >= 0) & (d >= 0)  # -1 marks an entry to skip (fixed-size lists built without a host sync)
    tile_limit = tl.where(ok, TILE, 0)  # masks as limits: uniform over a tile, so accesses stay vectorised
    chunk_limit = tl.where(ok, CHUNK, 0)
    s = tl.maximum(s, 0)
    d = tl.maximum(d, 0)
    src = src_ptr + layer * src_layer_stride + s * CHUNK
    dst = dst_ptr + layer * dst_layer_stride + d * CHUNK
    offs = tl.arange(0, TILE)
    NUM_TILES: tl.constexpr = (CHUNK + TILE - 1) // TILE
    for t in range(part, NUM_TILES, SPLITS):
        o = t * TILE + offs
        if EVEN:
            m = offs < tile_limit
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)
        else:
            m = o < chunk_limit
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


# ----------------------------------------------------------------------------------------------
# helpers

WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}  # same-size integer views: exact copies
_TYPESTR = {torch.int32: "<i4", torch.int16: "<i2", torch.uint8: "|u1"}
_warned_unpinned = False


def _check(name_src, src, name_dst, dst, layer_ids, src_idx, dst_idx, idx_names):
    for name, t in ((name_src, src), (name_dst, dst)):
        if t.dim() != 6 or t.shape[2] != 2:
            raise ValueError(
                f"{name} must be [layers, blocks, 2, block_size, Hkv, D], got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if src.dtype != dst.dtype:
        raise ValueError(f"dtype mismatch: {name_src} is {src.dtype}, {name_dst} is {dst.dtype}")
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(
            f"shape mismatch: {name_src} {tuple(src.shape)} vs {name_dst} {tuple(dst.shape)} "
            "(layers and the block shape [2, block_size, Hkv, D] must agree)")
    n = None
    for name, t in zip(idx_names, (layer_ids, src_idx, dst_idx)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
        if n is None:
            n = t.numel()
        elif t.numel() != n:
            raise ValueError(f"index lists differ in length: {idx_names} -> "
                             f"{layer_ids.numel()}, {src_idx.numel()}, {dst_idx.numel()}")
    # range checks only where they cost no device sync
    for name, t, lo, hi in zip(idx_names, (layer_ids, src_idx, dst_idx), (0, -1, -1),
                               (src.shape[0], src.shape[1], dst.shape[1])):
        if t.device.type == "cpu" and t.numel() and (int(t.min()) < lo or int(t.max()) >= hi):
            raise ValueError(f"{name} out of range [{lo}, {hi})")
    return n


def _word_size(*tensors: torch.Tensor) -> int:
    """Widest word (4, 2 or 1 bytes) that divides the chunk size and every base address."""
    chunk_bytes = _chunk_numel(tensors[0]) * tensors[0].element_size()
    for w in (4, 2, 1):
        if chunk_bytes % w == 0 and all(t.data_ptr() % w == 0 for t in tensors):
            return w
    return 1


def _chunk_numel(t: torch.Tensor) -> int:
    return t.shape[2] * t.shape[3] * t.shape[4] * t.shape[5]


def _words(t: torch.Tensor, w: int) -> torch.Tensor:
    return t.view(-1).view(torch.uint8).view(WORD_DTYPES[w]) if t.numel() else t.view(-1)


class _CudaArrayInterface:
    def __init__(self, ptr: int, n: int, typestr: str):
        self.__cuda_array_interface__ = {
            "shape": (n,), "typestr": typestr, "data": (ptr, False), "version": 2, "strides": None,
        }


_VIEW_CACHE: dict[tuple, torch.Tensor] = {}


def host_device_view(host: torch.Tensor, w: int, device: torch.device) -> torch.Tensor:
    """A 1-D CUDA tensor of w-byte words aliasing the pinned host tensor `host` through UVA.
    Cached per host tensor object; the entry goes when that object is collected."""
    n_words = host.numel() * host.element_size() // w
    key = (id(host), host.data_ptr(), n_words, w, str(device))
    view = _VIEW_CACHE.get(key)
    if view is None:
        cai = _CudaArrayInterface(host.data_ptr(), n_words, _TYPESTR[WORD_DTYPES[w]])
        view = torch.as_tensor(cai, device=device)
        if view.data_ptr() != host.data_ptr() or view.device.type != "cuda":
            raise RuntimeError("could not map the pinned host store into the device address space")
        _VIEW_CACHE[key] = view
        weakref.finalize(host, _VIEW_CACHE.pop, key, None)
    return view


def _launch(src_words, dst_words, src_layer_stride, dst_layer_stride, chunk_words,
            layer_ids, src_idx, dst_idx, *, tile=None, splits=None, num_warps=None, programs=None):
    """`programs`: at most this many programs (x splits) copy the entries, looping over them: a
    background copy then leaves most SMs to the compute stream (default: one program per entry)."""
    n = layer_ids.numel()
    layer_ids, src_idx, dst_idx = layer_ids.contiguous(), src_idx.contiguous(), dst_idx.contiguous()  # read as [i]
    if tile is None:
        tile = min(4096, triton.next_power_of_2(chunk_words))
    num_tiles = triton.cdiv(chunk_words, tile)
    if programs is not None:  # a background copy: few programs, each a whole chunk at a time
        programs, splits = max(1, min(programs, n)), splits or 1
    else:
        programs = n
    if splits is None:
        sms = num_sms(dst_words.device) if dst_words.is_cuda else 8
        splits = max(1, min(num_tiles, triton.cdiv(2 * sms, n)))
    if num_warps is None:
        num_warps = 4 if tile >= 512 else 1
    _copy_chunks_kernel[(programs, splits)](
        src_words, dst_words, layer_ids, src_idx, dst_idx,
        src_layer_stride, dst_layer_stride, n,
        CHUNK=chunk_words, TILE=tile, SPLITS=splits, EVEN=chunk_words % tile == 0,
        num_warps=num_warps,
    )


_PLANS: dict[tuple, tuple] = {}


def _cuda_plan(src: torch.Tensor, dst: torch.Tensor):
    """Per (src, dst) tensor pair, what a CUDA launch needs: word views (the host side mapped into
    the device address space), layer strides in words, chunk size in words; None when the host
    side is not pinned. Cached per pair of tensor objects (entries go when either is collected),
    so steady-state calls skip the pointer queries and view construction."""
    key = (id(src), id(dst), src.data_ptr(), dst.data_ptr())
    plan = _PLANS.get(key)
    if plan is None:
        host = src if not src.is_cuda else (dst if not dst.is_cuda else None)
        if host is not None and not host.is_pinned():
            plan = (None,)
        else:
            dev = dst.device if dst.is_cuda else src.device
            w = _word_size(src, dst)
            plan = (
                _words(src, w) if src.is_cuda else host_device_view(src, w, dev),
                _words(dst, w) if dst.is_cuda else host_device_view(dst, w, dev),
                src.stride(0) * src.element_size() // w,
                dst.stride(0) * dst.element_size() // w,
                _chunk_numel(src) * src.element_size() // w,
                dev,
            )
        _PLANS[key] = plan
        weakref.finalize(src, _PLANS.pop, key, None)
        weakref.finalize(dst, _PLANS.pop, key, None)
    return plan


def _copy(src, dst, layer_ids, src_idx, dst_idx, stream, reference, **tune):
    """Shared body of both directions: pick the kernel (CUDA / interpreter) or the reference."""
    global _warned_unpinned
    if not (src.is_cuda or dst.is_cuda):
        if interpreted():
            w = _word_size(src, dst)
            chunk_words = _chunk_numel(src) * src.element_size() // w
            _launch(_words(src, w), _words(dst, w), src.stride(0) * src.element_size() // w,
                    dst.stride(0) * dst.element_size() // w, chunk_words,
                    layer_ids, src_idx, dst_idx, **tune)
        else:
            reference(src, dst, layer_ids, src_idx, dst_idx)
        return
    plan = _cuda_plan(src, dst)
    if plan[0] is None:
        if not _warned_unpinned:
            warnings.warn("host store is not pinned: falling back to a slow, synchronous indexed copy")
            _warned_unpinned = True
        reference(src, dst, layer_ids, src_idx, dst_idx)
        return
    src_words, dst_words, src_ls, dst_ls, chunk_words, dev = plan
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        idx = [t if t.is_cuda else t.to(dev, non_blocking=True) for t in (layer_ids, src_idx, dst_idx)]
        _launch(src_words, dst_words, src_ls, dst_ls, chunk_words, *idx, **tune)


# ----------------------------------------------------------------------------------------------
# public API


def gather_host_blocks(
    host_kv: torch.Tensor,
    gpu_kv: torch.Tensor,
    layer_ids: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    stream: "torch.cuda.Stream | None" = None,
    **tune,
) -> torch.Tensor:
    """Copy host_kv[layer_ids[i], src_blocks[i]] into gpu_kv[layer_ids[i], dst_slots[i]] for all i.

    Index lists are int32 [N] (CPU or GPU). One zero-copy Triton launch on CUDA with a pinned host
    store (on `stream` if given, else the current stream; asynchronous). Returns gpu_kv.
    `tune`: tile, splits, num_warps (for benchmarks) and programs (see _launch).
    """
    n = _check("host_kv", host_kv, "gpu_kv", gpu_kv, layer_ids, src_blocks, dst_slots,
               ("layer_ids", "src_blocks", "dst_slots"))
    if n:
        _copy(host_kv, gpu_kv, layer_ids, src_blocks, dst_slots, stream,
              _indexed_copy, **tune)
    return gpu_kv


def store_blocks_to_host(
    gpu_kv: torch.Tensor,
    host_kv: torch.Tensor,
    layer_ids: torch.Tensor,
    src_slots: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    stream: "torch.cuda.Stream | None" = None,
    **tune,
) -> torch.Tensor:
    """Copy gpu_kv[layer_ids[i], src_slots[i]] into host_kv[layer_ids[i], dst_blocks[i]] for all i
    (the write-once of filled tail blocks). On CUDA with a pinned host store: the same copy kernel
    writing the pinned memory directly (one launch, asynchronous on `stream` or the current
    stream; the host sees the bytes once that stream is synchronised or an event recorded after
    it has completed). Returns host_kv."""
    n = _check("gpu_kv", gpu_kv, "host_kv", host_kv, layer_ids, src_slots, dst_blocks,
               ("layer_ids", "src_slots", "dst_blocks"))
    if n:
        _copy(gpu_kv, host_kv, layer_ids, src_slots, dst_blocks, stream,
              _indexed_copy, **tune)
    return host_kv


def _indexed_copy(src, dst, layer_ids, src_idx, dst_idx):
    keep = (src_idx >= 0) & (dst_idx >= 0)
    layer_ids, src_idx, dst_idx = layer_ids[keep], src_idx[keep], dst_idx[keep]
    chunks = src[layer_ids.to(src.device).long(), src_idx.to(src.device).long()]
    dst[layer_ids.to(dst.device).long(), dst_idx.to(dst.device).long()] = chunks.to(dst.device)


def gather_host_blocks_reference(host_kv, gpu_kv, layer_ids, src_blocks, dst_slots) -> torch.Tensor:
    """Torch twin of gather_host_blocks: advanced-index copy (any devices)."""
    _check("host_kv", host_kv, "gpu_kv", gpu_kv, layer_ids, src_blocks, dst_slots,
           ("layer_ids", "src_blocks", "dst_slots"))
    if layer_ids.numel():
        _indexed_copy(host_kv, gpu_kv, layer_ids, src_blocks, dst_slots)
    return gpu_kv


def store_blocks_to_host_reference(gpu_kv, host_kv, layer_ids, src_slots, dst_blocks) -> torch.Tensor:
    """Torch twin of store_blocks_to_host: advanced-index copy (any devices)."""
    _check("gpu_kv", gpu_kv, "host_kv", host_kv, layer_ids, src_slots, dst_blocks,
           ("layer_ids", "src_slots", "dst_blocks"))
    if layer_ids.numel():
        _indexed_copy(gpu_kv, host_kv, layer_ids, src_slots, dst_blocks)
    return host_kv
