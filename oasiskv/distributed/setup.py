"""What the engine does differently on a rank of a tensor-parallel group, in one place."""
from __future__ import annotations

import dataclasses

import torch

from oasiskv.config import CacheConfig, KVConfig, ModelConfig
from oasiskv.distributed.group import TensorParallel
from oasiskv.distributed.scores import ScoreCombiner
from oasiskv.distributed.shard import local_config, plan_shard, shard_model
from oasiskv.kv.host_store import GiB, spare_host_bytes
from oasiskv.models.llama import CausalLM
from oasiskv.policies.base import KVPolicy


@dataclasses.dataclass
class RankSetup:
    kv_model_config: ModelConfig  # this rank's heads: what its KV pool, summaries and host store hold
    cache: CacheConfig
    kv: KVConfig


def shard_for_rank(model: CausalLM, cache: CacheConfig, kv: KVConfig, tp: TensorParallel,
                   device: torch.device) -> RankSetup:
    """Shards the loaded model to this rank and splits the memory totals the user gave over ranks."""
    shard = plan_shard(model.config, tp.rank, tp.world)
    shard_model(model, shard)
    cache, kv = split_kv_budgets(cache, kv, tp, device)
    return RankSetup(local_config(model.config, shard), cache, kv)


def split_kv_budgets(cache: CacheConfig, kv: KVConfig, tp: TensorParallel, device: torch.device
                     ) -> tuple[CacheConfig, KVConfig]:
    """--kv-cache-gb, the CPU pool default and --host-kv-gb are totals over all ranks: each rank gets
    an equal share (with KV heads split, the same number of blocks as one process). The host-store
    default (what the machine can spare) is measured by every rank and the smallest share taken, so
    all ranks build stores of the same number of blocks."""
    n = tp.world
    cache = dataclasses.replace(cache, cpu_kv_cache_gb=cache.cpu_kv_cache_gb / n,
                                kv_cache_gb=None if cache.kv_cache_gb is None else cache.kv_cache_gb / n)
    if not kv.offloaded or cache.num_kv_blocks is not None:
        return cache, kv
    if kv.host_kv_gb is not None:
        return cache, dataclasses.replace(kv, host_kv_gb=kv.host_kv_gb / n)
    spare = spare_host_bytes() / GiB / n  # all ranks share one host
    share = spare if device.type == "cuda" else min(spare, cache.cpu_kv_cache_gb)
    return cache, dataclasses.replace(kv, host_kv_gb=tp.agree_min(share))


def attach_score_combiner(policy: KVPolicy, tp: TensorParallel, model_config: ModelConfig) -> None:
    """Sparse policies combine their per-rank block scores into the model's, on every rank."""
    shard = plan_shard(model_config, tp.rank, tp.world)
    if policy.name == "dense":
        return
    policy.combine_scores = tp.combiner = ScoreCombiner(tp.world, shard.kv_replicas, timed=tp.device.type == "cpu")
