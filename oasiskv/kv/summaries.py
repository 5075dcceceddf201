"""Block summaries (Quest): per block and KV head, the element-wise min and max of the block's keys.
Kept on the GPU for every block of every running request, indexed like the block ids the
scheduler hands out (physical pool blocks in quest mode, host-store blocks in retrieval mode).

With `parts` > 1 (--summary-tokens) each block has `parts` summaries, one per run of block_size / parts
tokens: sub-block b x parts + p summarises tokens p x sub .. (p + 1) x sub - 1 of block b. Blocks stay the
unit of selection and transfer; the score kernels fold a block's parts into its one score."""
from __future__ import annotations

import torch

from oasiskv.config import ModelConfig
from oasiskv.policies.base import PrefillSpan
from oasiskv.kernels.block_summary import update_block_summaries, update_block_summaries_reference


class BlockSummaries:
    def __init__(self, cfg: ModelConfig, num_blocks: int, dtype: torch.dtype, device: torch.device, parts: int = 1):
        self.parts = parts
        self.data = torch.zeros(cfg.num_layers, num_blocks * parts, 2, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                                device=device)
        self.use_triton = device.type == "cuda"

    def layer(self, i: int) -> torch.Tensor:
        """[blocks x parts, 2, Hkv, D]: index 0 = min, 1 = max."""
        return self.data[i]

    def merge_spans(self, layer: int, spans: list[PrefillSpan], k: torch.Tensor, block_size: int) -> None:
        """Folds each prefill chunk's keys (k: the flat batch's, [T, Hkv, D]) into its blocks' summaries:
        a block whose first token is in the chunk starts afresh, one continued from an earlier chunk keeps
        what it had (min/max merge, exact). Whole blocks are reduced in one pass over [blocks, block_size]
        (a scatter took 33 ms per 16K-token prefill of an 8B model). Nothing here waits for the device: such a
        sync's small copy to the host queued behind the prefill's host-store DMA (HostStore.write_span) in
        every layer."""
        s = self.data[layer]
        if self.parts > 1:  # sub-blocks are blocks of block_size / parts tokens
            parts = torch.arange(self.parts, device=spans[0].block_ids.device) if spans else None
            spans = [PrefillSpan(sp.token_start, sp.token_end, sp.start_pos,
                                 (sp.block_ids[:, None] * self.parts + parts).flatten(), []) for sp in spans]
            block_size //= self.parts
        for span in spans:
            keys = k[span.token_start: span.token_end]  # reduced in their own dtype, converted after: exact
            start, end = span.start_pos, span.start_pos + len(keys)
            first, last = -(-start // block_size), end // block_size  # whole blocks [first, last)
            if first < last:
                whole = keys[first * block_size - start: last * block_size - start]
                whole = whole.view(last - first, block_size, *keys.shape[1:])
                s[span.block_ids[first:last]] = torch.stack([whole.amin(1), whole.amax(1)], dim=1).to(s.dtype)
            head_end = min(first * block_size, end)
            if head_end > start:  # the rest of a block an earlier chunk started
                head, row = keys[: head_end - start], span.block_ids[start // block_size: start // block_size + 1]
                s[row, 0] = torch.minimum(s[row, 0], head.amin(0).to(s.dtype))
                s[row, 1] = torch.maximum(s[row, 1], head.amax(0).to(s.dtype))
            if end > max(last * block_size, start) and last >= first:  # a block this chunk starts, unfinished
                tail, row = keys[last * block_size - start:], span.block_ids[last: last + 1]
                s[row] = torch.stack([tail.amin(0), tail.amax(0)])[None].to(s.dtype)

    def merge_tokens(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                     block_size: int | None = None) -> None:
        """The same, token by token (the reference): token i goes to blocks[i] at offsets[i]; a block that
        receives its offset 0 starts afresh. Waits for the device (boolean indexing). block_size: with parts."""
        if self.parts > 1:
            sub = block_size // self.parts
            blocks, offsets = blocks * self.parts + offsets // sub, offsets % sub
        s = self.data[layer]
        fresh = blocks[offsets == 0]
        s[fresh, 0] = float("inf")
        s[fresh, 1] = float("-inf")
        index = blocks[:, None, None].expand_as(k)
        s[:, 0].scatter_reduce_(0, index, k.to(s.dtype), reduce="amin")
        s[:, 1].scatter_reduce_(0, index, k.to(s.dtype), reduce="amax")

    def update_from(self, layer: int, kv_layer: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor,
                    summary_ids: torch.Tensor) -> None:
        """Recomputes the summaries of blocks held in kv_layer[slots] (the decode tail blocks) from
        their first num_tokens keys, into rows summary_ids (with parts: the sub-block the last key is in)."""
        update = update_block_summaries if self.use_triton else update_block_summaries_reference
        if self.parts == 1:
            update(self.data[layer], kv_layer, slots, num_tokens, summary_ids=summary_ids)
            return
        sub = kv_layer.shape[2] // self.parts
        part = (num_tokens - 1) // sub
        update(self.data[layer], kv_layer, slots, num_tokens, summary_ids=summary_ids * self.parts + part,
               first_token=part * sub)
