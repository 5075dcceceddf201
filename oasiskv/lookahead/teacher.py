"""The teacher draft: the token a reference run produced next. A perfect draft wherever this run
still follows the reference, so it measures the ceiling of any draft source: with it, what
agreement still misses comes from the draft's approximate context (it attends the current token's
selection), not from a wrong guess. For tests and analysis (scripts/agreement.py --drafts teacher);
not a serving option."""
from __future__ import annotations

from oasiskv.lookahead.base import DraftChunk, DraftSource


class TeacherDraft(DraftSource):
    name = "teacher"

    def __init__(self, prompt_len: dict[str, int], outputs: dict[str, list[int]]):
        """`prompt_len`: each request's prompt length; `outputs`: the reference run's output tokens."""
        self.prompt_len, self.outputs = prompt_len, outputs

    def propose(self, chunks: list[DraftChunk], captured) -> dict[str, int]:
        out = {}
        for c in chunks:
            if c.sampled:
                i = len(c.context) - self.prompt_len[c.request_id]  # index of the token after the new one
                reference = self.outputs[c.request_id]
                out[c.request_id] = reference[i] if i < len(reference) else c.context[-1]
        return out
