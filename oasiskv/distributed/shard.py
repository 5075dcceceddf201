"""What each rank keeps of a model, and sharding a loaded (full) model in place.

Attention: query heads split evenly; KV heads split evenly too, or, when there are fewer KV heads
than ranks, each KV head is replicated on the ranks whose query heads read it. The MLP's
intermediate columns split evenly. The vocabulary splits into ceil(V / N)-row ranges."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from oasiskv.config import ModelConfig
from oasiskv.distributed.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from oasiskv.models.linear import Linear
from oasiskv.models.llama import CausalLM


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    q_heads: range
    kv_heads: range
    mlp_columns: range
    vocab_rows: range  # may run past the vocabulary (padding rows)
    kv_replicas: int  # ranks holding each KV head (1: KV heads are split, not replicated)


def check_shardable(cfg: ModelConfig, world: int) -> None:
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {world}")
    problems = []
    if cfg.num_heads % world:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (they must divide by, or into, the size)")
    if cfg.intermediate_size % world:
        problems.append(f"an MLP of {cfg.intermediate_size} columns")
    if problems:
        raise ValueError(f"--tensor-parallel-size {world} does not divide {' and '.join(problems)}")


def plan_shard(cfg: ModelConfig, rank: int, world: int) -> Shard:
    check_shardable(cfg, world)
    q = cfg.num_heads // world
    if cfg.num_kv_heads >= world:
        kv = cfg.num_kv_heads // world
        kv_heads = range(rank * kv, (rank + 1) * kv)
    else:  # replicated: the one KV head this rank's query heads belong to
        first = rank * q // cfg.group_size
        kv_heads = range(first, first + 1)
    mlp = cfg.intermediate_size // world
    vocab = -(-cfg.vocab_size // world)
    return Shard(rank, world, range(rank * q, (rank + 1) * q), kv_heads, range(rank * mlp, (rank + 1) * mlp),
                 range(rank * vocab, (rank + 1) * vocab), max(1, world // cfg.num_kv_heads))


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The model as this rank's KV storage sees it: its query and KV heads only."""
    return dataclasses.replace(cfg, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads))


def shard_model(model: CausalLM, shard: Shard) -> None:
    """Replaces the full weights of a loaded model by this rank's share (the full ones are freed)."""
    cfg = model.config
    d = cfg.head_dim
    q_rows = rows_of(shard.q_heads, d)
    kv_rows = rows_of(shard.kv_heads, d)
    mlp = torch.arange(shard.mlp_columns.start, shard.mlp_columns.stop)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj = column_slice(attn.q_proj, q_rows)
        attn.k_proj = column_slice(attn.k_proj, kv_rows)
        attn.v_proj = column_slice(attn.v_proj, kv_rows)
        attn.o_proj = row_slice(attn.o_proj, q_rows)
        attn.num_heads, attn.num_kv_heads = len(shard.q_heads), len(shard.kv_heads)
        layer.mlp.gate_proj = column_slice(layer.mlp.gate_proj, mlp)
        layer.mlp.up_proj = column_slice(layer.mlp.up_proj, mlp)
        layer.mlp.down_proj = row_slice(layer.mlp.down_proj, mlp)
    embed = model.model.embed_tokens.weight
    model.model.embed_tokens = VocabParallelEmbedding(vocab_slice(embed, shard.vocab_rows), shard.vocab_rows.start,
                                                      max(0, min(cfg.vocab_size - shard.vocab_rows.start,
                                                                 len(shard.vocab_rows))))
    head = model.model.embed_tokens.weight if model.lm_head is None else \
        nn.Parameter(vocab_slice(model.lm_head.weight, shard.vocab_rows), requires_grad=False)
    model.lm_head = VocabParallelHead(head, cfg.vocab_size)
    if embed.is_cuda:
        torch.cuda.empty_cache()


def rows_of(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def column_slice(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """Output rows `rows` of a linear layer (a column-parallel shard)."""
    w = linear.weight
    out = Linear(w.shape[1], len(rows), bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    out.weight.data = w[rows.to(w.device)].clone()
    if linear.bias is not None:
        out.bias.data = linear.bias[rows.to(w.device)].clone()
    return out.requires_grad_(False)


def row_slice(linear: nn.Linear, columns: torch.Tensor) -> RowParallelLinear:
    """Input columns `columns` of a bias-free linear layer; outputs summed over ranks."""
    if linear.bias is not None:
        raise ValueError("a row-parallel layer with a bias is not supported")
    w = linear.weight
    out = RowParallelLinear(len(columns), w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight.data = w[:, columns.to(w.device)].clone()
    return out.requires_grad_(False)


def vocab_slice(weight: torch.Tensor, rows: range) -> torch.Tensor:
    """Rows `rows` of a [V, H] matrix, zero rows past V."""
    out = weight.new_zeros(len(rows), weight.shape[1])
    real = weight[rows.start: min(rows.stop, weight.shape[0])]
    out[: len(real)] = real
    return out
