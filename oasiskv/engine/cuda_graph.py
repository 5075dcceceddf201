"""CUDA graphs for decode-only steps: one captured forward pass (model, policy, logits) per batch shape
and policy key, replayed with the step's inputs copied into the captured tensors.

A decode step launches thousands of small kernels (selection, placement, counters per layer); replaying
them as one graph removes the Python and launch cost that otherwise bounds the step. What a capture
bakes in: every host int and flag the code read (batch size, table width, the policy's graph_key()),
and the identity of every input tensor. So:
  - the runner builds decode block tables at one fixed width (the longest request's blocks);
  - the policy names the per-step tensors its begin_step makes (STEP_TENSORS), copied in before replay;
  - a key seen for the first time runs eagerly (Triton compiles, the allocator warms up); the second
    time it is captured (capturing records, it does not run) and then replayed.
A policy may also leave work for after the step (capture_tail): a second graph, replayed on its own stream
right after the step's, that the host does not wait for (oasis: the last layers' prefetch, beside the
sampling, the next step's host work and the next step's first layers, which do not read what it writes).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from oasiskv.models.llama import CausalLM
from oasiskv.policies.base import AttentionMetadata, KVPolicy

META_TENSORS = ("slot_blocks", "slot_offsets", "decode_block_tables", "decode_seq_lens")


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # ids, positions and the metadata tensors the capture read
    step_tensors: dict[str, torch.Tensor]  # the policy's STEP_TENSORS as captured
    logits: torch.Tensor  # [num_decode, vocab] fp32, rewritten by each replay
    captured: list[torch.Tensor]  # hidden states of the capture layers, rewritten by each replay
    guesses: torch.Tensor | None = None  # the target's argmax on the draft rows, when asked for
    tail: object = None  # the policy's capture_tail(): work replayed after the step, not waited for
    packed: torch.Tensor | None = None  # the buffer that `inputs` are views of (meta.packed)
    step_buffer: torch.Tensor | None = None  # the buffer that some step tensors are views of (policy.step_buffer)
    in_step_buffer: frozenset[str] = frozenset()  # ... their names

    def load(self, ids, positions, meta: AttentionMetadata, policy: KVPolicy) -> None:
        # one copy per buffer: the same graph key gives the same shapes, so the same layout inside it
        self.packed.copy_(meta.packed, non_blocking=True)
        if self.in_step_buffer:
            self.step_buffer.copy_(policy.step_buffer, non_blocking=True)
        for name, t in self.step_tensors.items():
            if name not in self.in_step_buffer:
                t.copy_(getattr(policy, name), non_blocking=True)


class DecodeGraphs:
    def __init__(self, model: CausalLM, policy: KVPolicy, max_graphs: int = 32):
        self.model, self.policy, self.max_graphs = model, policy, max_graphs
        self.pool = torch.cuda.graph_pool_handle()  # shared: graphs never run at the same time
        self.graphs: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self.seen: set[tuple] = set()
        self.counts = {"cuda_graph_replays": 0, "cuda_graph_captures": 0}

    def release(self) -> None:
        """Frees every captured graph. A tensor-parallel rank must do this before leaving its group:
        NCCL's teardown hangs while graphs that captured its kernels exist (pytorch/pytorch#115388)."""
        torch.cuda.synchronize()
        for step in self.graphs.values():
            step.graph.reset()
            self.policy.reset_tail(step.tail)
        self.graphs.clear()
        self.seen.clear()

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, capture_layers: tuple[int, ...],
            guesses: bool = False, fill_inputs=None
            ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None, torch.Tensor] | None:
        """Runs the step's forward pass from a graph: (logits of the decode rows, captured states, with `guesses`
        the argmax of the draft rows' logits, the ids the model read), or None when it must run eagerly. The
        policy's begin_step(meta) has run. fill_inputs(ids, meta), if given, runs in the graph before the model
        (it may rewrite ids in place: the draft rows)."""
        policy_key = self.policy.graph_key()
        if policy_key is None:
            return None
        key = (len(ids), meta.num_decode, tuple(meta.decode_block_tables.shape), capture_layers, guesses,
               fill_inputs is not None) + policy_key
        step = self.graphs.get(key)
        if step is None and key not in self.seen:
            self.seen.add(key)
            return None
        # after what eager steps left on other streams
        self.policy.before_replay()
        if step is None:
            step = self.capture(key, ids, positions, meta, capture_layers, guesses, fill_inputs)
        else:
            self.graphs.move_to_end(key)
            step.load(ids, positions, meta, self.policy)
        step.graph.replay()
        self.policy.replay_tail(step.tail)
        self.counts["cuda_graph_replays"] += 1
        return step.logits, step.captured, step.guesses, step.inputs["ids"]

    def capture(self, key, ids, positions, meta, capture_layers, guesses: bool = False, fill_inputs=None
                ) -> CapturedStep:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.policy.begin_capture()
            if fill_inputs is not None:
                fill_inputs(ids, meta)
            hidden, captured = self.model(ids, positions, self.policy, capture_layers)
            # the draft rows follow the decode rows: one pass of the output head reads its weights once for both
            out = self.model.logits(hidden[: len(ids) if guesses else meta.num_decode])
            logits = out[: meta.num_decode]
            drafted = out[meta.num_decode:].argmax(-1) if guesses and meta.num_draft else None
            self.policy.end_capture()
        tail = self.policy.capture_tail()
        inputs = {"ids": ids, "positions": positions, **{name: getattr(meta, name) for name in META_TENSORS}}
        step_tensors = {name: getattr(self.policy, name) for name in self.policy.STEP_TENSORS}
        if not all(views_of(t, meta.packed) for t in inputs.values()):
            raise ValueError("a captured step's ids, positions and metadata must be views of meta.packed "
                             "(ModelRunner.prepare makes them so)")
        step_buffer = self.policy.step_buffer
        in_buffer = frozenset(n for n, t in step_tensors.items() if views_of(t, step_buffer))
        step = CapturedStep(graph, inputs, step_tensors, logits, captured, drafted, tail, meta.packed,
                            step_buffer if in_buffer else None, in_buffer)
        self.graphs[key] = step
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        self.counts["cuda_graph_captures"] += 1
        return step


def views_of(t: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    return buffer is not None and t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
