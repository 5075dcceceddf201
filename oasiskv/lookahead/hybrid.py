"""Hybrid draft source (--draft ngram+eagle3): prompt lookup where it is reliable, the EAGLE-3 head
elsewhere. A suffix of at least min_n tokens that occurred earlier in the context proposes the token
that followed it (as NgramDraft does); without such a match the head's token is proposed instead of
NgramDraft's weak unigram / repeat fallback."""
from __future__ import annotations

import torch

from oasiskv.lookahead.base import DraftChunk, DraftSource
from oasiskv.lookahead.eagle3 import Eagle3Draft
from oasiskv.lookahead.ngram import NgramDraft


class NgramEagle3Draft(DraftSource):
    name = "ngram+eagle3"

    def __init__(self, head: Eagle3Draft, min_n: int = 2, max_n: int = 3):
        self.head = head
        self.ngram = NgramDraft(max_n=max_n, min_n=min_n)
        self.capture_layers = head.capture_layers  # the runner captures these for the head

    def propose(self, chunks: list[DraftChunk], captured: list[torch.Tensor]) -> dict[str, int]:
        drafts = self.head.propose(chunks, captured)  # every step: the head's own KV cache follows each request
        for c in chunks:
            if c.sampled:
                follower = self.ngram.match(c.request_id, c.context)
                if follower is not None:
                    drafts[c.request_id] = follower
        return drafts

    def release(self, request_id: str) -> None:
        self.head.release(request_id)
        self.ngram.release(request_id)
