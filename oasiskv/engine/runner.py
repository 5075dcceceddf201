"""Turns a scheduler plan (ints) into tensors, runs the model, returns logits rows to sample."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from oasiskv.engine.cuda_graph import DecodeGraphs
from oasiskv.engine.request import PENDING_TOKEN
from oasiskv.engine.scheduler import ScheduledChunk, SchedulerOutput
from oasiskv.engine.upload import HostCopies, StepUpload
from oasiskv.models.llama import CausalLM
from oasiskv.policies.base import AttentionMetadata, KVPolicy, PrefillSpan


@dataclass
class StepResult:
    request_ids: list[str]  # the requests that sample this step, in logits row order
    logits: torch.Tensor  # [len(request_ids), vocab] fp32
    captured: list[torch.Tensor]  # hidden states of the capture layers, [T, H] each (real tokens only)
    chunks: list[ScheduledChunk]  # the step's chunks in flat-batch order (decodes first)
    draft_guesses: torch.Tensor | None = None  # int64 [num_draft]: the target's argmax on each draft row (its
    #                                            choice after the draft; row i: chunks[i]), when asked for
    draft_ids: torch.Tensor | None = None  # int64 [num_draft] on the host: the draft tokens that fill_inputs put in
    #                                        the draft rows (row i: chunks[i]); readable once the sampler has synced


class ModelRunner:
    def __init__(self, model: CausalLM, policy: KVPolicy, block_size: int, device: torch.device,
                 graphs: DecodeGraphs | None = None, max_blocks: int = 0):
        """graphs: replay decode-only steps from CUDA graphs; their block tables are then max_blocks wide."""
        self.model, self.policy, self.block_size, self.device = model, policy, block_size, device
        self.graphs, self.max_blocks = graphs, max_blocks
        self.capture_layers: tuple[int, ...] = ()
        self.guess_after_drafts = False  # also the target's argmax on the draft rows (--draft target)
        self.upload = StepUpload(device)  # the step's tensors in one copy
        self.tables = KeptTables()
        # a draft source that drafts on the device: fill_inputs(ids, meta) writes the draft rows of the step's ids
        # before the model runs (inside a captured step too)
        self.fill_inputs = None
        self.to_host = HostCopies()
        self.token_sources: torch.Tensor | None = None  # set by prepare
        self.any_pending = False

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, pending: PendingTokens | None = None) -> StepResult:
        """pending: the tokens of the step before, still on the device (async scheduling); the chunks hold
        PENDING_TOKEN where they go."""
        chunks = order_decodes_first(plan.chunks)
        graphable = self.graphs is not None and all(map(is_decode, chunks))
        ids, positions, meta = self.prepare(chunks, self.max_blocks if graphable else 0, pending)
        if self.any_pending:
            fill_pending(ids, self.token_sources, pending.tokens)
        self.policy.begin_step(meta)
        replayed = self.graphs.run(ids, positions, meta, self.capture_layers, self.guess_after_drafts,
                                   self.fill_inputs) \
            if graphable else None
        real = len(ids) - meta.num_draft
        if replayed is not None:
            logits, captured, guesses, ran = replayed
            return StepResult([c.request_id for c in chunks], logits, [c[:real] for c in captured], chunks, guesses,
                              self.drafts_to_host(ran[real:]))
        if self.fill_inputs is not None:
            self.fill_inputs(ids, meta)
        hidden, captured = self.model(ids, positions, self.policy, self.capture_layers)
        captured = [c[:real] for c in captured]
        ends, sampling = [], []
        offset = 0
        for c in chunks:
            offset += len(c.token_ids)
            if c.sample:
                ends.append(offset - 1)
                sampling.append(c.request_id)
        guessed = list(range(real, len(ids))) if self.guess_after_drafts else []  # the draft rows
        if not ends + guessed:
            return StepResult(sampling, hidden.new_zeros(0, 0, dtype=torch.float32), captured, chunks)
        # one pass of the output head over the sampled rows and the draft rows: its weights are read once
        out = self.model.logits(hidden[torch.tensor(ends + guessed, device=self.device, dtype=torch.long)])
        guesses = out[len(ends):].argmax(-1) if guessed else None
        return StepResult(sampling, out[:len(ends)], captured, chunks, guesses, self.drafts_to_host(ids[real:]))

    def drafts_to_host(self, drafts: torch.Tensor) -> torch.Tensor | None:
        """The step's device-made drafts, copied to the host without a sync (complete once the sampler has read
        its tokens, which waits for the stream)."""
        return self.to_host(drafts) if self.fill_inputs is not None and len(drafts) else None

    def prepare(self, chunks: list[ScheduledChunk], table_width: int = 0, pending: PendingTokens | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's tensors, all views of one upload (meta.packed). Also sets token_sources (int64 [num_decode]:
        where `pending` holds decode row i's token, else -1) and any_pending."""
        bs = self.block_size
        ids, positions, slot_blocks = [], [], []
        for c in chunks:
            pos = range(c.start, c.start + len(c.token_ids))
            ids += c.token_ids
            positions += pos
            slot_blocks += [c.block_ids[p // bs] for p in pos]
        num_decode = sum(map(is_decode, chunks))
        decodes, prefills = chunks[:num_decode], chunks[num_decode:]
        num_draft = num_decode if self.policy.wants_drafts else 0
        if num_draft:  # a chunk without a guess (a one-token prompt) repeats its own token
            ids += [c.token_ids[0] if c.draft_token_id is None else c.draft_token_id for c in decodes]
            positions += [c.start + 1 for c in decodes]
        decode_lens = [c.start + 1 for c in decodes]
        host_slots = np.array(slot_blocks, dtype=np.int64)
        host_positions = np.array(positions, dtype=np.int64)
        sources = token_sources(decodes, pending)
        self.any_pending = bool((sources >= 0).any())
        packed, (ids_t, pos_t, slots_t, offsets_t, tables_t, lens_t, self.token_sources) = self.upload([
            np.array(ids, dtype=np.int64), host_positions, host_slots, host_positions[:len(slot_blocks)] % bs,
            self.tables.build(decodes, table_width), np.array(decode_lens, dtype=np.int32), sources])
        meta = AttentionMetadata(
            slot_blocks=slots_t, slot_offsets=offsets_t, num_decode=num_decode, decode_block_tables=tables_t,
            decode_seq_lens=lens_t, decode_max_seq_len=max(decode_lens, default=0), decode_seq_lens_host=decode_lens,
            prefills=self.prefill_spans(prefills, num_decode), decode_request_ids=[c.request_id for c in decodes],
            num_draft=num_draft, packed=packed)
        return ids_t, pos_t, meta

    def prefill_spans(self, prefills: list[ScheduledChunk], first_token: int) -> list[PrefillSpan]:
        spans, t = [], first_token
        for c in prefills:
            n = len(c.token_ids)
            used = -(-(c.start + n) // self.block_size)
            blocks = torch.tensor(c.block_ids[:used], dtype=torch.long).to(self.device, non_blocking=True)
            spans.append(PrefillSpan(t, t + n, c.start, blocks, c.block_ids[:used], c.request_id, c.sample))
            t += n
        return spans


@dataclass
class PendingTokens:
    """A step's sampled tokens while still on the device (async scheduling: engine/overlap.py)."""
    tokens: torch.Tensor  # int64 [S] on the device
    row_of: dict[str, int]  # request id -> its row in tokens


def token_sources(decodes: list[ScheduledChunk], pending: PendingTokens | None) -> np.ndarray:
    """int64 [len(decodes)]: the row of `pending` that holds each decode's token, or -1 (a token the host has)."""
    sources = np.full(len(decodes), -1, dtype=np.int64)
    for i, c in enumerate(decodes):
        if c.token_ids[0] == PENDING_TOKEN:
            if pending is None or c.request_id not in pending.row_of:
                raise RuntimeError(f"request {c.request_id}'s token at {c.start} is pending, but no step holds it")
            sources[i] = pending.row_of[c.request_id]
    return sources


def fill_pending(ids: torch.Tensor, sources: torch.Tensor, tokens: torch.Tensor) -> None:
    """ids[i] = tokens[sources[i]] where sources[i] >= 0 (the decode rows come first in ids)."""
    head = ids[:len(sources)]
    head.copy_(torch.where(sources >= 0, tokens[sources.clamp(min=0)], head))


def is_decode(c: ScheduledChunk) -> bool:
    """One generated token that samples the next. A one-token piece of a prompt is a prefill: a piece that a step's
    last budget token leaves (the tiered modes must write it to the host store, where the prompt's later chunks read
    their prefix), and the prompt's last token alone (as a decode it attended to the sparse modes' selection, where
    in a longer chunk it attends to the whole prefix: the chunking changed the output)."""
    return len(c.token_ids) == 1 and c.sample and not c.prefill


def order_decodes_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    return [c for c in chunks if is_decode(c)] + [c for c in chunks if not is_decode(c)]


def block_table_array(tables: list[list[int]], width: int = 0) -> np.ndarray:
    """int32 [len(tables), width]: each list, zero-padded (width 0: the longest list's). Built in numpy
    in one pass: converting each list with torch.tensor took most of a decode step's host time at 16K."""
    lengths = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    width = max(width, int(lengths.max(initial=0)), 1)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width)[None, :] < lengths[:, None]] = flat  # row-major: each row's list in order
    return out


class KeptTables:
    """The decode block tables as block_table_array makes them, from rows kept between steps. A request's table
    only grows until it is preempted (ScheduledChunk.table_epoch), so a step converts only its new blocks: turning
    every request's whole list into an array again took 0.56 ms a step at 16 x 16K on the H200's host (cProfile,
    docs/BENCHMARKS.md, thirteenth session)."""

    def __init__(self):
        self.rows: dict[tuple[str, int], tuple[np.ndarray, int]] = {}  # (request, epoch) -> (row, blocks in it)

    def build(self, decodes: list[ScheduledChunk], width: int = 0) -> np.ndarray:
        longest = max((len(c.block_ids) for c in decodes), default=0)
        out = np.zeros((len(decodes), max(width, longest, 1)), dtype=np.int32)
        kept = {}
        for i, c in enumerate(decodes):
            key, n = (c.request_id, c.table_epoch), len(c.block_ids)
            row, done = self.rows.get(key, (None, 0)) if c.table_epoch is not None else (None, 0)
            if done > n:  # (defensive: a table never shrinks within an epoch) converted whole
                row, done = None, 0
            if row is None or len(row) < n:
                grown = np.empty(max(2 * n, 64), dtype=np.int32)
                if done:
                    grown[:done] = row[:done]
                row = grown
            row[done:n] = c.block_ids[done:]
            if c.table_epoch is not None:
                kept[key] = (row, n)
            out[i, :n] = row[:n]
        self.rows = kept  # requests that did not decode this step are dropped
        return out
