"""Block summaries (Quest): per block and KV head, the element-wise min and max of the block's keys.
Kept on the GPU for every block of every running request, indexed like the block ids the
scheduler hands out (physical pool blocks in quest mode, host-store blocks in retrieval mode)."""
from __future__ import annotations

import torch

from oasiskv.config import ModelConfig
from oasiskv.kernels.block_summary import update_block_summaries, update_block_summaries_reference


class BlockSummaries:
    def __init__(self, cfg: ModelConfig, num_blocks: int, dtype: torch.dtype, device: torch.device):
        self.data = torch.zeros(cfg.num_layers, num_blocks, 2, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                                device=device)
        self.use_triton = device.type == "cuda"

    def layer(self, i: int) -> torch.Tensor:
        """[blocks, 2, Hkv, D]: index 0 = min, 1 = max."""
        return self.data[i]

    def merge_prefill(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor) -> None:
        """Folds a prefill chunk's keys into its blocks' summaries. A block whose first token is in
        the chunk starts afresh; one continued from an earlier chunk keeps what it had (min/max merge,
        exact)."""
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
        their first num_tokens keys, into rows summary_ids."""
        update = update_block_summaries if self.use_triton else update_block_summaries_reference
        update(self.data[layer], kv_layer, slots, num_tokens, summary_ids=summary_ids)
