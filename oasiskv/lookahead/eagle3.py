"""EAGLE-3 draft source: the head's first pass (../shared/reference/eagle3.md §4) over every chunk
the target just ran, with a small KV cache of its own per request."""
from __future__ import annotations

import torch

from oasiskv.lookahead.base import DraftChunk, DraftSource
from oasiskv.models.eagle3 import Eagle3Head, load_eagle3
from oasiskv.models.llama import CausalLM
from oasiskv.policies.attention import sdpa


class RequestKV:
    """One request's draft K/V, positions 0 .. length - 1, in buffers grown by doubling."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v, self.length = k, v, k.shape[0]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[0]
        if end > self.k.shape[0]:
            self.k, self.v = grown(self.k, end), grown(self.v, end)
        self.k[self.length:end], self.v[self.length:end] = k, v
        self.length = end
        return self.k[:end], self.v[:end]


def grown(buffer: torch.Tensor, needed: int) -> torch.Tensor:
    out = buffer.new_empty(max(needed, 2 * buffer.shape[0]), *buffer.shape[1:])
    out[: buffer.shape[0]] = buffer
    return out


class CachedDraftAttention:
    """The attention backend of one propose() call: the flat batch is the chunks' slots in order;
    each chunk appends its K/V to its request's cache and attends causally over it."""

    def __init__(self, caches: dict[str, RequestKV], chunks: list[DraftChunk], scale: float):
        self.caches, self.chunks, self.scale = caches, chunks, scale

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, offset = torch.empty_like(q), 0
        for c in self.chunks:
            n, rows = len(c.token_ids), slice(offset, offset + len(c.token_ids))
            if c.start == 0:
                self.caches[c.request_id] = RequestKV(k[rows].clone(), v[rows].clone())
                keys, values = k[rows], v[rows]
            else:
                keys, values = self.caches[c.request_id].append(k[rows], v[rows])
            out[rows] = sdpa(q[rows], keys, values, self.scale, causal=True)  # slot p sees cached positions <= p
            offset += n
        return out


class Eagle3Draft(DraftSource):
    """Per chunk slot p the head reads (embed(token at p + 1), fc(target features at p)); the last slot
    of a sampled chunk holds the newly sampled token and its logits give the draft."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head):
        self.head = head
        self.capture_layers = head.capture_layers
        self.caches: dict[str, RequestKV] = {}

    @classmethod
    def from_dir(cls, directory: str, target: CausalLM, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> "Eagle3Draft":
        return cls(load_eagle3(directory, target, device, dtype))

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, chunks: list[DraftChunk], captured: list[torch.Tensor]) -> dict[str, int]:
        if not chunks:
            return {}
        self.check_continuity(chunks, captured)
        device = captured[0].device
        rows = torch.tensor([r for c in chunks for r in range(c.row_start, c.row_start + len(c.token_ids))],
                            device=device)
        features = torch.cat([h[rows] for h in captured], dim=-1)
        tokens = torch.tensor([t for c in chunks for t in c.next_token_ids], device=device)
        positions = torch.tensor([p for c in chunks for p in range(c.start, c.start + len(c.token_ids))],
                                 device=device)
        backend = CachedDraftAttention(self.caches, chunks, self.head.config.layer.head_dim ** -0.5)
        out = self.head(tokens, features.to(self.head.fc.weight.dtype), positions, backend)
        ends = torch.tensor(chunk_ends(chunks), device=device, dtype=torch.long)
        sampled = [c.request_id for c in chunks if c.sampled]
        if not sampled:
            return {}
        drafts = self.head.to_target_ids(self.head.logits(out[ends]).argmax(-1))
        return dict(zip(sampled, drafts.tolist()))

    def check_continuity(self, chunks: list[DraftChunk], captured: list[torch.Tensor]) -> None:
        if len(captured) != len(self.capture_layers):
            raise ValueError(f"eagle3 draft needs the hidden states of layers {self.capture_layers} "
                             f"(our output-of-layer ids), got {len(captured)} captured tensors")
        for c in chunks:
            held = self.caches[c.request_id].length if c.request_id in self.caches else 0
            if c.start != 0 and c.start != held:
                raise ValueError(f"eagle3 draft: request {c.request_id!r} sends a chunk at position {c.start} "
                                 f"but the draft cache holds {held} positions (a recompute must restart at 0)")


def chunk_ends(chunks: list[DraftChunk]) -> list[int]:
    """Flat-batch row of the last slot of every sampled chunk."""
    ends, offset = [], 0
    for c in chunks:
        offset += len(c.token_ids)
        if c.sampled:
            ends.append(offset - 1)
    return ends
