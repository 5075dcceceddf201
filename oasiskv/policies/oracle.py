"""Oracle policy (eval only): the upper bound of block selection at a budget.

Like quest, the full KV stays on the GPU and nothing moves; the only difference is how blocks are
scored. Instead of Quest's upper bound over block summaries, the oracle computes the exact attention
the current decode query pays to every block: per query head, the softmax mass over all keys (the
new token's included) summed inside each block; heads are combined as quest combines its scores
(the best query head of each KV-head group, summed over KV heads), and the selection rule is
quest's: sink blocks + local window with the tail + the top-scored remaining blocks."""
from __future__ import annotations

import torch

from oasiskv.policies.sparse import QuestPolicy


def attention_mass_per_head(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact attention mass each query head pays each logical block, one decode query per sequence.

    q [B, Hq, D]; kv_layer [blocks, 2, block_size, Hkv, D]; block_tables int [B, max_blocks];
    seq_lens int [B] (the new token included). Returns fp32 [B, Hkv, group, max_blocks]: per head, the
    softmax over all keys of ``scale * q_h . k_t``, summed inside each block (0 past the end)."""
    bsz, hq, d = q.shape
    _, _, block_size, hkv, _ = kv_layer.shape
    max_blocks = block_tables.shape[1]
    if hq % hkv or kv_layer.shape[-1] != d:
        raise ValueError(f"q [B, {hq}, {d}] does not fit kv_layer heads {hkv} x head_dim {kv_layer.shape[-1]}")
    keys = kv_layer[block_tables.long().clamp(min=0), 0].float()  # [B, nb, bs, Hkv, D]
    keys = keys.reshape(bsz, max_blocks * block_size, hkv, d)
    logits = torch.einsum("bghd,btgd->bght", q.float().view(bsz, hkv, hq // hkv, d), keys) * scale
    positions = torch.arange(max_blocks * block_size, device=q.device)
    past_end = positions[None, :] >= seq_lens.to(q.device).long()[:, None]  # [B, T]
    logits = logits.masked_fill(past_end[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).view(bsz, hkv, hq // hkv, max_blocks, block_size).sum(-1)


def attention_mass_scores(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact attention mass of each logical block for one decode query per sequence (arguments as
    :func:`attention_mass_per_head`). Returns fp32 [B, max_blocks]:
    ``sum_g max_{h in group g} sum_{t in block} softmax_t(scale * q_h . k_t)``, ``-inf`` for blocks
    at or past the sequence's end."""
    mass = attention_mass_per_head(q, kv_layer, block_tables, seq_lens, scale)
    scores = mass.amax(dim=2).sum(dim=1)  # [B, max_blocks]
    block_size, max_blocks = kv_layer.shape[2], block_tables.shape[1]
    num_blocks = (seq_lens.to(q.device).long() + block_size - 1) // block_size
    return scores.masked_fill(torch.arange(max_blocks, device=q.device)[None, :] >= num_blocks[:, None],
                              float("-inf"))


class OraclePolicy(QuestPolicy):
    name = "oracle"

    def local_scores(self, layer: int, q: torch.Tensor, tables: torch.Tensor, nblocks: torch.Tensor) -> torch.Tensor:
        return attention_mass_scores(q, self.pool.layer(layer), tables, self.meta.decode_seq_lens, self.scale)
