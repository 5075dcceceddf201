"""Facts about the device that launchers size their grids from."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 8 stands in for the CPU (interpreter runs)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
