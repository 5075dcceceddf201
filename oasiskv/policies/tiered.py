"""The host tier: the full KV in the host store, each running request's working set in GPU slots.

TieredPolicy holds what retrieval and oasis share: prefill writes the host store and attends densely;
a decode appends to the tail block (resident, written to the host once full); blocks are made
resident with `fetch`, which runs without a host sync (fixed-size lists, -1 = nothing) on the
current stream or on a copy stream. Counters accumulate on the device and are read when asked.

RetrievalPolicy is the baseline: per layer, the selection's missing blocks are gathered before
that layer's attention, on the critical path."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oasiskv.config import KVConfig
from oasiskv.engine.upload import StepUpload
from oasiskv.kernels.host_gather import (gather_host_blocks, gather_host_blocks_reference, store_blocks_to_host,
                                         store_blocks_to_host_reference)
from oasiskv.kernels.tail_append import append_to_tails, append_to_tails_reference
from oasiskv.kv.gpu_pool import KVPool
from oasiskv.kv.host_store import HostStore
from oasiskv.kv.prefill_keep import EXTEND, TAKE, PrefillKeep
from oasiskv.kv.summaries import BlockSummaries
from oasiskv.kv.working_set import WorkingSet
from oasiskv.policies.attention import sdpa
from oasiskv.policies.sparse import DecodeRows, SparsePolicy


@dataclass
class TieredRows(DecodeRows):
    """DecodeRows plus what writing filled tails to the host needs, once per step rather than per layer."""
    full: torch.Tensor        # bool [B]: x_t fills its tail block this step
    spill_dst: torch.Tensor   # int32 [B]: that block's host block where full, else -1
    layer_rows: torch.Tensor  # int32 [layers, B]: row i holds layer i's id (copy lists name a layer per entry)


class TieredPolicy(SparsePolicy):
    COUNTERS = ("selected_blocks", "hits", "misses", "fetched_blocks", "tail_fetches")
    counts_selections = False  # "selected_blocks" is one of COUNTERS
    STEP_TENSORS = ("rows",)
    LANES = 2  # streams that count

    def __init__(self, pool: KVPool, host: HostStore, working_set: WorkingSet, kv_cfg: KVConfig,
                 summaries: BlockSummaries, block_size: int, scale: float, device: torch.device,
                 timing: bool = True):
        super().__init__(kv_cfg, summaries, block_size, scale, device, timing)
        self.pool, self.host, self.ws = pool, host, working_set
        layers, _, _, _, kv_heads, head_dim = pool.kv.shape
        self.keep = PrefillKeep(layers, kv_cfg.prefill_keep_tokens or 0, kv_heads, head_dim, pool.kv.dtype, device)
        self.keep_ways: list[str | None] = []  # how the keep serves each prefill span of the step
        self.counter_index = {name: i for i, name in enumerate(self.COUNTERS)}
        # one set of counters per stream that counts ("lane" 0: compute, 1: copy, 2: oasis's tail graph): no two
        # streams accumulate into the same memory
        lanes = self.LANES
        self.row_counts = torch.zeros(lanes, working_set.rows, len(self.COUNTERS), dtype=torch.int64, device=device)
        self.layer_counts = torch.zeros(lanes, pool.kv.shape[0], len(self.COUNTERS), dtype=torch.int64, device=device)
        self.pending: list[dict[int, torch.Tensor]] = [{} for _ in range(lanes)]
        self.counter_ids: dict[tuple[int, ...], torch.Tensor] = {}  # made once: no host copy in a capture
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        # prefill's whole blocks go to the pinned host store by DMA on their own stream (HostStore.write_span):
        # a decode step, which may read them, first waits for it
        self.store_stream = torch.cuda.Stream(device) if self.cuda and host.kv.is_pinned() else None
        self.host_writes_pending = False
        self.prefix_written: torch.cuda.Event | None = None
        # two staging buffers for those copies, used by alternate layers, each with the event after the copies
        # that last read it: a fixed 2 x (chunk's K/V) of device memory, not a new tensor per layer held until read
        self.staging: list[torch.Tensor | None] = [None, None]
        self.staging_read: list[torch.cuda.Event | None] = [None, None]
        self.capture_refs: list[torch.Tensor] = []  # read by the copy stream in a capture: kept till its end
        self.layer_range = torch.arange(pool.kv.shape[0], dtype=torch.int32, device=device)
        # the step number that placements on the copy stream (lane 1) stamp as last use; a policy that places there
        # (oasis) gives it its own tensor, written on that stream
        self.copy_step = self.step_tensor
        self.upload = StepUpload(device)  # the step's row lists, without a pageable copy
        self._host_tables: torch.Tensor | None = None  # host_tables of this step, once made

    # -- counters (on the device; read only by stats and at release) ------------------------------
    def count(self, name: str, per_row: torch.Tensor, lane: int = 0) -> None:
        """Adds per decode row values ([B] or [B, K] summed over K) to counter `name` (applied by
        flush_counts, in one go per layer and lane)."""
        if per_row.dim() == 2:
            per_row = per_row.sum(1)
        i, pending = self.counter_index[name], self.pending[lane]
        pending[i] = per_row if i not in pending else pending[i] + per_row

    def flush_counts(self, layer, lane: int = 0, rows: torch.Tensor | None = None) -> None:
        """`layer`: an int, or with `rows` (the rows counted, default this step's) a tensor of each
        counted row's layer."""
        pending = self.pending[lane]
        if not pending:
            return
        key = tuple(pending)
        if key not in self.counter_ids:
            self.counter_ids[key] = torch.tensor(key, device=self.row_counts.device)
        index = self.counter_ids[key]
        values = torch.stack(list(pending.values())).long()  # [counters, rows counted]
        rows = self.rows if rows is None else rows
        # index_add_ into the flat tables: one atomic kernel, where an accumulating index_put_ sorts its
        # indices (a dozen kernels, on the copy stream's path at the end of each step)
        width = len(self.COUNTERS)
        self.row_counts[lane].view(-1).index_add_(0, (rows[None, :] * width + index[:, None]).view(-1),
                                                  values.view(-1))
        if isinstance(layer, torch.Tensor):
            self.layer_counts[lane].view(-1).index_add_(0, (layer[None, :] * width + index[:, None]).view(-1),
                                                        values.view(-1))
        else:
            self.layer_counts[lane, layer].index_add_(0, index, values.sum(1))
        self.pending[lane] = {}

    def release(self, request_id: str) -> None:
        self.wait_for_copies()  # the copy stream may still be counting for this row
        if request_id in self.ws._row_of:
            row = self.ws.row(request_id)
            values = self.row_counts[:, row].sum(0).tolist()
            self.row_counts[:, row] = 0
            mine = self.per_request[request_id]
            for name, v in zip(self.COUNTERS, values):
                mine[f"kv_{name}"] += v
                self.counts[name] += v
            mine["kv_bytes_gathered"] = mine["kv_fetched_blocks"] * self.host.chunk_bytes
        self.ws.release(request_id)
        self.keep.release(request_id)

    def stats(self) -> dict:
        self.wait_for_copies()
        live = self.row_counts.sum((0, 1)).tolist()
        out = {f"kv_{name}": self.counts.get(name, 0) + v for name, v in zip(self.COUNTERS, live)}
        out["kv_bytes_gathered"] = out["kv_fetched_blocks"] * self.host.chunk_bytes
        # tokens of earlier chunks that later prefill chunks attended to (in every layer), by where they were read
        out["kv_prefill_prefix_tokens_kept"] = self.keep.served["kept"]
        out["kv_prefill_prefix_tokens_from_host"] = self.keep.served["host"]
        out.update({f"kv_time_{k}_s": round(v, 6) for k, v in self.timer.totals.items()})
        return out

    # -- the step -----------------------------------------------------------------------------------
    def begin_step(self, meta) -> None:
        super().begin_step(meta)
        if meta.num_decode:
            self.wait_for_host_writes()
        # what earlier steps wrote to the host store and the current stream has not waited for yet: the
        # prefix reads of continued prefills wait for it
        self.prefix_written = self.store_stream.record_event() if self.host_writes_pending else None
        if self.keep.holder is not None and self.keep.holder in meta.decode_request_ids:
            self.keep.release(self.keep.holder)  # its prompt's last token came alone, as a decode: prefill is over
        self.keep_ways = self.keep.plan(meta.prefills)
        arrays = self.step_arrays(meta)
        self.step_buffer, views = self.upload(list(arrays.values()))
        for name, t in zip(arrays, views):
            setattr(self, name, t)
        self._host_tables = None
        self.tails_resident = False  # retrieval re-checks every step; oasis knows when they are

    @property
    def host_tables(self) -> torch.Tensor:
        """The decode block tables one column wider: room for the block a draft token opens (scored, never
        fetched). Made at the first use in a step, so a captured step makes it inside its graph from the
        reloaded tables (no launch and no copy before the replay)."""
        if self._host_tables is None:
            self._host_tables = torch.nn.functional.pad(self.meta.decode_block_tables, (0, 1))
        return self._host_tables

    def step_arrays(self, meta) -> dict[str, np.ndarray]:
        """The step's tensors made on the host, by attribute name: sent in one copy (step_buffer)."""
        ids = meta.decode_request_ids
        return {"rows": np.fromiter(map(self.ws.row, ids), dtype=np.int64, count=len(ids))}

    def attend(self, layer, q, k, v):
        meta = self.meta
        nd, real = meta.num_decode, len(q) - meta.num_draft
        out = torch.empty_like(q)
        if real > nd:
            self.prefill(layer, q[:real], k[:real], v[:real], out)
        if nd:
            self.decode(layer, q, k, v, out)
        return out

    def prefill(self, layer, q, k, v, out) -> None:
        """Prefill writes the host store (and summaries) and attends densely; nothing stays resident but
        what the prefill keep holds until the prompt's last chunk."""
        meta = self.meta
        self.write_host(layer, k, v)
        self.summaries.merge_spans(layer, meta.prefills, k, self.block_size)
        for span, way in zip(meta.prefills, self.keep_ways):
            s, e = span.token_start, span.token_end
            if way in (TAKE, EXTEND):
                self.keep.store(layer, span.start_pos, k[s:e], v[s:e])
            if span.start_pos == 0:
                out[s:e] = sdpa(q[s:e], k[s:e], v[s:e], self.scale, causal=True)
                continue
            if way:
                pk, pv = self.keep.keys_and_values(layer, span.start_pos, k[s:e], v[s:e], way)
            else:
                pk, pv = self.prefix_from_host(layer, span, k[s:e], v[s:e])
            out[s:e] = sdpa(q[s:e], pk, pv, self.scale, causal=True)

    def prefix_from_host(self, layer, span, k, v):
        """K and V of a later chunk's positions: earlier chunks' from the host store (their copies were issued in
        earlier steps), the chunk's own from the GPU."""
        if self.prefix_written is not None:
            torch.cuda.current_stream().wait_event(self.prefix_written)
        prior = span.start_pos
        pk, pv = self.host.read_prefix(layer, span.block_ids[: -(-prior // self.block_size)], prior, k.device)
        return torch.cat([pk, k]), torch.cat([pv, v])

    def write_host(self, layer, k, v) -> None:
        """The prefill chunks' K/V to the host store: by the copy engines on the store stream where the
        store is pinned, else token by token on the current stream."""
        meta, nd = self.meta, self.meta.num_decode
        if self.store_stream is None:
            self.host.write_tokens(layer, meta.slot_blocks[nd:], meta.slot_offsets[nd:], k[nd:], v[nd:])
            return
        staging, used = self.staging_buffer(layer, len(k) - nd), 0
        for span in meta.prefills:
            s, e = span.token_start, span.token_end
            used += self.host.write_span(layer, span.start_pos, span.block_list, k[s:e], v[s:e], meta.slot_blocks[s:e],
                                         meta.slot_offsets[s:e], self.store_stream, staging[used:])
        self.staging_read[layer % 2] = self.store_stream.record_event()
        self.host_writes_pending = True

    def staging_buffer(self, layer: int, tokens: int) -> torch.Tensor:
        """Layer parity's staging buffer, with room for `tokens` tokens' whole blocks; the current stream
        waits until the copies that last read it are done (two layers ago: long since, in practice)."""
        i = layer % 2
        buffer, read = self.staging[i], self.staging_read[i]
        if buffer is None or len(buffer) < tokens // self.block_size:
            if buffer is not None:  # its memory is reused only once pending copies have read it
                buffer.record_stream(self.store_stream)
            shape = (tokens // self.block_size, *self.host.kv.shape[2:])
            self.staging[i] = buffer = torch.empty(shape, dtype=self.host.kv.dtype, device=self.pool.kv.device)
        elif read is not None:
            torch.cuda.current_stream().wait_event(read)
        return buffer

    def wait_for_host_writes(self, host: bool = False) -> None:
        """Orders the current stream (or with `host`, the host) after the prefill's host-store writes."""
        if self.store_stream is None:
            return
        if host:
            self.store_stream.synchronize()
        elif self.host_writes_pending:  # once waited for, later steps need not wait again
            torch.cuda.current_stream().wait_stream(self.store_stream)
            self.host_writes_pending = False

    def write_tail(self, layer, k, v, draft=None):
        """Appends each decode token's K/V to its tail block (made resident first: after a prefill the
        tail's earlier tokens are on the host) and refreshes that block's summary. `draft`: (k, v) of
        tokens one position later in the same blocks, written too (only when tails are resident).
        Returns each tail's slot, int32 [B]."""
        rows = self.rows_now
        tail, fill, tail_host = rows.tail, rows.fill, rows.tail_block
        gpu_kv = self.pool.layer(layer)
        if self.tails_resident:  # one launch: lookup and writes
            append = append_to_tails if self.cuda else append_to_tails_reference
            tail_slots = append(gpu_kv, self.ws._slot_of, layer, self.rows, tail, fill, k, v, *(draft or (None, None)))
            self.summaries.update_from(layer, gpu_kv, tail_slots, rows.fill32, tail_host)
            return tail_slots
        if draft is not None:
            raise ValueError("draft K/V are written with the tail only when the tails are resident")
        wanted = tail[:, None].to(torch.int32)
        with self.timer("gather"):
            miss, slots = self.fetch(layer, wanted, self.mask_of(wanted), only=(fill > 1)[:, None])
        self.count("tail_fetches", miss & (fill > 1)[:, None])
        tail_slots = slots.squeeze(1)
        gpu_kv[tail_slots.long(), 0, fill - 1] = k
        gpu_kv[tail_slots.long(), 1, fill - 1] = v
        self.summaries.update_from(layer, gpu_kv, tail_slots, rows.fill32, tail_host)
        return tail_slots

    def mask_of(self, blocks: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """bool [B, width]: the logical blocks listed in `blocks` (int32 [B, K], -1 = none)."""
        width = width or self.host_tables.shape[1]
        mask = torch.zeros(len(blocks), width + 1, dtype=torch.bool, device=blocks.device)
        mask.scatter_(1, torch.where(blocks >= 0, blocks.long(), width), True)
        return mask[:, :width]

    def fetch(self, layer, wanted, protect, only=None, stream=None):
        """Makes `wanted` (int32 [B, K], -1 = none) resident, evicting unprotected blocks; copies the
        blocks that were missing (where `only` allows; the others get a slot and no data) from the
        host store, on `stream` if given. Returns (miss mask [B, K], slots [B, K])."""
        miss, slots, copies = self.place(layer, wanted, protect, only)
        self.copy_from_host(copies, stream)
        return miss, slots

    def place(self, layer, wanted, protect, only=None, lane: int = 0, rows=None, host_tables=None, step=None):
        """The working-set half of fetch: slots for `wanted`, and the copies that fill the missing
        ones as (layer ids, host blocks, slots) lists with -1 for no copy. `layer` is an int, or (with
        `rows` and their `host_tables`) a long tensor of each row's layer. `step`: the number stamped as
        last use (default this step's, as the lane's stream reads it)."""
        rows = self.rows if rows is None else rows
        host_tables = self.host_tables if host_tables is None else host_tables
        if step is None:
            step = self.copy_step if lane else self.step_tensor
        miss, slots, src, dst = self.ws.place_with_copies(layer, rows, wanted, protect, step, host_tables, only)
        if isinstance(layer, torch.Tensor):
            layers = layer[:, None].expand_as(dst).to(torch.int32).reshape(-1)
        else:
            layers = torch.full_like(dst.reshape(-1), layer)
        self.count("fetched_blocks", dst >= 0, lane)
        return miss, slots, (layers, src.reshape(-1), dst.reshape(-1))

    def copy_from_host(self, copies, stream=None, programs: int | None = None) -> None:
        """`programs`: copy with at most this many GPU programs (a background copy), else one per block."""
        if not self.cuda:
            gather_host_blocks_reference(self.host.kv, self.pool.kv, *copies)
            return
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the lists, and readers of evicted slots
            self.keep_alive(copies, stream)
        gather_host_blocks(self.host.kv, self.pool.kv, *copies, stream=stream, programs=programs)

    def derive_rows(self) -> TieredRows:
        rows = super().derive_rows()
        full = rows.fill == self.block_size
        return TieredRows(**vars(rows), full=full, spill_dst=torch.where(full, rows.tail_block, -1).to(torch.int32),
                          layer_rows=self.layer_range[:, None].expand(-1, len(full)).contiguous())

    def selection_or_list(self, layer, q) -> torch.Tensor:
        """The blocks to make resident: the selection, or with --shortlist the list (its best shortlist x budget
        blocks by score)."""
        if not self.cfg.shortlist:
            return self.select(layer, q, self.meta.decode_block_tables)[1]
        scores = self.score_blocks(layer, q, self.meta.decode_block_tables, self.rows_now.nblocks)
        return self.select_by(scores, self.cfg.shortlist_blocks(self.layer_budget_blocks[layer]))[1]

    def spill_full_tails(self, layer, tail_slots, dst=None) -> None:
        """A tail block that just filled is written once to the host store; it stays resident. On the
        GPU the copy runs on the copy stream, which later fetches of the same block follow in order.
        `dst`: int32 [B], the host blocks to write (-1: none); default each full tail's own."""
        rows = self.rows_now
        src = tail_slots  # int32 [B]; the copy skips the rows whose dst is -1 (tails not full)
        dst, layers = rows.spill_dst if dst is None else dst, rows.layer_rows[layer]
        if not self.cuda:
            keep = rows.full
            store_blocks_to_host_reference(self.pool.kv, self.host.kv, layers[keep], src[keep], dst[keep])
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        self.keep_alive((src, dst, layers), self.copy_stream)
        store_blocks_to_host(self.pool.kv, self.host.kv, layers, src, dst, stream=self.copy_stream)

    def wait_for_copies(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.copy_stream)

    def before_replay(self) -> None:
        if self.cuda:  # the copies eager steps left (not oasis's tail graph: its next replay waits inside)
            torch.cuda.current_stream().wait_stream(self.copy_stream)

    def begin_capture(self) -> None:
        self.copy_stream.wait_stream(torch.cuda.current_stream())

    def end_capture(self) -> None:
        self.wait_for_copies()
        self.capture_refs.clear()

    def keep_alive(self, tensors, stream) -> None:
        """Tensors made on the compute stream that `stream` reads: their memory must not be reused
        before it has. Eagerly the caching allocator is told so; in a capture (where record_stream
        does not order reuse) they are held until the capture's end, after its streams join."""
        if torch.cuda.is_current_stream_capturing():
            self.capture_refs.extend(tensors)
            return
        for t in tensors:
            t.record_stream(stream)


class RetrievalPolicy(TieredPolicy):
    name = "retrieval"

    def count_selection(self, chosen: torch.Tensor, missed: torch.Tensor) -> None:
        self.count("selected_blocks", chosen)
        self.count("misses", missed)
        self.count("hits", chosen & ~missed)

    @staticmethod
    def selected_from_list(selection, listed, missed, width) -> tuple[torch.Tensor, torch.Tensor]:
        """With --shortlist, the final selection's blocks and which of them the list's fetch brought (misses), as
        oasis counts a list: the counts then compare across modes (the whole list was counted before)."""
        was_missing = torch.zeros(selection.shape[0], width + 1, dtype=torch.bool, device=selection.device)
        sink = torch.full_like(listed, width)  # column `width` takes the entries that are not misses
        was_missing.scatter_(1, torch.where(missed & (listed >= 0), listed, sink).long(), True)
        chosen = selection >= 0
        return chosen, chosen & was_missing.gather(1, torch.where(chosen, selection, width).long())

    def decode(self, layer, q, k, v, out) -> None:
        nd = self.meta.num_decode
        q, k, v = q[:nd], k[:nd], v[:nd]
        self.wait_for_copies()  # tail spills of the previous layer/step precede any re-fetch
        tail_slots = self.write_tail(layer, k, v)
        width = self.meta.decode_block_tables.shape[1]
        if self.is_dense_layer(layer):
            wanted, selection = self.rows_now.every_block, None
        else:
            with self.timer("select"):
                wanted = self.selection_or_list(layer, q)
            selection = wanted
        with self.timer("gather"):
            miss, _ = self.fetch(layer, wanted, self.mask_of(wanted))
        if selection is not None and not self.cfg.shortlist:  # a dense layer selects nothing: none of its blocks
            self.count_selection(wanted >= 0, miss)              # count, as in quest
        tables = self.ws.table(layer, self.rows, width)
        if self.cfg.shortlist and selection is not None:  # the list is resident: its exact mass picks the budget
            with self.timer("select"):
                ranked = self.rank_the_list(layer, q, wanted, tables, width)
                _, selection = self.select_by(ranked, self.layer_budget_blocks[layer])
            self.count_selection(*self.selected_from_list(selection, wanted, miss, width))
        with self.timer("attention"):
            out[:nd] = self.attention(q, self.pool.layer(layer), tables, selection)
        self.spill_full_tails(layer, tail_slots)
        self.flush_counts(layer)
