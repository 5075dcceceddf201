"""Range checks of the ids and lengths a launcher hands its Triton kernel. A kernel trusts them: an id out of range
makes it read or write outside its tensors (a segfault under the interpreter, garbage or a fault on the GPU). On CPU
tensors the check costs nothing next to the interpreter, so launchers run it there by default; on CUDA it would cost
a device->host sync every call, so it runs only when a caller asks (check_values=True)."""
from __future__ import annotations

import os

import torch


def checks_values(check_values: bool | None, device: torch.device) -> bool:
    """Whether a launcher checks values: as asked, else on every device but CUDA."""
    return check_values if check_values is not None else device.type != "cuda"


def interpreted() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1), so CPU tensors can launch them."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_range(name: str, values: torch.Tensor, low: int, high: int) -> None:
    """Every entry of `values` in [low, high), else a ValueError naming the range found."""
    if values.numel() == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < low or hi >= high:
        raise ValueError(f"{name} must be in [{low}, {high}), got values in [{lo}, {hi}]")


def check_table_reads(name: str, tables: torch.Tensor, logical: torch.Tensor, num_slots: int) -> None:
    """The table entries at the logical block ids a kernel reads (tables [R, W], logical [R, K], -1 = none): each id
    within the table's width and each entry it reaches within [0, num_slots)."""
    used = logical >= 0
    check_range(f"block ids read from {name}", logical[used], 0, tables.shape[1])
    rows = torch.arange(len(tables), device=tables.device)[:, None].expand_as(logical)
    check_range(f"{name} entries of the blocks read", tables[rows[used], logical[used].long()], 0, num_slots)
