"""Bandwidth ceilings measured in the running process: what a plain copy achieves on this machine.

- memory copy (HBM on the GPU): device-to-device copy of one large tensor, read + write counted (so a
  kernel that only reads can pass it; shared/DESIGN.md measured 4216 GB/s on the lent H200);
- host to device: one contiguous copy from pinned host memory (55.3 GB/s there).
On the CPU both are a host memcpy, which keeps the code paths testable.
"""
from __future__ import annotations

import time

import torch


def timed_ms(fn, device: torch.device, reps: int = 10) -> float:
    """Median milliseconds of fn() after one warm-up call: triton's do_bench on the GPU (it flushes L2
    between calls), a synchronous wall-clock loop on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=max(reps * 10, 50), return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[len(times) // 2]


def memory_copy_gbps(device: torch.device, nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth, GB/s, counting the read and the write of every byte (1 GiB copied on
    the GPU, 64 MiB on the CPU)."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 64 << 20)
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def host_to_device_gbps(device: torch.device, nbytes: int = 256 << 20) -> float:
    """One contiguous copy from pinned host memory to the device, GB/s (a host copy on the CPU)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    ms = timed_ms(lambda: dst.copy_(src, non_blocking=True), device)
    return nbytes / ms / 1e6
