"""The host store: every running request's full KV in (pinned) host memory, block-granular, laid
out [layers, blocks, 2, block_size, kv_heads, head_dim] so one (layer, block) is one contiguous chunk."""
from __future__ import annotations

import contextlib
import os
import weakref

import torch

from oasiskv.config import ModelConfig
from oasiskv.kernels.host_gather import host_device_view
from oasiskv.kernels.host_tokens import store_tokens_to_host, store_tokens_to_host_reference

GiB = 1 << 30


def spare_host_bytes(reserve_gb: float = 8.0) -> int:
    """Host memory we may take by default: what is available now, less a reserve for the rest."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return max(0, int(available - reserve_gb * GiB))


def register_pinned(t: torch.Tensor) -> None:
    """Page-locks an existing host tensor (cudaHostRegister). Unlike one huge cudaHostAlloc, this
    works on VMs whose memory grows as it is touched: the tensor was zero-filled first. Under
    unified addressing the device can read it directly (the gather kernel does)."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise MemoryError(f"could not pin {t.numel() * t.element_size() / GiB:.1f} GiB of host memory for the "
                          f"KV store (CUDA error {int(err)}); lower --host-kv-gb")
    # unpin before the memory goes back to the allocator: a later store may reuse the same addresses
    weakref.finalize(t, torch.cuda.cudart().cudaHostUnregister, t.data_ptr())


class HostStore:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, pin: bool):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.num_layers, num_blocks, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype)
        if pin:
            register_pinned(self.kv)

    def layer(self, i: int) -> torch.Tensor:
        return self.kv[i]

    def device_view(self, device: torch.device) -> torch.Tensor:
        """The pinned store as a CUDA tensor of the same shape and dtype, aliasing it through UVA:
        kernels that read it read host memory over PCIe."""
        words = host_device_view(self.kv, self.kv.element_size(), device)
        return words.view(self.kv.dtype).view(self.kv.shape)

    @property
    def chunk_bytes(self) -> int:
        return self.kv[0, 0].numel() * self.kv.element_size()

    def write_tokens(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Prefill writes: token i's K/V to (blocks[i], offsets[i]) of this layer. From CUDA tensors
        into a pinned store: asynchronous, on the current stream (kernels/host_tokens.py). CPU tensors
        take the torch form (not the interpreted kernel, which runs a Python program per token)."""
        store = store_tokens_to_host if k.is_cuda else store_tokens_to_host_reference
        store(k, v, self.kv, layer, blocks, offsets)

    def write_span(self, layer: int, start_pos: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor,
                   blocks: torch.Tensor, offsets: torch.Tensor, stream: "torch.cuda.Stream | None" = None,
                   staging: torch.Tensor | None = None) -> int:
        """One prefill chunk's K/V [T, Hkv, D]: tokens at positions start_pos.. of a request whose blocks
        are block_ids (by position); `blocks`/`offsets` (device, [T]) are each token's block and offset.
        Whole blocks are staged in the store's layout and copied by the copy engines (DMA), one copy per
        run of consecutive ids, on `stream` (default the current one): they take no SMs from the compute.
        Tokens of partially written blocks (at either end) go through write_tokens, on the current
        stream; the two never write the same block. Readers of the whole blocks must first wait for
        `stream`. `staging`: a device buffer [n, 2, block_size, Hkv, D] to stage in (its first blocks; the
        caller keeps it from being rewritten before the copies have read it), else a new tensor.
        Returns the number of blocks staged."""
        bs, end = self.block_size, start_pos + len(k)
        first, last = -(-start_pos // bs), end // bs  # whole blocks [first, last)
        if first >= last:
            self.write_tokens(layer, blocks, offsets, k, v)
            return 0
        head, tail = first * bs - start_pos, last * bs - start_pos  # token indices where whole blocks start, end
        for lo, hi in ((0, head), (tail, len(k))):
            if hi > lo:
                self.write_tokens(layer, blocks[lo:hi], offsets[lo:hi], k[lo:hi], v[lo:hi])
        shape = (last - first, bs, *k.shape[1:])
        staged = None if staging is None else staging[:last - first]
        staged = torch.stack([k[head:tail].reshape(shape), v[head:tail].reshape(shape)], dim=1, out=staged)
        current = torch.cuda.current_stream(k.device) if k.is_cuda else None
        stream = stream or current
        if stream is not None and stream != current:
            stream.wait_stream(current)
            if staging is None:
                staged.record_stream(stream)  # freed by the allocator only once the copies have read it
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, j, block in consecutive_runs(block_ids[first:last]):
                self.kv[layer, block: block + j - i].copy_(staged[i:j], non_blocking=True)
        return last - first

    def read_prefix(self, layer: int, blocks: torch.Tensor, num_tokens: int, device: torch.device):
        """K and V of the first num_tokens tokens stored in these blocks: [num_tokens, Hkv, D] each."""
        if device.type == "cuda" and self.kv.is_pinned():
            # gathered on the GPU from the store's device address: PCIe reads, no host copy, and no
            # sync (the caller orders the current stream after the writes to these blocks)
            chunk = self.device_view(device)[layer].index_select(0, blocks.to(device, non_blocking=True))
        else:
            if device.type == "cuda":  # the host reads what the device may still be writing
                torch.cuda.current_stream(device).synchronize()
            chunk = self.kv[layer][blocks.cpu()].to(device)
        k = chunk[:, 0].reshape(-1, *chunk.shape[-2:])[:num_tokens]
        v = chunk[:, 1].reshape(-1, *chunk.shape[-2:])[:num_tokens]
        return k, v


def consecutive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(i, j, ids[i]) for each maximal run ids[i:j] of consecutive ids (ids[i], ids[i] + 1, ...)."""
    runs, i = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or ids[j] != ids[j - 1] + 1:
            runs.append((i, j, ids[i]))
            i = j
    return runs
