"""The K/V of one prompt's earlier prefill chunks, kept on the GPU while its prefill runs.

Retrieval and oasis write a prompt's K/V to the host store and keep none of it on the GPU. A prompt longer
than --max-num-batched-tokens is prefilled in chunks, and each later chunk attends to every earlier one:
read back from the host store, that is 3.5 GB over PCIe for a 16K qwen3-8b prompt in 4096-token chunks.
The keep holds those chunks in a buffer of its own (the host store still receives them, for decode), for
one prompt at a time: the scheduler leaves at most one prefill unfinished after a step (it continues the
oldest first and admits a new prompt only with budget to spare), so one buffer serves the usual stream.
A chunk it cannot serve (a second unfinished prefill, a prompt past its capacity) reads the host store."""
from __future__ import annotations

import torch

from oasiskv.policies.base import PrefillSpan

TAKE, EXTEND, LAST = "take", "extend", "last"  # how the keep serves a span (None: it does not)


class PrefillKeep:
    def __init__(self, layers: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        """capacity: tokens (0: no keep)."""
        self.capacity = capacity
        self.kv = torch.empty(layers, 2, capacity, kv_heads, head_dim, dtype=dtype, device=device) if capacity \
            else None
        self.holder: str | None = None  # the request whose chunks the buffer holds
        self.held = 0  # its tokens held, once the current step's chunk is written
        self.served = {"kept": 0, "host": 0}  # prefix tokens that later chunks read from each (in every layer)

    def plan(self, spans: list[PrefillSpan]) -> list[str | None]:
        """Per span of this step: TAKE (a first chunk that does not end its prompt: the keep stores it), EXTEND (the
        holder's next chunk: its prefix is here, and the chunk is stored too), LAST (the holder's chunk that ends the
        prompt or would pass the capacity: its prefix is here; the keep is free after this step) or None. A chunk is
        taken only if the keep was free as the step began: the holder's last chunk reads in this step."""
        free = self.holder is None
        ways = []
        for span in spans:
            way = self.way(span, free)
            ways.append(way)
            end = span.start_pos + span.token_end - span.token_start
            if way in (TAKE, EXTEND):
                self.holder, self.held, free = span.request_id, end, False
            elif way == LAST:
                self.holder, self.held = None, 0
            if span.start_pos:
                self.served["kept" if way else "host"] += span.start_pos
        return ways

    def way(self, span: PrefillSpan, free: bool) -> str | None:
        end = span.start_pos + span.token_end - span.token_start
        if span.start_pos == 0:
            if span.completes or end > self.capacity or not (free or span.request_id == self.holder):
                return None  # (the holder itself starting again: it was preempted, its old chunks are void)
            return TAKE
        if span.request_id != self.holder or span.start_pos != self.held:
            return None
        return LAST if span.completes or end > self.capacity else EXTEND

    def release(self, request_id: str) -> None:
        if request_id == self.holder:
            self.holder, self.held = None, 0

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer, 0, start:start + len(k)] = k
        self.kv[layer, 1, start:start + len(v)] = v

    def keys_and_values(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, way: str):
        """K and V of positions [0, start + len(k)): the prefix from the keep, then the chunk (stored already
        unless `way` is LAST)."""
        end = start + len(k)
        if way == LAST:
            return torch.cat([self.kv[layer, 0, :start], k]), torch.cat([self.kv[layer, 1, :start], v])
        return self.kv[layer, 0, :end], self.kv[layer, 1, :end]
