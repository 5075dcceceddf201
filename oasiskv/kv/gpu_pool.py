"""The paged KV pool: one tensor [layers, blocks, 2, block_size, kv_heads, head_dim], per-layer views."""
from __future__ import annotations

import torch

from oasiskv.config import CacheConfig, ModelConfig

GiB = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class KVPool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv = torch.zeros(cfg.num_layers, num_blocks, 2, block_size, cfg.num_kv_heads, cfg.head_dim,
                              dtype=dtype, device=device)

    def layer(self, i: int) -> torch.Tensor:
        """[blocks, 2, block_size, kv_heads, head_dim]; index 0 on dim 1 is K, 1 is V."""
        return self.kv[i]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def plan_num_blocks(model_cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device,
                    weights_bytes: int, activation_bytes: int) -> int:
    """How many blocks the pool gets, by the first sizing rule that is set (see CacheConfig)."""
    per_block = bytes_per_block(model_cfg, cache.block_size, dtype)
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_gb is not None:
        kv_bytes = cache.kv_cache_gb * GiB
    elif device.type != "cuda":
        kv_bytes = cache.cpu_kv_cache_gb * GiB
    else:
        total = torch.cuda.get_device_properties(device).total_memory
        cap = cache.gpu_memory_gb * GiB if cache.gpu_memory_gb is not None else cache.gpu_memory_utilization * total
        kv_bytes = cap - weights_bytes - activation_bytes
    blocks = int(kv_bytes // per_block)
    if blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {kv_bytes / GiB:.2f} GiB left after {weights_bytes / GiB:.2f} GiB of weights "
            f"and {activation_bytes / GiB:.2f} GiB of activations; raise --gpu-memory-utilization/--gpu-memory-gb "
            f"or set --kv-cache-gb"
        )
    return blocks
