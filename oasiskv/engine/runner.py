"""Turns a scheduler plan (ints) into tensors, runs the model, returns logits rows to sample."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from oasiskv.engine.cuda_graph import DecodeGraphs
from oasiskv.engine.scheduler import ScheduledChunk, SchedulerOutput
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


class ModelRunner:
    def __init__(self, model: CausalLM, policy: KVPolicy, block_size: int, device: torch.device,
                 graphs: DecodeGraphs | None = None, max_blocks: int = 0):
        """graphs: replay decode-only steps from CUDA graphs; their block tables are then max_blocks wide."""
        self.model, self.policy, self.block_size, self.device = model, policy, block_size, device
        self.graphs, self.max_blocks = graphs, max_blocks
        self.capture_layers: tuple[int, ...] = ()
        self.guess_after_drafts = False  # also the target's argmax on the draft rows (--draft target)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        chunks = order_decodes_first(plan.chunks)
        graphable = self.graphs is not None and all(len(c.token_ids) == 1 and c.sample for c in chunks)
        ids, positions, meta = self.prepare(chunks, self.max_blocks if graphable else 0)
        self.policy.begin_step(meta)
        replayed = self.graphs.run(ids, positions, meta, self.capture_layers, self.guess_after_drafts) \
            if graphable else None
        real = len(ids) - meta.num_draft
        if replayed is not None:
            logits, captured, guesses = replayed
            return StepResult([c.request_id for c in chunks], logits, [c[:real] for c in captured], chunks, guesses)
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
        return StepResult(sampling, out[:len(ends)], captured, chunks, guesses)

    def prepare(self, chunks: list[ScheduledChunk], table_width: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids, positions, slot_blocks = [], [], []
        for c in chunks:
            pos = range(c.start, c.start + len(c.token_ids))
            ids += c.token_ids
            positions += pos
            slot_blocks += [c.block_ids[p // bs] for p in pos]
        num_decode = sum(1 for c in chunks if len(c.token_ids) == 1)
        decodes, prefills = chunks[:num_decode], chunks[num_decode:]
        num_draft = num_decode if self.policy.wants_drafts else 0
        if num_draft:  # a chunk without a guess (a one-token prompt) repeats its own token
            ids += [c.token_ids[0] if c.draft_token_id is None else c.draft_token_id for c in decodes]
            positions += [c.start + 1 for c in decodes]
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.long)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long).to(dev, non_blocking=True),
            slot_offsets=(pos_t[:len(slot_blocks)] % bs).to(dev, non_blocking=True),
            num_decode=num_decode,
            decode_block_tables=block_table_tensor([c.block_ids for c in decodes], table_width).to(dev, non_blocking=True),
            decode_seq_lens=torch.tensor([c.start + 1 for c in decodes], dtype=torch.int32).to(dev, non_blocking=True),
            decode_max_seq_len=max((c.start + 1 for c in decodes), default=0),
            decode_seq_lens_host=[c.start + 1 for c in decodes],
            prefills=self.prefill_spans(prefills, num_decode),
            decode_request_ids=[c.request_id for c in decodes],
            num_draft=num_draft,
        )
        return (torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True), pos_t.to(dev, non_blocking=True),
                meta)

    def prefill_spans(self, prefills: list[ScheduledChunk], first_token: int) -> list[PrefillSpan]:
        spans, t = [], first_token
        for c in prefills:
            n = len(c.token_ids)
            used = -(-(c.start + n) // self.block_size)
            blocks = torch.tensor(c.block_ids[:used], dtype=torch.long).to(self.device, non_blocking=True)
            spans.append(PrefillSpan(t, t + n, c.start, blocks, c.block_ids[:used]))
            t += n
        return spans


def order_decodes_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    return [c for c in chunks if len(c.token_ids) == 1] + [c for c in chunks if len(c.token_ids) > 1]


def block_table_tensor(tables: list[list[int]], width: int = 0) -> torch.Tensor:
    """int32 [len(tables), width]: each list, zero-padded (width 0: the longest list's). Built in numpy
    in one pass: converting each list with torch.tensor took most of a decode step's host time at 16K."""
    lengths = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    width = max(width, int(lengths.max(initial=0)), 1)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width)[None, :] < lengths[:, None]] = flat  # row-major: each row's list in order
    return torch.from_numpy(out)
