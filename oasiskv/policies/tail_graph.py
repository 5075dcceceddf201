"""What oasis's tail graph reads (policies/oasis.py, capture_tail). A replayed step defers the prediction of its
last layers to a second graph, which runs beside the next step's first layers; the next step's graph waits for it
(an external event) only before the first layer it predicts. So the tail must read nothing the next step may
rewrite before that wait: it reads copies, which the step's graph leaves in TailBuffers at its end."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PredictInputs:
    """What a group's prediction reads besides the layers' own state: the rows (long [B]), the drafts'
    logical blocks (int32 [B]), the host block tables (int32 [B, W + 1]) and the step number to stamp."""
    rows: torch.Tensor
    nblocks: torch.Tensor
    host_tables: torch.Tensor
    step: torch.Tensor


class TailBuffers:
    """Where a captured step leaves, at its end, what its tail graph reads: the PredictInputs and the deferred
    layers' draft scores. The next step rewrites the originals before it waits for the tail, and the graphs'
    shared pool may give their memory to another graph's temporaries; these buffers are outside every pool, and
    a step's graph writes them only after it has waited for the last tail. Sized for `rows` requests, tables
    `width` wide and `layers` deferred layers."""

    def __init__(self, rows: int, width: int, layers: int, device):
        self.rows = torch.zeros(rows, dtype=torch.int64, device=device)
        self.nblocks = torch.zeros(rows, dtype=torch.int32, device=device)
        self.tables = torch.zeros(rows * width, dtype=torch.int32, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.scores = torch.zeros(layers * rows * width, dtype=torch.float32, device=device)
        self.width, self.layers = width, layers

    def fill(self, inputs: PredictInputs, scores: list[torch.Tensor]) -> tuple[PredictInputs, torch.Tensor]:
        """Copies of `inputs` and of the draft scores (each fp32 [B, W]): (inputs, scores [layers, B, W])."""
        b, w = inputs.host_tables.shape
        if b > len(self.rows) or w > self.width or len(scores) > self.layers:
            raise ValueError(f"a tail of {len(scores)} layers x {b} rows x {w} blocks exceeds its buffers "
                             f"({self.layers} x {len(self.rows)} x {self.width})")
        out = PredictInputs(self.rows[:b], self.nblocks[:b], self.tables[:b * w].view(b, w), self.step)
        for dst, src in zip((out.rows, out.nblocks, out.host_tables, out.step),
                            (inputs.rows, inputs.nblocks, inputs.host_tables, inputs.step)):
            dst.copy_(src)
        kept = self.scores[:len(scores) * b * w].view(len(scores), b, w)
        torch.stack(scores, out=kept)
        return out, kept


@dataclass
class Tail:
    """A captured step's deferred prediction: its graph and the layers it predicts."""
    graph: torch.cuda.CUDAGraph
    layers: list[int]
