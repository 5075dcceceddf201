"""Sparse decode policies. All score block summaries with the decode query and attend to a selection
(sink + local window with the tail + top-scored blocks, `budget` tokens in all); they differ in
where the full KV lives:
  quest      the full KV in the GPU pool; nothing moves.
  retrieval, oasis  the full KV in the host store, a working set on the GPU (policies/tiered.py,
             policies/oasis.py).
Prefill is dense (and writes the summaries)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from oasiskv.config import KVConfig
from oasiskv.kernels.block_mass import block_mass_scores_multi, block_mass_scores_multi_reference
from oasiskv.kernels.block_select import (block_scores, block_scores_multi, block_scores_multi_reference,
                                          block_scores_reference)
from oasiskv.kernels.block_topk import select_blocks_fused
from oasiskv.kernels.selection_rule import select_blocks_padded
from oasiskv.kernels.list_scores import listed_scores, listed_scores_reference
from oasiskv.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from oasiskv.kernels.shortlist_mass import shortlist_block_lse, shortlist_block_lse_reference
from oasiskv.kernels.sparse_decode import sparse_decode_attention_padded, sparse_decode_padded_reference
from oasiskv.kv.gpu_pool import KVPool
from oasiskv.kv.summaries import BlockSummaries
from oasiskv.policies.base import KVPolicy, length_bucket
from oasiskv.policies.dense import prefill_attention, write_kv
from oasiskv.policies.timers import PhaseTimer


@dataclass
class DecodeRows:
    """What every layer needs of this step's decode rows, derived from the metadata on the device once
    per step, at the first layer that asks (inside a captured graph too: the metadata are its inputs)."""
    nblocks: torch.Tensor     # int32 [B]: logical blocks of each sequence
    tail: torch.Tensor        # long [B]: the logical tail block
    fill: torch.Tensor        # long [B]: tokens in the tail block, the new one included
    fill32: torch.Tensor      # the same, int32
    tail_block: torch.Tensor  # int32 [B]: the tail's block in the decode block table
    every_block: torch.Tensor  # int32 [B, num_decode_blocks]: all blocks, -1 past the end (dense layers)


class SparsePolicy(KVPolicy):
    counts_selections = True  # select_by sums the selected blocks (the tiered policies count them per row)
    def __init__(self, kv_cfg: KVConfig, summaries: BlockSummaries, block_size: int, scale: float,
                 device: torch.device, timing: bool = True):
        self.cfg, self.summaries, self.block_size, self.scale = kv_cfg, summaries, block_size, scale
        self.budget_blocks = kv_cfg.budget // block_size
        layers = summaries.data.shape[0]
        # each layer's budget: budget_blocks, or its share under --layer-weights
        self.layer_budget_blocks = [kv_cfg.layer_budget(layer, layers, block_size) // block_size
                                    for layer in range(layers)]
        self.cuda = device.type == "cuda"
        self.timer = PhaseTimer(timing and (not self.cuda or kv_cfg.mode == "retrieval"), self.cuda)
        self.counts: dict[str, int] = defaultdict(int)
        self.per_request: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.selected_on_device = torch.zeros((), dtype=torch.int64, device=device)
        self.step_index = 0
        self.step_tensor = torch.zeros((), dtype=torch.int64, device=device)  # step_index, readable in a graph

    def begin_step(self, meta) -> None:
        super().begin_step(meta)
        self.step_index += 1
        self.num_decode_blocks = -(-meta.decode_max_seq_len // self.block_size)
        self.step_tensor.fill_(self.step_index)
        self._rows = None

    @property
    def rows_now(self) -> DecodeRows:
        if self._rows is None:
            self._rows = self.derive_rows()
        return self._rows

    def derive_rows(self) -> DecodeRows:
        n = self.meta.decode_seq_lens.long()
        nblocks = (n + self.block_size - 1) // self.block_size
        tail, fill = (n - 1) // self.block_size, (n - 1) % self.block_size + 1
        everything = torch.arange(self.num_decode_blocks, device=n.device, dtype=torch.int32)
        return DecodeRows(
            nblocks=nblocks.to(torch.int32), tail=tail, fill=fill, fill32=fill.to(torch.int32),
            tail_block=self.meta.decode_block_tables.gather(1, tail[:, None]).squeeze(1),
            every_block=torch.where(everything[None, :] < nblocks[:, None], everything[None, :], -1))

    def graph_key(self):
        """Steps where every layer's budget is below the context are captured; the dense layers' attention length
        hint is part of the key when there are any. Where some layer's budget covers the context (--layer-weights
        can give one more than the others), that layer attends densely and the step runs eagerly: such a mix is not
        captured (not tried on the GPU; it passes once the context outgrows the largest budget)."""
        if self.timer.enabled or self.num_decode_blocks <= max(self.layer_budget_blocks):
            return None
        return ("sparse", length_bucket(self.meta.decode_max_seq_len) if self.cfg.dense_layers else 0)

    def request_stats(self, request_id: str) -> dict:
        """The request's own counters (the tiered policies keep them per working-set row); quest and oracle count
        their selections engine-wide only, summed on the device (a count per request would read it every step)."""
        return dict(self.per_request.pop(request_id, {}))

    def stats(self) -> dict:
        counts = dict(self.counts)
        counts["selected_blocks"] = counts.get("selected_blocks", 0) + int(self.selected_on_device)
        out = {f"kv_{k}": v for k, v in counts.items()}
        out.update({f"kv_time_{k}_s": round(v, 6) for k, v in self.timer.totals.items()})
        return out

    # -- shared pieces ---------------------------------------------------------------------------
    def select(self, layer: int, q: torch.Tensor, score_tables: torch.Tensor):
        """Selection of each decode query: (counts [B], padded logical ids int32 [B, K], -1 = none)."""
        scores = self.score_blocks(layer, q, score_tables, self.rows_now.nblocks)
        return self.select_by(scores, self.layer_budget_blocks[layer])

    def select_by(self, scores: torch.Tensor, budget_blocks: int | None = None, count: bool = True):
        """`select` from the decode queries' block scores, fp32 [B, blocks] (all ranks' heads); budget_blocks:
        the layer's (default: --kv-budget's); count: add the selected blocks to the counters."""
        nblocks = self.rows_now.nblocks
        select = select_blocks_fused if self.cuda else select_blocks_padded
        budget = self.budget_blocks if budget_blocks is None else budget_blocks
        counts, padded = select(scores, nblocks, budget, self.cfg.sink_blocks, self.cfg.local_blocks)
        if self.counts_selections and count:
            self.selected_on_device += counts.sum()  # summed on the device: no sync per layer
        return counts, padded

    def score_blocks(self, layer: int, q: torch.Tensor, tables: torch.Tensor, nblocks: torch.Tensor) -> torch.Tensor:
        """fp32 [B, blocks]: upper-bound scores of each query's blocks (all ranks' heads under tensor parallelism)."""
        return self.combined(self.local_scores(layer, q, tables, nblocks))

    def local_scores(self, layer: int, q: torch.Tensor, tables: torch.Tensor, nblocks: torch.Tensor) -> torch.Tensor:
        if self.cfg.block_score == "mass":
            return self.local_scores_multi(layer, q[None], tables, nblocks[None])[0]
        score = block_scores if self.cuda else block_scores_reference
        return score(q, self.summaries.layer(layer), tables, nblocks, self.summaries.parts)

    def local_scores_multi(self, layer: int, q: torch.Tensor, tables: torch.Tensor,
                           nblocks: torch.Tensor) -> torch.Tensor:
        """Scores of NQ queries per sequence, q [NQ, B, Hq, D], nblocks [NQ, B] -> fp32 [NQ, B, blocks], this
        rank's heads; the summaries are read once for all queries."""
        summaries, parts = self.summaries.layer(layer), self.summaries.parts
        if self.cfg.block_score == "mass":
            score = block_mass_scores_multi if self.cuda else block_mass_scores_multi_reference
            return score(q, summaries, tables, nblocks, self.scale, parts)
        score = block_scores_multi if self.cuda else block_scores_multi_reference
        return score(q, summaries, tables, nblocks, parts)

    def combined(self, scores: torch.Tensor) -> torch.Tensor:
        """This rank's block scores -> the whole model's (tensor parallelism: one collective); else as is."""
        return scores if self.combine_scores is None else self.combine_scores(scores)

    def rank_the_list(self, layer: int, q: torch.Tensor, listed: torch.Tensor, tables: torch.Tensor,
                      width: int) -> torch.Tensor:
        """--shortlist: the exact attention mass the decode queries `q` pay each listed block (int32 [B, W], -1 =
        none), in a softmax over the listed keys alone, at the blocks' logical ids in rows of `width` (-inf off the
        list). `tables`: where the keys are in the pool, -1 for a block not on the GPU (it gets no mass)."""
        lse = shortlist_block_lse if self.cuda else shortlist_block_lse_reference
        kv_layer = self.pool.layer(layer)
        block_lse = lse(q, kv_layer, tables, listed, self.meta.decode_seq_lens, self.scale)
        # every head is on this rank: --shortlist is refused with tensor parallelism (KVConfig.require_layer_layout)
        scores = listed_scores if self.cuda else listed_scores_reference
        return scores(block_lse, listed, kv_layer.shape[3], width)

    def is_dense_layer(self, layer: int) -> bool:
        return layer < self.cfg.dense_layers or self.num_decode_blocks <= self.layer_budget_blocks[layer]

    def attention(self, q, kv_layer, tables, selection):
        """Decode attention over `selection` (padded logical ids, -1 = none), or every block if None."""
        meta = self.meta
        if selection is None:
            args = (q, kv_layer, tables, meta.decode_seq_lens, self.scale)
            if self.cuda:
                return paged_decode_attention(*args, max_seq_len=length_bucket(meta.decode_max_seq_len))
            return paged_decode_reference(*args)
        attend = sparse_decode_attention_padded if self.cuda else sparse_decode_padded_reference
        return attend(q, kv_layer, tables, selection, meta.decode_seq_lens, self.scale)


class QuestPolicy(SparsePolicy):
    name = "quest"

    def __init__(self, pool: KVPool, kv_cfg: KVConfig, summaries: BlockSummaries, block_size: int, scale: float,
                 device: torch.device, timing: bool = True):
        super().__init__(kv_cfg, summaries, block_size, scale, device, timing)
        self.pool = pool

    def attend(self, layer, q, k, v):
        meta, kv_layer = self.meta, self.pool.layer(layer)
        nd = meta.num_decode
        write_kv(kv_layer, meta, k, v)
        out = torch.empty_like(q)
        if len(q) > nd:
            self.summaries.merge_spans(layer, meta.prefills, k, self.block_size)
        for span in meta.prefills:
            s, e = span.token_start, span.token_end
            out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], kv_layer, span, self.scale)
        if nd:
            out[:nd] = self.decode(layer, q[:nd], kv_layer)
        return out

    def select(self, layer: int, q: torch.Tensor, score_tables: torch.Tensor):
        """With --shortlist F, in two passes: the block scores keep F x the layer's budget, then each listed block's
        exact attention mass, in a softmax over the listed keys alone, picks the budget among them."""
        if not self.cfg.shortlist:
            return super().select(layer, q, score_tables)
        budget = self.layer_budget_blocks[layer]
        scores = self.score_blocks(layer, q, score_tables, self.rows_now.nblocks)
        _, listed = self.select_by(scores, self.cfg.shortlist_blocks(budget), count=False)
        return self.select_by(self.rank_the_list(layer, q, listed, score_tables, scores.shape[1]), budget)

    def decode(self, layer, q, kv_layer):
        meta = self.meta
        rows = self.rows_now
        self.summaries.update_from(layer, kv_layer, rows.tail_block, rows.fill32, rows.tail_block)
        if self.is_dense_layer(layer):
            with self.timer("attention"):
                return self.attention(q, kv_layer, meta.decode_block_tables, None)
        with self.timer("select"):
            _, selection = self.select(layer, q, meta.decode_block_tables)
        with self.timer("attention"):
            return self.attention(q, kv_layer, meta.decode_block_tables, selection)

