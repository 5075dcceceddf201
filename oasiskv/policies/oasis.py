"""Oasis: lookahead prefetch. Each decode token x_t runs with a draft token d_{t+1} beside it (the
last num_draft rows of the batch). Per layer (see shared/DESIGN.md, "A decode step in oasis mode"):

  1. wait for the blocks prefetched for this layer during the previous step;
  2. append x_t's K/V to its tail block; select with x_t's query; blocks of the selection that are
     not resident are misses: left out (miss policy "skip") or fetched now ("fetch"). A request's
     first decode step has no prediction yet: its misses are always fetched (cold start);
  3. x_t attends to its selection, the draft to the same blocks plus x_t and itself (its own K/V goes
     where x_{t+1}'s will, and is overwritten by it next step);
  4. the draft's query selects too: that selection is the prediction for the next step (its block
     scores come from the same launch as x_t's, which reads the layer's summaries once). Its
     non-resident blocks, highest score first and at most `fetch_cap x budget` tokens of them, are
     gathered from the host store, evicting blocks outside the prediction. This runs for groups of
     PREDICT_GROUP layers at once; on the GPU on the copy stream, beside the next layers' compute. In a
     replayed step the groups of the last TAIL_LAYERS layers are a second graph (capture_tail), replayed
     after the step's on a stream of its own: beside the sampling, the host's work and the next step's first
     layers. The next step's graph waits for it only before the first layer it predicted (an external event).

The working-set row holds budget + 1 blocks: a full selection plus the block a draft token opens.
On the CPU the same steps run synchronously."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oasiskv.kernels.draft_kv import DraftWrite, write_draft_kv, write_draft_kv_reference
from oasiskv.kernels.miss_fill import FillCounters, fill_misses, fill_misses_reference
from oasiskv.kernels.residency import COUNTERS as RESIDENCY_COUNTERS
from oasiskv.kernels.residency import resident_selection, resident_selection_reference
from oasiskv.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from oasiskv.kernels.sparse_decode import sparse_decode_attention_padded, sparse_decode_padded_reference
from oasiskv.policies.lookahead_stats import lookahead_stats
from oasiskv.policies.oasis_prefetch import OasisPrefetch
from oasiskv.policies.oasis_shortlist import OasisShortlist
from oasiskv.policies.tail_graph import PredictInputs, Tail, TailBuffers
from oasiskv.policies.timers import EventClock
from oasiskv.policies.tiered import TieredPolicy, TieredRows


@dataclass
class DraftRows(TieredRows):
    """TieredRows plus the draft token's: it sits at position seq_len, one past x_t."""
    draft_nblocks: torch.Tensor  # int32 [B]: logical blocks it spans
    both_nblocks: torch.Tensor   # int32 [2, B]: x_t's logical blocks, then the drafts'
    both_lens: torch.Tensor      # int32 [2B]: x_t's lengths, then the drafts'
    opens: torch.Tensor          # bool [B]: the draft starts a new block
    opened: torch.Tensor         # int32 [B]: that block, or -1
    draft_offset: torch.Tensor   # long [B]: the draft's offset in its block


class OasisPolicy(OasisShortlist, OasisPrefetch, TieredPolicy):
    name = "oasis"
    wants_drafts = True
    # misses_to_fill: under "fill", the misses no fetch served, whose places it gives resident blocks
    COUNTERS = TieredPolicy.COUNTERS + ("prefetched_blocks", "cold_fetched_blocks", "miss_fetched_blocks",
                                        "misses_to_fill", "filled_blocks", "agree_hits", "agree_total")
    STEP_TENSORS = TieredPolicy.STEP_TENSORS + ("cold", "fresh")
    LANES = 3  # compute, copy stream, tail stream
    TAIL_LANE = 2
    PREDICT_GROUP = 6  # consecutive layers predicted together: fewer, larger kernels on the copy stream
    # GPU programs that copy the prefetched blocks (0: one per block). A copy waits on PCIe, not on the
    # SMs: a few programs keep the link busy and leave the other SMs to the compute stream. H200, qwen3-8b,
    # 43 x 16K: 4, 8, 16, 32 programs gave 20.1, 14.8, 13.85, 13.9 ms a step (docs/BENCHMARKS.md, 2026-12-03).
    PREFETCH_PROGRAMS = 16
    # in a captured step, the prediction of the groups that end in the last TAIL_LAYERS layers runs after the
    # step (capture_tail), so the step's graph need not wait for their copies (0: none deferred). H200, qwen3-8b
    # b16 x 16K, async scheduling: 6 and 12 layers gave the same step (9.43-9.49 and 9.53 ms; docs/BENCHMARKS.md,
    # sixteenth session)
    TAIL_LAYERS = PREDICT_GROUP

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        layers, rows = self.pool.kv.shape[0], self.ws.rows
        # per layer budget (--layer-weights): at least a block, as --fetch-cap x --kv-budget must be
        self.fetch_cap_of = {blocks: max(1, self.cfg.fetch_blocks(self.block_size, blocks * self.block_size))
                             for blocks in set(self.layer_budget_blocks)}
        self.fetch_cap_blocks = max(self.fetch_cap_of.values())  # (the stats' kv_fetch_cap_blocks: the largest)
        # every miss fetched: the "fetch" policy, and a cap of 1 (fetch-all: nothing x_t selects is left out, so with
        # a perfect draft oasis gives quest's tokens; a perfect draft token alone leaves misses, as the draft row's
        # query is computed over x_t's selection, not its own)
        self.fetch_every_miss = self.cfg.miss_policy == "fetch" or self.cfg.fetch_cap >= 1
        self.predicted = torch.zeros(layers, rows, self.ws.max_blocks + 1, dtype=torch.bool, device=self.pool.kv.device)
        self.most_prefetched = torch.zeros(self.LANES, dtype=torch.int64, device=self.pool.kv.device)
        self.predicted_at: dict[int, int] = {}  # row -> step of its latest prediction
        # layers sparse in the last step, and those sparse now that were not: a dense layer predicts nothing, so a
        # layer's first sparse step has no prediction to judge agreement by
        self.sparse_layers: frozenset[int] = frozenset()
        self.turned_sparse: frozenset[int] = frozenset()
        self.prefetched: list[torch.cuda.Event | None] = [None] * layers
        self.clock = EventClock() if self.cuda else None
        self.decode_steps = 0
        self.layer_ids = torch.arange(layers, device=self.pool.kv.device)
        self.waiting: list[tuple[int, torch.Tensor]] = []  # (layer, draft block scores) not yet predicted from
        self.group_ends = self.prediction_group_ends(layers)
        # in a capture, the groups from this layer on are predicted in the tail graph (capture_tail): after
        # the step, beside the sampling, the host's work and the next step, rather than before the step's graph ends
        self.tail_from = max(layers - self.TAIL_LAYERS, self.cfg.dense_layers) if self.TAIL_LAYERS else layers
        self.first_deferred = self.first_layer_of_group_ending_at(self.tail_from)
        self.deferring = False
        self.deferred: list[list[tuple[int, torch.Tensor]]] = []
        self.tail_inputs: tuple[PredictInputs, torch.Tensor] | None = None  # in tail_buffers
        if self.cuda:  # the clock of the copy stream's placements, written on that stream (begin_step)
            self.copy_step = torch.zeros((), dtype=torch.int64, device=self.pool.kv.device)
            self.tail_stream = torch.cuda.Stream(self.pool.kv.device)
            # recorded at each tail graph's end, waited for inside the next step's graph: external event nodes
            self.tail_done = torch.cuda.Event(external=True)
            self.tail_done.record(self.tail_stream)  # created now: waiting on an event never recorded captures nothing
            self.tail_pool = None  # the tail graphs' memory: never the steps', which run beside them
        self.tail_buffers = TailBuffers(rows, self.ws.max_blocks + 1, layers - self.first_deferred, self.pool.kv.device)
        names = {"selected": "selected_blocks"}  # kernels/residency.py's counters -> ours
        self.residency_counters = torch.tensor([self.counter_index[names.get(c, c)] for c in RESIDENCY_COUNTERS],
                                               device=self.pool.kv.device)

    def release(self, request_id: str) -> None:
        self.wait_for_copies()  # a tail graph may still be predicting for this row
        if request_id in self.ws._row_of:
            row = self.ws.row(request_id)
            self.predicted[:, row] = False
            self.predicted_at.pop(row, None)
        super().release(request_id)

    def begin_step(self, meta) -> None:
        super().begin_step(meta)
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_step.fill_(self.step_index)
        rows, step = self.step_rows, self.step_index
        self.any_cold = bool(self.cold_host.any())
        # after its first decode step a request's tail is always resident: the same block as last
        # step's, or the one last step's draft opened (both protected from eviction)
        self.tails_resident = not self.any_cold
        seq_lens = meta.decode_seq_lens_host
        self.any_opens = any(n % self.block_size == 0 for n in seq_lens)  # a draft starts a new block
        self.predicted_at.update((r, step) for r in rows)
        self.decode_steps += bool(rows)
        sparse = frozenset(layer for layer in range(self.pool.kv.shape[0]) if not self.is_dense_layer(layer))
        self.turned_sparse, self.sparse_layers = sparse - self.sparse_layers, sparse
        self.waiting = []
        # what a capture leaves for capture_tail; cleared here too, in case the last capture failed before it ran
        self.deferring, self.deferred, self.tail_inputs = False, [], None
        if self.clock:
            self.clock.collect()

    def step_arrays(self, meta) -> dict[str, np.ndarray]:
        """Also which rows are cold (no prediction yet) and fresh (predicted last step); before begin_step
        records this step's predictions."""
        arrays = super().step_arrays(meta)
        self.step_rows = rows = arrays["rows"].tolist()
        step = self.step_index
        self.cold_host = np.fromiter((r not in self.predicted_at for r in rows), dtype=bool, count=len(rows))
        fresh = np.fromiter((self.predicted_at.get(r) == step - 1 for r in rows), dtype=bool, count=len(rows))
        return {**arrays, "cold": self.cold_host, "fresh": fresh}

    def prediction_group_ends(self, layers: int) -> frozenset[int]:
        """The layers after which the waiting group is predicted: every PREDICT_GROUP sparse layers,
        and the last layer on its own, so that in an eager step the prediction left after the last layer
        is one layer's, beside the final norm and the logits (a captured step defers the last groups to its
        tail graph instead: capture_tail)."""
        first = self.cfg.dense_layers
        ends = {layer for layer in range(first, layers) if (layer - first + 1) % self.PREDICT_GROUP == 0}
        ends |= {layers - 2, layers - 1}
        return frozenset(e for e in ends if e >= first)

    def first_layer_of_group_ending_at(self, layer: int) -> int:
        """The first layer of the first group whose prediction is made at `layer` or after: a group is deferred
        whole, so the tail graph predicts from there on (the number of layers when `layer` is past the last)."""
        earlier = [e for e in self.group_ends if e < layer]
        return max(earlier) + 1 if earlier else self.cfg.dense_layers

    def graph_key(self):
        """Captured: steps without a cold request (its first decode fetches every miss) and without a layer's first
        sparse step (which judges no agreement); whether a draft opens a block is baked in."""
        key = super().graph_key()
        return None if key is None or self.any_cold or self.turned_sparse else key + (self.any_opens,)

    def begin_capture(self) -> None:
        super().begin_capture()
        self.deferring = True

    def end_capture(self) -> None:
        """In the step's graph, at its end: what the tail graph reads, copied to its buffers."""
        if self.deferred:
            scores = [s for group in self.deferred for _, s in group]
            self.tail_inputs = self.tail_buffers.fill(self.predict_inputs(self.rows_now), scores)
        super().end_capture()

    def capture_tail(self) -> Tail | None:
        """The deferred groups' prediction, captured on the tail stream, or None."""
        self.deferring = False
        groups, self.deferred = self.deferred, []
        kept, self.tail_inputs = self.tail_inputs, None
        if not groups:
            return None
        if self.tail_pool is None:
            self.tail_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.tail_pool, stream=self.tail_stream):
            self.predict_deferred(groups, *kept)
            self.tail_done.record()
        self.capture_refs.clear()
        return Tail(graph, [layer for group in groups for layer, _ in group])

    def predict_deferred(self, groups: list[list[tuple[int, torch.Tensor]]], inputs: PredictInputs | None = None,
                         scores: torch.Tensor | None = None) -> None:
        """The prediction of groups whose layers were computed, but not predicted from, this step, on the current
        stream. `inputs` and `scores` (one [B, W] per layer of the groups): default this step's and the groups'."""
        inputs = inputs or self.predict_inputs(self.rows_now)
        first = 0
        for group in groups:
            mine = [s for _, s in group] if scores is None else list(scores[first: first + len(group)])
            self.predict([layer for layer, _ in group], mine, inputs, self.TAIL_LANE)
            first += len(group)

    def replay_tail(self, tail: Tail | None) -> None:
        """The next replay waits for it inside its graph; an eager step, per layer (wait_for_prefetch)."""
        if tail is None:
            return
        self.tail_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.tail_stream):
            tail.graph.replay()
        done = self.tail_stream.record_event()
        for layer in tail.layers:
            self.prefetched[layer] = done

    def reset_tail(self, tail: Tail | None) -> None:
        if tail is not None:
            tail.graph.reset()

    def wait_for_copies(self) -> None:
        """Also for the last tail graph, outside a capture (a capture joins only the streams it forked)."""
        super().wait_for_copies()
        if self.cuda and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().wait_stream(self.tail_stream)

    # -- one layer -----------------------------------------------------------------------------------
    def decode(self, layer, q, k, v, out) -> None:
        meta = self.meta
        nd, real = meta.num_decode, len(q) - meta.num_draft
        self.wait_for_prefetch(layer)
        # the draft goes where x_{t+1} will: x_t's tail block unless x_t filled it (then a block it opens)
        together = self.tails_resident and not self.any_opens
        draft_kv = (k[real:], v[real:])
        tail_slots = self.write_tail(layer, k[:nd], v[:nd], draft_kv if together else None)
        dense = self.is_dense_layer(layer)
        # when no miss is fetched or filled, x_t's attended blocks are known at the residency check: one launch
        # does both
        fused = not together and not self.fetches(dense) and not self.fills(dense)
        draft = self.draft_write(layer, tail_slots, *draft_kv) if fused else None
        attended, draft_scores = self.resident_selection(layer, q, dense, draft)  # last column: the opened blocks
        if not (together or fused):
            self.write_draft_kv(layer, tail_slots, attended, *draft_kv)
        with self.timer("attention"):
            self.attend_with_draft(layer, q, out, attended, dense)
        if self.any_opens:  # x_t filled some tail block (the same condition)
            self.spill_full_tails(layer, tail_slots)
        if not dense:
            self.waiting.append((layer, draft_scores))
        # a group may end at a dense layer (one whose budget covers the context): the sparse layers waiting before
        # it are predicted there, not dropped at the next step's begin
        if layer in self.group_ends and self.waiting and self.deferring and layer >= self.tail_from:
            self.deferred.append(self.waiting)
            self.waiting = []
        elif layer in self.group_ends and self.waiting:
            self.predict_and_prefetch(self.rows_now)
        self.flush_counts(layer)

    def attend_with_draft(self, layer, q, out, attended, dense) -> None:
        """x_t and its draft in one launch: x_t attends to `attended` (int32 [B, K + 1], its last column the
        block each draft opened, or -1); the draft to the same blocks and one more token (its own, written
        where x_{t+1}'s will go). On sparse layers the K/V of each block are read once for both, and the
        slots are looked up in the working set's table in place."""
        meta = self.meta
        nd, real = meta.num_decode, len(q) - meta.num_draft
        both = q[:2 * nd] if real == nd else torch.cat([q[:nd], q[real:]])  # prefill rows sit in between
        gpu_kv = self.pool.layer(layer)
        target = out[:2 * nd] if real == nd else None
        if dense:
            tables = self.ws.table(layer, self.rows, self.host_tables.shape[1]).repeat(2, 1)
            lens = self.rows_now.both_lens
            if self.cuda:
                result = paged_decode_attention(both, gpu_kv, tables, lens, self.scale, target,
                                                max_seq_len=meta.decode_max_seq_len + 1)
            else:
                result = paged_decode_reference(both, gpu_kv, tables, lens, self.scale)
        else:  # the draft sees one token more than x_t, so x_t skips the block the draft opened
            attend = sparse_decode_attention_padded if self.cuda else sparse_decode_padded_reference
            result = attend(both, gpu_kv, self.ws._slot_of[layer], attended, meta.decode_seq_lens, self.scale, target,
                            num_queries=2, table_rows=self.rows)
        if target is None or result.data_ptr() != target.data_ptr():
            out[:nd], out[real:] = result[:nd], result[nd:]

    def wait_for_prefetch(self, layer: int) -> None:
        done, self.prefetched[layer] = self.prefetched[layer], None
        # in a capture, eager steps' copies are waited for before the replay (before_replay), the last tail graph
        # before the first layer it predicted, and the graph's own copies are joined at its end
        if not self.cuda:  # the CPU predicts synchronously
            return
        if torch.cuda.is_current_stream_capturing():
            if layer == self.first_deferred:
                torch.cuda.current_stream().wait_event(self.tail_done)
            return
        if done is None:
            return
        compute = torch.cuda.current_stream()
        start = self.clock.mark(compute)
        compute.wait_event(done)
        self.clock.close("prefetch_exposed", start, compute)

    def fetches(self, dense: bool) -> bool:
        """Whether resident_selection fetches misses in this layer: cold-start ones, or all of them (the "fetch"
        policy, a cap of 1, dense layers)."""
        return dense or self.fetch_every_miss or self.any_cold

    def fills(self, dense: bool) -> bool:
        """Whether resident_selection puts resident blocks in the places of misses left out (the "fill" policy)."""
        return not dense and self.cfg.miss_policy == "fill" and not self.fetch_every_miss

    def resident_selection(self, layer, q, dense,
                           draft: DraftWrite | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x_t's selection restricted to what is resident once cold-start (and, with the "fetch"
        policy, all) misses are fetched: int32 [B, K + 1], -1 where a selected block is left out (under
        "fill", replaced by x_t's best resident block outside its selection where there is one), the last
        column the block each draft opens (or -1); and the draft's block scores for the group's prediction
        (None on dense layers). `q`: all of the step's rows. With `draft` (only where nothing is fetched or
        filled) the drafts' K/V are written too, in the same launch on the GPU."""
        attended, selection, scores, draft_scores = self.check_residency(layer, q, dense, draft)
        if self.fills(dense):
            self.count("misses_to_fill", (selection >= 0) & (attended[:, :-1] < 0))
            fill = fill_misses if self.cuda else fill_misses_reference
            counters = FillCounters(self.row_counts[0], self.layer_counts[0], self.counter_index["filled_blocks"],
                                    layer)
            attended, _ = fill(attended, selection, scores, self.ws.block_of[layer], self.rows, self.rows_now.nblocks,
                               counters)
        return attended, draft_scores

    def check_residency(self, layer, q, dense, draft: DraftWrite | None):
        """resident_selection before any fill: (attended, x_t's selection, its scores or None, draft scores)."""
        if dense:
            return self.every_block_resident(layer), None, None, None
        with self.timer("select"):
            scores, draft_scores = self.score_now_and_draft(layer, q)
            budget = self.layer_budget_blocks[layer]
            ranked, before_list = self.rank_resident_list(layer, q[:self.meta.num_decode], scores, budget) \
                if self.cfg.shortlist else (scores, None)
            _, selection = self.select_by(ranked, budget)
        judged = torch.zeros_like(self.fresh) if layer in self.turned_sparse else self.fresh
        check = resident_selection if self.cuda else resident_selection_reference  # + selected/hit/miss/agreement
        opened = self.rows_now.opened
        attended = check(selection, self.ws._slot_of, self.predicted, self.rows, judged, self.row_counts[0],
                         self.layer_counts[0], self.residency_counters, layer, opened, draft)
        if before_list is not None:
            self.count_list_fetches_as_misses(selection, before_list, attended[:, :-1])
        if not self.fetches(dense):  # misses are left out
            return attended, selection, scores, draft_scores
        fetch_rows = torch.ones_like(self.cold) if self.fetch_every_miss else self.cold
        resident = attended[:, :-1]
        need = torch.where((selection >= 0) & (resident < 0) & fetch_rows[:, None], selection, -1)
        with self.timer("gather"):
            fetched, _ = self.fetch(layer, need, self.mask_of(selection))
        self.count("cold_fetched_blocks", fetched & self.cold[:, None])
        self.count("miss_fetched_blocks", fetched & ~self.cold[:, None])
        attended = torch.cat([torch.where((resident >= 0) | fetched, selection, -1), opened[:, None]], 1)
        return attended, selection, scores, draft_scores

    def every_block_resident(self, layer) -> torch.Tensor:
        """A dense layer's attended blocks, as resident_selection gives them: every block, the missing ones fetched.
        It selects nothing, so nothing is counted but the fetch (quest counts no dense layer's blocks either)."""
        every = self.rows_now.every_block
        need = torch.where(self.ws.table(layer, self.rows, every.shape[1]) < 0, every, -1)
        with self.timer("gather"):
            self.fetch(layer, need, self.mask_of(every))
        return torch.cat([every, self.rows_now.opened[:, None]], 1)

    def score_now_and_draft(self, layer, q) -> tuple[torch.Tensor, torch.Tensor]:
        """x_t's block scores fp32 [B, W] (W: the decode block tables' width) and the draft's [B, W + 1]
        (it may open a block), all ranks' heads: one launch reads the layer's summaries once for both, and
        under tensor parallelism one collective combines both.

        The draft's scores wait for the group's prediction: nothing writes this layer's summaries before it
        (prefill rows merged theirs and write_tail refreshed the tail's before this; later layers write
        their own), so they are what scoring the draft then would give."""
        meta = self.meta
        nd, real = meta.num_decode, len(q) - meta.num_draft
        both = q[:real + nd].unfold(0, nd, real).movedim(-1, 1)  # [2, B, Hq, D]: rows :nd and real:, no copy
        scores = self.combined(self.local_scores_multi(layer, both, self.host_tables, self.rows_now.both_nblocks))
        # host_tables is the decode block table plus one column, which x_t never counts: its first W
        # columns are exactly the scores select has for x_t
        return scores[0, :, :meta.decode_block_tables.shape[1]], scores[1]

    def derive_rows(self) -> DraftRows:
        rows = super().derive_rows()
        pos = self.meta.decode_seq_lens.long()  # the draft's position
        opens = rows.full  # x_t fills its tail, so the draft starts the next block
        both_lens = torch.cat([self.meta.decode_seq_lens, self.meta.decode_seq_lens + 1])
        both_nblocks = ((both_lens + (self.block_size - 1)) // self.block_size).view(2, -1)  # x_t's, then the drafts'
        return DraftRows(**vars(rows), draft_nblocks=both_nblocks[1], both_nblocks=both_nblocks,
                         both_lens=both_lens, opens=opens,
                         opened=torch.where(opens, pos // self.block_size, -1).to(torch.int32),
                         draft_offset=pos % self.block_size)

    def write_draft_kv(self, layer, tail_slots, attended, k, v) -> None:
        """Puts the draft token's K/V where x_{t+1}'s will go: the tail block, or a block it opens (given
        a slot now, never one of x_t's attended blocks, and resident for the next step). One launch on
        the GPU. `attended` may list the opened blocks too (resident_selection's last column): a block
        without a slot is held by none, so protecting it changes nothing."""
        write = write_draft_kv if self.cuda else write_draft_kv_reference
        write(*self.draft_write(layer, tail_slots, k, v).arguments(self.ws._slot_of, layer, self.rows,
                                                                   self.rows_now.opened, attended))

    def draft_write(self, layer, tail_slots, k, v) -> DraftWrite:
        """write_draft_kv's arguments that resident_selection does not have."""
        ws = self.ws
        return DraftWrite(self.pool.layer(layer), ws._block_of, ws._last_used, tail_slots, self.rows_now.draft_offset,
                          k, v, self.step_tensor)

    # -- statistics -----------------------------------------------------------------------------------
    def stats(self) -> dict:
        return lookahead_stats(self, super().stats())
