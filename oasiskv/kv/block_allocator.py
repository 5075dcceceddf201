"""Free-list allocator of KV block ids. Ints only; no tensors."""
from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Hands out block ids lowest-first from a FIFO free list; freed ids go to the back, so a freed
    block is reused only after every never-used block (helps catch stale-block bugs in tests)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"blocks {bad or ids} freed twice or never allocated")
        for i in ids:
            self._used.remove(i)
            self._free.append(i)

    @property
    def usage(self) -> float:
        return len(self._used) / self.num_blocks
