"""--draft target: the target model drafts for itself. Each decode step already runs the draft token d_{t+1}
through the whole target beside x_t; the argmax of the target's logits on that row is its choice for the token
after d_{t+1}. When d_{t+1} came true (it is the token x_t's row sampled), that choice is the next draft: in
greedy decoding it is what the next step samples, unless the draft row's approximate context (it attends x_t's
selection, not its own) changed the argmax. Where the draft did not come true (and after a prefill, which runs
no draft row), prompt lookup proposes, as --draft ngram does. The extra cost is the draft rows' logits: the
output head's weights are read once for both rows."""
from __future__ import annotations

import torch

from oasiskv.lookahead.base import DraftChunk, DraftSource
from oasiskv.lookahead.ngram import NgramDraft


class TargetDraft(DraftSource):
    name = "target"
    wants_target_guess = True

    def __init__(self):
        self.ngram = NgramDraft()

    def propose(self, chunks: list[DraftChunk], captured: list[torch.Tensor]) -> dict[str, int]:
        drafts = {}
        for c in chunks:
            if not c.sampled:
                continue
            fallback = self.ngram.lookup(c.request_id, c.context)  # every step: its tables follow the request
            came_true = c.ran_draft is not None and c.ran_draft == c.context[-1]
            drafts[c.request_id] = c.target_guess if came_true and c.target_guess is not None else fallback
        return drafts

    def release(self, request_id: str) -> None:
        self.ngram.release(request_id)
