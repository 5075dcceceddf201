"""What every KV policy receives each step, and the interface it implements."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """Tokens [token_start, token_end) of the flat batch: a chunk of one request's prompt that
    starts at position start_pos; block_ids covers every token up to the chunk's end."""

    token_start: int
    token_end: int
    start_pos: int
    block_ids: torch.Tensor  # long [n_blocks]
    block_list: list[int]  # the same ids, on the host
    request_id: str = ""
    completes: bool = True  # the chunk ends the prompt (a later chunk of it follows when False)


@dataclass
class AttentionMetadata:
    """Tensors for one step, built by the runner. The first num_decode tokens of the flat batch
    are single-token chunks (decodes), then come the prefill spans, then (oasis mode) one draft
    token per decode, in decode order, at the position after its decode token. Draft tokens have
    no slot: their K/V is never kept."""

    slot_blocks: torch.Tensor  # long [T]: block receiving each token's K/V
    slot_offsets: torch.Tensor  # long [T]: position inside that block
    num_decode: int
    decode_block_tables: torch.Tensor  # int32 [num_decode, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [num_decode], the new token included
    decode_max_seq_len: int  # host copy of decode_seq_lens.max(): kernels size their grid without a sync
    prefills: list[PrefillSpan]
    decode_request_ids: list[str]
    num_draft: int = 0  # draft tokens at the end of the flat batch (num_decode of them, or none)
    decode_seq_lens_host: list[int] | None = None  # decode_seq_lens on the host, for decisions without a sync
    # the device buffer that the step's ids, positions and the tensors above are views of (engine/upload.py), when
    # the runner made them: a graph replay refreshes its captured inputs with one copy of it
    packed: torch.Tensor | None = None


def length_bucket(max_seq_len: int, step: int = 1024) -> int:
    """A decode attention length hint that changes only every `step` tokens: a CUDA graph captured at
    one hint serves every length up to it."""
    return -(-max(max_seq_len, 1) // step) * step


class KVPolicy:
    """One engine, several policies: each decides where K/V lives and what a query attends to.

    CUDA graphs (engine/cuda_graph.py) capture the forward pass of a decode-only step. A policy takes
    part by naming, in STEP_TENSORS, the device tensors its begin_step makes afresh each step (copied
    into the captured ones before a replay), and by returning from graph_key() what its captured
    code depends on (host flags baked in at capture), or None when this step must run eagerly."""

    name = "base"
    wants_drafts = False  # True: the runner adds a draft token beside each decode token
    STEP_TENSORS: tuple[str, ...] = ()
    # the device buffer that some STEP_TENSORS are views of (engine/upload.py), made afresh by begin_step: a replay
    # refreshes those with one copy of it
    step_buffer: torch.Tensor | None = None
    # tensor parallelism: this rank's block scores [B, blocks] -> the whole model's (distributed/scores.py)
    combine_scores = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def graph_key(self):
        """After begin_step: a hashable description of this step's captured code, or None (eager)."""
        return None

    def before_replay(self) -> None:
        """Before a graph replay: order it after work that eager steps left on other streams."""

    def begin_capture(self) -> None:
        """At the start of a captured forward: bring every stream the policy uses into the capture."""

    def end_capture(self) -> None:
        """At the end of a captured forward: join every stream the capture forked."""

    def capture_tail(self):
        """After a capture: work the policy left for after the step, captured as its own graph, or None. It is
        replayed after each replay of the step (replay_tail), and the policy orders what reads its results
        after it."""
        return None

    def replay_tail(self, tail) -> None:
        """Right after the step's replay: run the tail captured with it (None: nothing)."""

    def reset_tail(self, tail) -> None:
        """The step's graph is dropped: free its tail's too."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: drop whatever the policy keeps for it."""

    def stats(self) -> dict:
        return {}

    def request_stats(self, request_id: str) -> dict:
        """Counters of one finished request (and forget them)."""
        return {}
