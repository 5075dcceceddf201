"""The GPU working set: per request and layer, the blocks resident in GPU slots.

Each running request owns a row of `slots_per_row` slots (the budget in blocks), the same slot ids in
every layer; what a slot holds differs per layer. Residency is kept as tensors on the device so a
whole decode batch is handled with a few vectorised ops per layer:
  slot_of[layer, row, logical block] -> global slot id or -1
  block_of[layer, row, i]             -> logical block in the row's i-th slot or -1
  last_used[layer, row, i]            -> step at which that slot was last selected (LRU eviction)
Nothing here waits on the device: updates that apply to only some entries of a [B, K] request send
the others to one spare column at the end of each table (never read), instead of filtering them
with a host-synchronising nonzero().
On CUDA (or when asked, under the Triton interpreter) a placement is one fused kernel launch
(kernels/ws_place.py); the torch code below stays as its reference and runs on the CPU.
"""
from __future__ import annotations

import torch

from oasiskv.kernels.ws_place import fused_place_runs, place_fused


class WorkingSet:
    def __init__(self, num_layers: int, rows: int, slots_per_row: int, max_blocks: int, device: torch.device,
                 fused: bool | None = None):
        """`fused`: place with the fused kernel (default: on CUDA); needs CUDA or the Triton interpreter."""
        self.fused = device.type == "cuda" if fused is None else fused
        if self.fused and not fused_place_runs(device):
            raise ValueError(f"the fused placement kernel needs CUDA or TRITON_INTERPRET=1, got {device}")
        self.rows, self.width, self.max_blocks = rows, slots_per_row, max_blocks
        self._slot_of = torch.full((num_layers, rows, max_blocks + 1), -1, dtype=torch.int32, device=device)
        self._block_of = torch.full((num_layers, rows, slots_per_row + 1), -1, dtype=torch.int32, device=device)
        self._last_used = torch.zeros((num_layers, rows, slots_per_row + 1), dtype=torch.int64, device=device)
        self.slot_of = self._slot_of[..., :max_blocks]  # views without the spare column
        self.block_of = self._block_of[..., :slots_per_row]
        self.last_used = self._last_used[..., :slots_per_row]
        self._free_rows = list(range(rows))
        self._row_of: dict[str, int] = {}
        self.base = torch.arange(rows, device=device, dtype=torch.int64)[:, None] * slots_per_row
        self.none = torch.full((), -1, dtype=torch.int32, device=device)  # a tensor: a scalar would be copied in

    # -- rows (ints) ----------------------------------------------------------------------------
    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def row(self, request_id: str) -> int:
        if request_id not in self._row_of:
            if not self._free_rows:
                raise RuntimeError("no free working-set row: the scheduler admitted too many requests")
            self._row_of[request_id] = self._free_rows.pop(0)
        return self._row_of[request_id]

    def release(self, request_id: str) -> None:
        r = self._row_of.pop(request_id, None)
        if r is None:
            return
        self.slot_of[:, r] = -1
        self.block_of[:, r] = -1
        self.last_used[:, r] = 0
        self._free_rows.append(r)

    # -- residency (tensors) --------------------------------------------------------------------
    def table(self, layer: int, rows: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """int32 [B, num_blocks]: slot of each logical block, -1 if not resident (a copy, not a view)."""
        return self.slot_of[layer, rows, :num_blocks]

    def place(self, layer: int, rows: torch.Tensor, wanted: torch.Tensor, protect: torch.Tensor,
              step: int | torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Makes the logical blocks `wanted` (int32 [B, K], -1 = none, distinct within a row) resident
        in each row's slots. Blocks in `protect` (bool [B, num_blocks]: the blocks that must stay, which
        include wanted) are never evicted; among the others, empty slots go first, then the least
        recently used. Returns (miss mask [B, K], global slot [B, K], -1 where nothing is wanted) for
        the blocks that were not resident: the caller fills those slots. Needs at most `width`
        protected blocks per row. `step` (an int or a 0-d device tensor) marks the wanted blocks as used.
        `layer` is an int, or a long tensor [B] giving each row's layer (rows of several layers at once)."""
        if self.fused:
            return place_fused(self._slot_of, self._block_of, self._last_used, layer, rows, wanted, protect, step)
        return self.place_reference(layer, rows, wanted, protect, step)

    def place_with_copies(self, layer, rows, wanted, protect, step, host_tables: torch.Tensor,
                          only: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """`place`, plus the copies that fill the misses where `only` (bool [B, K] or [B, 1]) allows:
        (miss, slots, src, dst) with src = host_tables[row, wanted] (int32 [B, num_blocks]: each row's
        host block of each logical block) and dst = slot, int32 [B, K], -1 where nothing is copied."""
        if self.fused:
            return place_fused(self._slot_of, self._block_of, self._last_used, layer, rows, wanted, protect, step,
                               host_tables=host_tables, only=only)
        miss, slots = self.place_reference(layer, rows, wanted, protect, step)
        copy = miss if only is None else miss & only
        src = torch.where(copy, host_tables.gather(1, wanted.clamp(min=0).long()), -1).to(torch.int32)
        return miss, slots, src, torch.where(copy, slots, -1).to(torch.int32)

    def place_reference(self, layer, rows, wanted, protect, step) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch twin of the fused kernel: `place` in ~25 vectorised ops."""
        valid = wanted >= 0
        w = torch.where(valid, wanted.long(), self.max_blocks)  # none -> the spare column (holds -1)
        slots = self._slot_of[layer, rows].gather(1, w)
        miss = valid & (slots < 0)
        held = self.block_of[layer, rows].long()  # [B, W]
        keep = (held >= 0) & (held < protect.shape[1]) & protect.gather(1, held.clamp(0, protect.shape[1] - 1))
        age = torch.where(held < 0, torch.full_like(held, -1), self.last_used[layer, rows])
        age = age.masked_fill(keep, torch.iinfo(torch.int64).max)
        victims = torch.argsort(age, dim=1, stable=True)  # [B, W]: best victim first
        rank = (torch.cumsum(miss.long(), dim=1) - 1).clamp(min=0)  # k-th miss of its row -> k-th victim
        victim = torch.where(miss, victims.gather(1, rank), self.width)  # slot index in the row; spare if no miss
        self._evict_and_assign(layer, rows, w, miss, victim)
        slots = torch.where(miss, (self.base[rows] + victim).to(slots.dtype), slots)
        self._touch(layer, rows, slots, valid, step)
        return miss, slots

    def _evict_and_assign(self, layer, rows, w, miss, victim) -> None:
        base, rows, layer = self.base[rows], rows[:, None], per_row(layer)
        old = self._block_of[layer, rows, victim].long()
        old = torch.where(miss & (old >= 0), old, self.max_blocks)
        self._slot_of[layer, rows, old] = self.none
        self._block_of[layer, rows, victim] = torch.where(miss, w, -1).to(torch.int32)
        new_slot = torch.where(miss, base + victim, -1).to(torch.int32)
        self._slot_of[layer, rows, torch.where(miss, w, self.max_blocks)] = new_slot

    def _touch(self, layer, rows, slots, valid, step) -> None:
        idx = torch.where(valid, slots.long() - self.base[rows], self.width)
        self._last_used[per_row(layer), rows[:, None], idx] = step


def per_row(layer):
    """An int layer as is; a tensor of one layer per row as a column, to index [rows, K] entries."""
    return layer[:, None] if isinstance(layer, torch.Tensor) else layer
