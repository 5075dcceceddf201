"""Oasis's prediction and prefetch (step 4 of oasis.py's docstring): the draft's selection predicts the next step's
blocks, and its non-resident ones are gathered up to each layer's fetch cap. A mixin of OasisPolicy, kept apart so the
policy's file holds its step; the methods use OasisPolicy's state."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from oasiskv.kernels.block_topk import predict_prefetch, predict_prefetch_reference
from oasiskv.policies.tail_graph import PredictInputs


class OasisPrefetch:
    def predict_and_prefetch(self, rows) -> None:
        """The draft's selection is the prediction for the next step; its missing blocks are gathered,
        best first, up to the fetch cap. Done for the waiting group of layers at once. On the GPU all
        of it (scoring, placement, copies, their counters) runs on the copy stream, beside the next
        layers' compute: nothing else touches those layers' working sets or slots until the next
        step's wait_for_prefetch (or the graph's end)."""
        group, self.waiting = self.waiting, []
        layers, scores = [layer for layer, _ in group], [s for _, s in group]
        if not self.cuda:
            with self.timer("prefetch"):
                self.predict(layers, scores, self.predict_inputs(rows), lane=1)
            return
        side, capturing = self.copy_stream, torch.cuda.is_current_stream_capturing()
        side.wait_stream(torch.cuda.current_stream())  # the draft's scores, and readers of slots it evicts
        self.keep_alive((*scores, rows.draft_nblocks, self.rows, self.host_tables), side)
        with torch.cuda.stream(side):
            start = None if capturing else self.clock.mark(side)  # no timing events in a graph
            self.predict(layers, scores, self.predict_inputs(rows), lane=1)
            if start is not None:
                done = self.clock.close("prefetch", start, side)
                for layer in layers:
                    self.prefetched[layer] = done

    def predict_inputs(self, rows) -> PredictInputs:
        """This step's. The step number: eagerly the copy stream's, which the next step's begin_step rewrites
        after this step's copy-stream work; in a graph the compute stream's, which it rewrites after the graph
        (the copy-stream branches joined at its end, and the tail reads a copy)."""
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        return PredictInputs(self.rows, rows.draft_nblocks, self.host_tables,
                             self.step_tensor if capturing else self.copy_step)

    def predict(self, layers: list[int], draft_scores: list[torch.Tensor], inputs: PredictInputs, lane: int) -> None:
        """On the current stream, for a group's sparse `layers` at once (rows = (layer, request) pairs):
        prediction, placement, copies, and their counters (in `lane`, the stream's). `draft_scores`: per layer
        the drafts' block scores, fp32 [B, W + 1], all ranks' heads (score_now_and_draft)."""
        g, b = len(layers), len(inputs.nblocks)
        # fresh contiguous lists: with one request, reshape(-1) of an expanded row list is a stride-0 view,
        # which kernels indexing rows[i] read past
        layer_of = self.layer_id_column(layers).expand(g, b).reshape(-1)
        rows = inputs.rows.repeat(g)
        host_tables = inputs.host_tables.repeat(g, 1)
        predicted, fetch = self.plan_prefetch(layers, torch.cat(draft_scores), inputs.nblocks, layer_of, rows)
        self.predicted[layer_of, rows] = predicted  # also what placement must keep
        fetched, _, copies = self.place(layer_of, fetch, predicted, lane=lane, rows=rows,
                                        host_tables=host_tables, step=inputs.step)
        self.copy_from_host(copies, programs=self.PREFETCH_PROGRAMS or None)
        self.count("prefetched_blocks", fetched, lane=lane)
        self.flush_counts(layer_of, lane=lane, rows=rows)
        most = self.most_prefetched[lane]
        torch.maximum(most, fetched.sum(1).max(), out=most)

    def layer_id_column(self, layers: list[int]) -> torch.Tensor:
        """The ids of `layers` on the device, [g, 1], without copying a list to it (a graph holds no such copy).
        A group skips the layers whose budget covers the context (--layer-weights), which leaves gaps."""
        if layers[-1] - layers[0] + 1 == len(layers):
            return self.layer_ids[layers[0]: layers[-1] + 1, None]
        return torch.cat([self.layer_ids[layer: layer + 1, None] for layer in layers])

    def plan_prefetch(self, layers: list[int], scores: torch.Tensor, nblocks: torch.Tensor, layer_of: torch.Tensor,
                      rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted, fetch) of predict_prefetch for the group's rows: one launch per run of layers with the
        same budget (one run unless --layer-weights gives the group's layers different budgets)."""
        plan = predict_prefetch if self.cuda else predict_prefetch_reference  # one kernel on the GPU
        b, start, predicted, fetch = len(nblocks), 0, [], []
        for budget, run in itertools.groupby(layers, key=self.layer_budget_blocks.__getitem__):
            n = len(list(run))
            part = slice(start * b, (start + n) * b)
            # with --shortlist the prediction is the draft's list
            _, p, f = plan(scores[part], nblocks.repeat(n), self.cfg.shortlist_blocks(budget), self.cfg.sink_blocks,
                           self.cfg.local_blocks,
                           self.fetch_cap_of[budget], self.ws.max_blocks + 1, slot_of=self.ws.slot_of,
                           layer_of=layer_of[part], rows=rows[part])
            predicted.append(p)
            fetch.append(f)
            start += n
        if len(fetch) == 1:
            return predicted[0], fetch[0]
        width = max(f.shape[1] for f in fetch)  # lists of -1-padded block ids; the masks all span the working set
        return torch.cat(predicted), torch.cat([F.pad(f, (0, width - f.shape[1]), value=-1) for f in fetch])
