"""--draft target: the target model drafts for itself. Each decode step already runs the draft token d_{t+1} through
the whole target beside x_t; the argmax of the target's logits on that row is its choice for the token after
d_{t+1}. When d_{t+1} came true (it is the token x_t's row sampled), that choice is the next draft: in greedy
decoding it is what the next step samples, unless the draft row's approximate context (it attends x_t's selection,
not its own) changed the argmax. Where the draft did not come true, and after a prefill (which runs no draft row),
a fallback source proposes: prompt lookup (--draft target) or the EAGLE-3 head (--draft target+eagle3). The extra
cost is the draft rows' logits: the output head's weights are read once for both rows."""
from __future__ import annotations

import torch

from oasiskv.lookahead.base import DraftChunk, DraftSource
from oasiskv.lookahead.ngram import NgramDraft


class TargetDraft(DraftSource):
    wants_target_guess = True

    def __init__(self, fallback: DraftSource | None = None):
        self.fallback = fallback or NgramDraft()
        self.name = "target" if fallback is None else f"target+{fallback.name}"
        self.capture_layers = self.fallback.capture_layers  # the runner captures these for a head

    def propose(self, chunks: list[DraftChunk], captured: list[torch.Tensor]) -> dict[str, int]:
        drafts = self.fallback.propose(chunks, captured)  # every step: its state (tables, a head's KV) follows
        for c in chunks:
            came_true = c.sampled and c.ran_draft is not None and c.ran_draft == c.context[-1]
            if came_true and c.target_guess is not None:
                drafts[c.request_id] = c.target_guess
        return drafts

    def release(self, request_id: str) -> None:
        self.fallback.release(request_id)
