"""One selection per KV head (--select-per kv-head).

The sparse policies select blocks per request and layer: all KV heads of the layer attend to the same
blocks, ranked by all heads' scores together. Per KV head, each head gets its own selection and its own
budget. The policies need no change for it: their storage (pool, host store, summaries, working set) is
built for a "lane" model whose every layer is split into its KV heads, one KV head per lane
(lane = layer x kv_heads + head), and attend() runs the policy once per lane on that head's group of
query heads. A block of the lane model costs what a block of the model costs, so memory budgets, block
ids and the scheduler are unchanged; host chunks and transfers are per lane (1/kv_heads of a block), and
block counters count lane blocks. Per-layer lists (agreement) come per lane from the policy: stats() keeps
them as [layer][KV head] under `*_per_kv_head` and gives each layer's mean under `*_per_layer`."""
from __future__ import annotations

import dataclasses
import functools

import torch

from oasiskv.config import KVConfig, ModelConfig


def lane_config(cfg: ModelConfig) -> ModelConfig:
    """The model seen by per-KV-head storage: kv_heads times the layers, one KV head and its query group each."""
    return dataclasses.replace(cfg, num_layers=cfg.num_layers * cfg.num_kv_heads, num_kv_heads=1,
                               num_heads=cfg.num_heads // cfg.num_kv_heads)


def lane_kv_config(kv: KVConfig, kv_heads: int) -> KVConfig:
    """The first --dense-layers layers are their first dense_layers x kv_heads lanes; a layer's --layer-weights
    weight is each of its lanes' (so each lane gets its layer's budget)."""
    weights = tuple((layer * kv_heads + head, w) for layer, w in kv.layer_weights for head in range(kv_heads))
    return dataclasses.replace(kv, dense_layers=kv.dense_layers * kv_heads, layer_weights=weights)


class PerKVHead:
    """Put before a policy class (per_kv_head() does): its attend() runs once per lane."""

    kv_heads = 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // self.kv_heads
        out = torch.empty_like(q)
        for head in range(self.kv_heads):
            queries = slice(head * group, (head + 1) * group)
            out[:, queries] = super().attend(layer * self.kv_heads + head, q[:, queries].contiguous(),
                                             k[:, head:head + 1].contiguous(), v[:, head:head + 1].contiguous())
        return out

    def stats(self) -> dict:
        # a layer's KV heads each select as many blocks, so the mean of their ratios is the layer's ratio
        out = super().stats()
        for key in [k for k, v in out.items() if k.endswith("_per_layer") and isinstance(v, list)]:
            lanes = out[key]
            per_head = [lanes[i:i + self.kv_heads] for i in range(0, len(lanes), self.kv_heads)]
            out[key.removesuffix("_per_layer") + "_per_kv_head"] = per_head
            out[key] = [mean_or_none(heads) for heads in per_head]
        return out


def mean_or_none(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 6) if known else None


@functools.cache
def per_kv_head(policy_class: type, kv_heads: int) -> type:
    """policy_class with one selection per KV head of a model with kv_heads KV heads a layer (one KV head: itself)."""
    if kv_heads == 1:
        return policy_class
    return type(f"PerKVHead{policy_class.__name__}", (PerKVHead, policy_class), {"kv_heads": kv_heads})
