"""The decode instance's own host memory, one chunk (one layer of one block) at a time.

It is a HostStore tensor [layers, entries, 2, block_size, Hkv, D] whose entries, per layer, are handed
to (layer, logical block) pairs of two kinds:
  owned   a tail block the decode filled and spilled: the only copy, kept until the request ends;
  cached  a remote block read for a fetch: at most `cache_blocks` per request and layer are kept
          afterwards (least recently used go first), so a block evicted from the GPU working set and
          selected again is often read locally instead of remotely.
A request's local host memory is its owned plus cached entries; `peak` remembers the most it held."""
from __future__ import annotations

from collections import OrderedDict, defaultdict, deque

from oasiskv.kv.host_store import HostStore


class LocalChunks:
    def __init__(self, store: HostStore, cache_blocks: int):
        self.store, self.cache_blocks = store, cache_blocks
        layers, entries = store.kv.shape[:2]
        self.free = [deque(range(entries)) for _ in range(layers)]
        self.owned: dict[tuple[int, int], int] = {}  # (layer, block) -> entry
        self.owned_by: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.cached: dict[str, list[OrderedDict[int, int]]] = {}  # request -> per layer: block -> entry
        self.grown: set[tuple[str, int]] = set()  # (request, layer) caches that may be over their bound
        self.held: dict[str, int] = defaultdict(int)  # entries per request
        self.peak: dict[str, int] = defaultdict(int)

    @property
    def chunk_bytes(self) -> int:
        return self.store.chunk_bytes

    def address(self, layer: int, entry: int) -> int:
        kv = self.store.kv
        return kv.data_ptr() + (layer * kv.stride(0) + entry * kv.stride(1)) * kv.element_size()

    @property
    def entries_used(self) -> int:
        return sum(self.held.values())

    # -- entries ------------------------------------------------------------------------------------
    def _take(self, request_id: str, layer: int) -> int:
        if not self.free[layer]:
            raise MemoryError("the decode instance's local host KV memory is full: raise --local-kv-blocks "
                              "or lower --remote-cache-blocks")
        self.held[request_id] += 1
        self.peak[request_id] = max(self.peak[request_id], self.held[request_id])
        return self.free[layer].popleft()

    def _give(self, request_id: str, layer: int, entry: int) -> None:
        self.free[layer].append(entry)
        self.held[request_id] -= 1

    def _layers(self, request_id: str) -> list[OrderedDict[int, int]]:
        if request_id not in self.cached:
            self.cached[request_id] = [OrderedDict() for _ in self.free]
        return self.cached[request_id]

    # -- owned: spilled tails ---------------------------------------------------------------------------
    def own(self, request_id: str, layer: int, block: int) -> int:
        """The entry a filled tail block is written to; a cached remote copy of it (the prompt's
        partial last block) is dropped: the local one is newer."""
        key = (layer, block)
        if key not in self.owned:
            stale = self._layers(request_id)[layer].pop(block, None)
            if stale is not None:
                self._give(request_id, layer, stale)
            self.owned[key] = self._take(request_id, layer)
            self.owned_by[request_id].append(key)
        return self.owned[key]

    def owned_entry(self, layer: int, block: int) -> int | None:
        return self.owned.get((layer, block))

    # -- cached: remote blocks --------------------------------------------------------------------------
    def cached_entry(self, request_id: str, layer: int, block: int) -> int | None:
        cache = self._layers(request_id)[layer]
        entry = cache.get(block)
        if entry is not None:
            cache.move_to_end(block)
        return entry

    def add_cached(self, request_id: str, layer: int, block: int) -> int:
        entry = self._take(request_id, layer)
        self._layers(request_id)[layer][block] = entry
        self.grown.add((request_id, layer))
        return entry

    def trim(self) -> None:
        """Back to at most cache_blocks cached entries per request and layer (call once the copies that
        read them are done)."""
        for rid, layer in self.grown:
            cache = self.cached.get(rid, [{}] * len(self.free))[layer]
            while len(cache) > self.cache_blocks:
                self._give(rid, layer, cache.popitem(last=False)[1])
        self.grown.clear()

    def release(self, request_id: str) -> int:
        """Frees every entry of the request; returns the most entries it held at once."""
        for layer, cache in enumerate(self.cached.pop(request_id, [])):
            for entry in cache.values():
                self._give(request_id, layer, entry)
        for key in self.owned_by.pop(request_id, []):
            self._give(request_id, key[0], self.owned.pop(key))
        self.held.pop(request_id, None)
        return self.peak.pop(request_id, 0)
