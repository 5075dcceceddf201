"""A step's host arrays to the device in one copy.

Each small `tensor.to(device)` from pageable memory makes the driver stage the bytes and wait for the DMA. On the
H200's host the runner's `prepare`, six such copies and about 0.3 ms of Python, took 0.87-1.55 ms a decode step
(docs/BENCHMARKS.md, thirteenth session; the copies were not timed one by one). Here the arrays are packed into
pinned memory and sent as one asynchronous copy into a fresh device buffer; each array comes back as a view of
that buffer.

Pinned buffers are reused in turn; before one is rewritten, the host waits for the copy that last read it (long
done in practice: a step samples, and so synchronises, before the next is prepared). On the CPU the views share a
fresh buffer per call: nothing is copied."""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # every array starts at a multiple of 16 bytes: any dtype's view, and aligned loads in the kernels
TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}


class StepUpload:
    def __init__(self, device: torch.device, buffers: int = 2):
        self.device, self.cuda = device, device.type == "cuda"
        self.pinned: list[torch.Tensor | None] = [None] * buffers
        self.copied: list[torch.cuda.Event | None] = [None] * buffers
        self.turn = 0

    def __call__(self, arrays: list[np.ndarray]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the device buffer, one device tensor per array, of its dtype and shape). Arrays are int64, int32 or
        bool."""
        offsets, total = [], 0
        for a in arrays:
            if a.dtype not in TORCH_DTYPES:
                raise TypeError(f"StepUpload takes int64, int32 or bool arrays, got {a.dtype}")
            offsets.append(total)
            total += -(-a.nbytes // ALIGN) * ALIGN
        host, pinned = self.host_buffer(max(total, ALIGN))
        for a, start in zip(arrays, offsets):
            host[start:start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if self.cuda:
            packed = torch.empty(len(host), dtype=torch.uint8, device=self.device)
            packed.copy_(pinned, non_blocking=True)
            if self.copied[self.turn] is None:
                self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()  # host_buffer waited for its last record before the buffer was refilled
            self.turn = (self.turn + 1) % len(self.pinned)
        else:
            packed = pinned
        views = [packed[start:start + a.nbytes].view(TORCH_DTYPES[a.dtype]).view(a.shape)
                 for a, start in zip(arrays, offsets)]
        return packed, views

    def host_buffer(self, nbytes: int) -> tuple[np.ndarray, torch.Tensor]:
        """This turn's host memory of `nbytes`, as numpy (to fill) and as the tensor copied from."""
        if not self.cuda:
            out = torch.empty(nbytes, dtype=torch.uint8)
            return out.numpy(), out
        done = self.copied[self.turn]
        if done is not None:
            done.synchronize()
        buffer = self.pinned[self.turn]
        if buffer is None or len(buffer) < nbytes:
            buffer = torch.empty(max(nbytes, 2 * len(buffer) if buffer is not None else 0), dtype=torch.uint8,
                                 pin_memory=True)
            self.pinned[self.turn] = buffer
        return buffer.numpy()[:nbytes], buffer[:nbytes]


class HostCopies:
    """Small device tensors copied to the host without a sync: into pinned buffers used in turn, so a copy stays
    readable while the next `turns - 1` are made (async scheduling reads a step's tokens after launching the next).
    A copy is complete once the stream has passed it (an event, or any sync such as the sampler's .tolist())."""

    def __init__(self, turns: int = 3):
        self.buffers: list[torch.Tensor | None] = [None] * turns
        self.turn = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.clone()
        buffer = self.buffers[self.turn]
        if buffer is None or buffer.numel() < t.numel() or buffer.dtype != t.dtype:
            buffer = torch.empty(max(2 * t.numel(), 64), dtype=t.dtype, pin_memory=True)
            self.buffers[self.turn] = buffer
        self.turn = (self.turn + 1) % len(self.buffers)
        out = buffer[:t.numel()].view(t.shape)
        out.copy_(t, non_blocking=True)
        return out
