"""Dense policy: the full KV cache on the device, every query attends to every earlier token."""
from __future__ import annotations

import torch

from oasiskv.kernels.kv_write import write_kv_reference, write_kv_slots
from oasiskv.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from oasiskv.kv.gpu_pool import KVPool
from oasiskv.policies.attention import sdpa
from oasiskv.policies.base import AttentionMetadata, KVPolicy, PrefillSpan, length_bucket


def write_kv(kv_layer: torch.Tensor, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
    write = write_kv_slots if kv_layer.is_cuda else write_kv_reference
    write(kv_layer, meta.slot_blocks, meta.slot_offsets, k, v)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                      span: PrefillSpan, scale: float) -> torch.Tensor:
    """Causal attention of one prefill chunk over its request's cached prefix and itself."""
    n, start = q.shape[0], span.start_pos
    if start == 0:
        return causal_attention(q, k, v, scale)
    ctx = start + n
    blocks = kv_layer[span.block_ids]  # [nb, 2, bs, Hkv, D]
    k = blocks[:, 0].reshape(-1, *k.shape[1:])[:ctx]
    v = blocks[:, 1].reshape(-1, *v.shape[1:])[:ctx]
    return sdpa(q, k, v, scale, causal=True)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return sdpa(q, k, v, scale, causal=True)


class DensePolicy(KVPolicy):
    name = "dense"

    def __init__(self, pool: KVPool, scale: float):
        self.pool, self.scale = pool, scale
        self.use_triton = pool.kv.is_cuda

    def graph_key(self):
        return ("dense", length_bucket(self.meta.decode_max_seq_len))

    def attend(self, layer, q, k, v):
        kv_layer = self.pool.layer(layer)
        meta = self.meta
        write_kv(kv_layer, meta, k, v)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            args = (q[:nd], kv_layer, meta.decode_block_tables, meta.decode_seq_lens, self.scale)
            if self.use_triton:
                out[:nd] = paged_decode_attention(*args, max_seq_len=length_bucket(meta.decode_max_seq_len))
            else:
                out[:nd] = paged_decode_reference(*args)
        for span in meta.prefills:
            s, e = span.token_start, span.token_end
            out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], kv_layer, span, self.scale)
        return out
