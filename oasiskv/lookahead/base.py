"""What a draft source sees after each step, and what it returns.

A draft source guesses, for every request that just sampled a token, the token after it. The guess
(the draft token) runs beside the request's next decode step only to predict which KV blocks the step
after will need; it is never emitted."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class DraftChunk:
    """One request's chunk of the step that just ran, as the draft source sees it."""

    request_id: str
    start: int  # position of the chunk's first token in the request
    token_ids: list[int]  # the chunk's tokens, positions start .. start + len - 1
    next_token_ids: list[int]  # token at position p + 1 for each chunk position p (last: the sampled one if sampled)
    row_start: int  # the chunk's rows in the captured hidden states: [row_start, row_start + len(token_ids))
    sampled: bool  # the chunk sampled a token: propose a draft for the next step
    context: Sequence[int]  # sampled chunks: every token of the request so far, the new one included (a view
    #                         that is not copied: read what you need); else []
    ran_draft: int | None = None  # the draft token that ran beside this chunk (decode chunks), else None
    target_guess: int | None = None  # with wants_target_guess: the target's argmax on that draft's row, i.e. its
    #                                  choice for the token after the draft, had the draft been the sampled token


class DraftSource:
    """Base of the draft sources (ngram, repeat, eagle3, ngram+eagle3)."""

    name = "base"
    # layers whose output hidden states (residual stream, before the final norm) the runner captures
    # for this source, as output-of-layer ids: id i is the input of layer i + 1 (HF hidden_states[i + 1])
    capture_layers: tuple[int, ...] = ()
    # True: the runner computes the target's logits on the draft rows too and passes their argmax (target_guess)
    wants_target_guess = False
    # True: the source drafts inside each step on the device (fill(ids, meta), before the model; the runner's
    # fill_inputs), not after it on the host (propose)
    on_device = False

    def propose(self, chunks: list[DraftChunk], captured: list[torch.Tensor]) -> dict[str, int]:
        """Draft token for every chunk with sampled=True, keyed by request id. `captured` holds one
        [T, H] tensor per capture layer, rows aligned with the chunks' row_start."""
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: forget its state (a recompute starts at position 0)."""

    def write_prompt(self, block_ids: list[int], tokens: list[int]) -> None:
        """A source that drafts on the device: a prompt that no step computed here (its K/V came from a prefill
        instance), for the sources that read the context from the device."""
