"""Builds the KV storage and the policy for a --kv-mode, and sizes them from the memory budgets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from oasiskv.config import CacheConfig, KVConfig, ModelConfig
from oasiskv.kv.block_allocator import BlockAllocator
from oasiskv.kv.gpu_pool import GiB, KVPool, bytes_per_block
from oasiskv.kv.host_store import HostStore, spare_host_bytes
from oasiskv.kv.summaries import BlockSummaries
from oasiskv.kv.working_set import WorkingSet
from oasiskv.policies.base import KVPolicy
from oasiskv.policies.dense import DensePolicy
from oasiskv.policies.oasis import OasisPolicy
from oasiskv.policies.oracle import OraclePolicy
from oasiskv.policies.per_kv_head import lane_config, lane_kv_config, per_kv_head
from oasiskv.policies.sparse import QuestPolicy
from oasiskv.policies.tiered import RetrievalPolicy


@dataclass
class KVSetup:
    policy: KVPolicy
    allocator: BlockAllocator  # hands out the block ids the scheduler tracks (pool or host store)
    max_running: int  # requests that can run at once (retrieval: working-set rows)
    pool: KVPool
    host: HostStore | None
    description: str


def build_kv(model_cfg: ModelConfig, cache: CacheConfig, kv: KVConfig, gpu_kv_blocks: int, max_model_len: int,
             max_num_seqs: int, dtype: torch.dtype, device: torch.device, timing: bool = True,
             **tiered) -> KVSetup:
    """gpu_kv_blocks: how many KV blocks the device memory left for KV can hold. timing: phase timers
    (on the GPU they synchronise, so CUDA graphs need them off). `tiered` goes to build_retrieval
    (retrieval and oasis modes)."""
    kv.validate(cache.block_size, model_cfg.num_layers)
    bs, scale, parts = cache.block_size, model_cfg.head_dim ** -0.5, kv.summary_parts(cache.block_size)
    lanes = model_cfg.num_kv_heads if kv.select_per == "kv-head" else 1
    if lanes > 1:  # storage for one KV head a layer; the policy runs once per KV head (policies/per_kv_head.py)
        model_cfg, kv = lane_config(model_cfg), lane_kv_config(kv, lanes)
    if kv.mode == "dense":
        pool = KVPool(model_cfg, gpu_kv_blocks, bs, dtype, device)
        return KVSetup(DensePolicy(pool, scale), BlockAllocator(gpu_kv_blocks), max_num_seqs, pool, None,
                       f"dense: {gpu_kv_blocks} GPU blocks")
    if kv.mode in ("quest", "oracle"):  # oracle: quest's storage, exact attention mass for scores
        # room for the summaries: each block's `parts` cost parts / block_size of the block
        blocks = gpu_kv_blocks if cache.num_kv_blocks else gpu_kv_blocks * bs // (bs + parts)
        pool = KVPool(model_cfg, blocks, bs, dtype, device)
        summaries = BlockSummaries(model_cfg, blocks, dtype, device, parts)
        policy_class = per_kv_head(OraclePolicy if kv.mode == "oracle" else QuestPolicy, lanes)
        policy = policy_class(pool, kv, summaries, bs, scale, device, timing)
        return KVSetup(policy, BlockAllocator(blocks), max_num_seqs, pool, None, f"{kv.mode}: {blocks} GPU blocks")
    tiered["policy_class"] = per_kv_head(tiered.get("policy_class") or tiered_policy(kv), lanes)
    return build_retrieval(model_cfg, cache, kv, gpu_kv_blocks, max_model_len, max_num_seqs, dtype, device, timing,
                           **tiered)


def tiered_policy(kv: KVConfig) -> type:
    return OasisPolicy if kv.mode == "oasis" else RetrievalPolicy


def build_retrieval(model_cfg, cache, kv, gpu_kv_blocks, max_model_len, max_num_seqs, dtype, device,
                    timing: bool = True, policy_class=None, store_blocks: int | None = None,
                    prefill_chunk: int = 0) -> KVSetup:
    """policy_class replaces the mode's policy; store_blocks sizes the host store apart from the block
    ids handed out (a decode instance keeps only part of each request's KV: disagg/local.py); prefill_chunk:
    --max-num-batched-tokens, the longest prefill chunk (0: unknown)."""
    bs, per_block = cache.block_size, bytes_per_block(model_cfg, cache.block_size, dtype)
    host_blocks = host_block_count(cache, kv, per_block, device)
    # oasis: room for the block a draft token opens
    width = kv.working_set_blocks(model_cfg.num_layers, bs) + (kv.mode == "oasis")
    parts = kv.summary_parts(bs)
    summary_blocks = -(-host_blocks * parts // bs)  # summaries cost parts / block_size of the KV they describe
    # a block of the pool holds block_size tokens of every layer, as the keep does
    keep_blocks = prefill_keep_blocks(kv, max_model_len, prefill_chunk, gpu_kv_blocks - summary_blocks, width, bs)
    keep_tokens = keep_blocks * bs
    rows = min(max_num_seqs, (gpu_kv_blocks - summary_blocks - keep_blocks) // width)
    if rows < 1:
        where = "the GPU" if device.type == "cuda" else "the KV pool"
        beyond = f" (--kv-budget {kv.budget} is beyond --max-model-len {max_model_len})" \
            if kv.budget > max_model_len else ""
        raise ValueError(f"{where} has room for {gpu_kv_blocks} KV blocks: not enough for the summaries of "
                         f"{host_blocks} host blocks, {keep_blocks} blocks of prefill keep (--prefill-keep-tokens "
                         f"{keep_tokens}) plus one working set of {width} blocks{beyond}; lower --kv-budget or "
                         "--working-set, or give the KV more memory (--kv-cache-gb, --gpu-memory-gb)")
    pool = KVPool(model_cfg, rows * width, bs, dtype, device)
    host = HostStore(model_cfg, store_blocks or host_blocks, bs, dtype, pin=device.type == "cuda")
    ws = WorkingSet(model_cfg.num_layers, rows, width, -(-max_model_len // bs) + 1, device)
    summaries = BlockSummaries(model_cfg, host_blocks, dtype, device, parts)
    policy_class = policy_class or tiered_policy(kv)
    kv = dataclasses.replace(kv, prefill_keep_tokens=keep_tokens)
    policy = policy_class(pool, host, ws, kv, summaries, bs, model_cfg.head_dim ** -0.5, device, timing)
    return KVSetup(policy, BlockAllocator(host_blocks), rows, pool, host,
                   f"{kv.mode}: {host_blocks} host blocks ({host.kv.numel() * host.kv.element_size() / GiB:.1f} GiB), "
                   f"{rows} working sets of {width} blocks on the GPU, prefill keep of {keep_tokens} tokens")


KEEP_SHARE = 0.1  # the default prefill keep takes at most this share of the GPU's room for KV


def prefill_keep_blocks(kv: KVConfig, max_model_len: int, prefill_chunk: int, room_blocks: int, width: int,
                        bs: int) -> int:
    """Blocks of prefill keep (policies/tiered.py): --prefill-keep-tokens in whole blocks; by default max_model_len
    where a prompt can take more than one chunk, within KEEP_SHARE of `room_blocks` (the GPU's room beside the
    summaries) and within what one working set of `width` blocks leaves: it never stops a configuration running."""
    if kv.prefill_keep_tokens is not None:
        return -(-kv.prefill_keep_tokens // bs)
    if max_model_len <= prefill_chunk:
        return 0
    return max(0, min(-(-max_model_len // bs), int(KEEP_SHARE * room_blocks), room_blocks - width))


def host_block_count(cache: CacheConfig, kv: KVConfig, per_block: int, device: torch.device) -> int:
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if kv.host_kv_gb is not None:
        budget = kv.host_kv_gb * GiB
    elif device.type == "cuda":
        budget = spare_host_bytes()
    else:
        budget = min(spare_host_bytes(), cache.cpu_kv_cache_gb * GiB)
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(f"no host memory for the KV store ({budget / GiB:.2f} GiB); set --host-kv-gb")
    return blocks
