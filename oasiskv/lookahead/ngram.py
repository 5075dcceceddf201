"""Weight-free draft sources: prompt lookup (n-gram) and repeat (the current token itself)."""
from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from oasiskv.lookahead.base import DraftChunk, DraftSource


class RepeatDraft(DraftSource):
    """The temporal-locality baseline: the next query is predicted by the current token's. Drafted on the device
    (each decode row's draft row gets its token), so it runs with async scheduling too."""

    name = "repeat"
    on_device = True

    def fill(self, ids, meta) -> None:
        if meta.num_draft:  # the decode rows come first in ids, the draft rows last, in the same order
            ids[len(ids) - meta.num_draft:].copy_(ids[:meta.num_draft])


class NgramDraft(DraftSource):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from max_n
    down to min_n) and propose the token that followed it; with no occurrence, repeat the last token.
    Per request and n, a dict maps each n-gram (its tokens as little-endian int32 bytes) to the token
    after its latest occurrence. It is extended incrementally, so a step costs O(new tokens), not
    O(context); long extensions (a prompt) make their keys with numpy in one pass: tuples of Python
    ints cost about 90 ms for a 16K-token prompt, on the prefill's critical path."""

    name = "ngram"
    BULK = 64  # new tokens from which numpy makes the keys

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tables: dict[str, tuple[list[dict[bytes, int]], list[int]]] = {}

    def propose(self, chunks: list[DraftChunk], captured) -> dict[str, int]:
        return {c.request_id: self.lookup(c.request_id, c.context) for c in chunks if c.sampled}

    def release(self, request_id: str) -> None:
        self.tables.pop(request_id, None)

    def lookup(self, request_id: str, context: Sequence[int]) -> int:
        follower = self.match(request_id, context)
        return context[-1] if follower is None else follower

    def match(self, request_id: str, context: Sequence[int]) -> int | None:
        """The token after the latest earlier occurrence of the longest matching suffix (n from max_n down
        to min_n), or None when no suffix occurred before."""
        state = self.tables.get(request_id)
        if state is None:
            state = self.tables[request_id] = ([{} for _ in range(self.max_n + 1)], [0])
        tables, done = state
        if done[0] > len(context):  # a recompute restarted the request
            tables[:] = [{} for _ in range(self.max_n + 1)]
            done[0] = 0
        window = context[-self.max_n - 1:]  # the last max_n + 1 tokens: all a decode step reads
        if len(context) - done[0] == 1 and done[0]:  # one new token (a decode step): its n-grams only
            end = len(window) - 1
            for n in range(self.min_n, min(self.max_n, len(context) - 1) + 1):
                tables[n][key_of(window[end - n:end])] = window[end]
        else:
            self.extend(tables, context, max(done[0], 1))
        done[0] = len(context)
        tail = window[-self.max_n:]
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            follower = tables[n].get(key_of(tail[len(tail) - n:]))
            if follower is not None:
                return follower
        return None

    def extend(self, tables: list[dict[bytes, int]], context: Sequence[int], start: int) -> None:
        """Maps the n-gram ending before each position `end` in [start, len(context)) to context[end],
        later occurrences replacing earlier ones."""
        offset = max(start - self.max_n, 0)
        tokens = list(context[offset:])
        bulk = len(tokens) - (start - offset) >= self.BULK
        array = np.asarray(tokens, dtype="<i4") if bulk else None
        for n in range(self.min_n, self.max_n + 1):
            first = max(start, n) - offset  # the first `end` with a whole n-gram before it, in `tokens`
            if first >= len(tokens):
                continue
            if bulk:  # row j of the window: the n-gram ending before first + j
                grams = np.lib.stride_tricks.sliding_window_view(array[first - n: len(tokens) - 1], n)
                keys = np.ascontiguousarray(grams).view(f"V{4 * n}").ravel().tolist()
            else:
                keys = [key_of(tokens[end - n: end]) for end in range(first, len(tokens))]
            tables[n].update(zip(keys, tokens[first:]))


_PACKERS: dict[int, object] = {}


def key_of(gram: list[int]) -> bytes:
    pack = _PACKERS.get(len(gram))
    if pack is None:
        pack = _PACKERS[len(gram)] = struct.Struct(f"<{len(gram)}i").pack
    return pack(*gram)
