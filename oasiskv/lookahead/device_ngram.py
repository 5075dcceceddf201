"""--draft ngram on the device: prompt lookup computed inside the step, from the step's own input tokens.

The host form (lookahead/ngram.py) proposes after each step's tokens reach the host: hash tables per
request, 0.18-0.23 ms of Python per step at b16 on the H200's host with propose_drafts, between one graph
and the next (docs/BENCHMARKS.md, fourteenth session). Here every token a step computes is written into a paged token
pool at the place its K/V go (the same block tables), and at the start of each decode step, before the
embedding, each decode row's draft is looked up from the pool (kernels/ngram_lookup.py) into the draft
rows of the step's input ids. In a replayed step both run inside the graph: the host does nothing.

Every token of a context passes through some step's input (the prompt through prefill, each output as
the next decode's input), except a prompt whose K/V came from elsewhere: write_prompt puts it in."""
from __future__ import annotations

import torch

from oasiskv.kernels.ngram_lookup import ngram_lookup, ngram_lookup_reference, write_step_tokens
from oasiskv.lookahead.base import DraftSource


class DeviceNgramDraft(DraftSource):
    name = "ngram"
    on_device = True

    def __init__(self, num_blocks: int, block_size: int, device: torch.device, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        # 4 bytes per token of KV capacity (a 16K-token request: 64 KiB)
        self.pool = torch.zeros(num_blocks, block_size, dtype=torch.int32, device=device)

    def fill(self, ids: torch.Tensor, meta) -> None:
        """Before the model: the step's real tokens into the pool, then each decode row's draft into its draft
        row (the last meta.num_draft rows of ids, which prepare filled with placeholders)."""
        real = len(ids) - meta.num_draft
        write_step_tokens(self.pool, meta.slot_blocks, meta.slot_offsets, ids[:real])
        if meta.num_draft:  # (on the CPU the torch twin: the kernel's own tests run it under the interpreter)
            lookup = ngram_lookup if self.pool.is_cuda else ngram_lookup_reference
            lookup(self.pool, meta.decode_block_tables, meta.decode_seq_lens, ids[real:], self.max_n, self.min_n)

    def write_prompt(self, block_ids: list[int], tokens: list[int]) -> None:
        """A prompt that no step computed here (its K/V came from a prefill instance)."""
        bs = self.pool.shape[1]
        positions = torch.arange(len(tokens))
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // bs]
        write_step_tokens(self.pool, blocks.to(self.pool.device), (positions % bs).to(self.pool.device),
                          torch.tensor(tokens, dtype=torch.int32, device=self.pool.device))

    def propose(self, chunks, captured) -> dict[str, int]:
        raise TypeError("DeviceNgramDraft drafts inside the step (fill), not after it")
