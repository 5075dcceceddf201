"""Attention of a run of queries over contiguous K/V (prefill, a later prefill chunk, the draft head's chunks)
through torch's fused SDPA kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# A later chunk of at least this many queries runs split_causal_attention on CUDA. H200, bf16: on qwen3-8b's heads
# the split ran 2048-8192 queries over 16K keys at 528-546 TFLOP/s against the masked kernel's 245-315; below 2048
# it lost on SmolLM2's heads (1024 queries over 8K keys: 461 us against 171) and at 512 queries on qwen3-8b's
# (docs/BENCHMARKS.md, thirty-third session).
SPLIT_MIN_QUERIES = 2048


def sdpa(q, k, v, scale, causal=False) -> torch.Tensor:
    """q [n, Hq, D], k/v [ctx, Hkv, D] -> [n, Hq, D]. Causal: the queries are the last n positions of the ctx keys,
    query i sees keys 0 .. ctx - n + i (a later prefill chunk over its cached prefix when n < ctx).

    Inputs are made 4-D so that CUDA picks a fused kernel, never the O(n^2) math path. In half precision on CUDA
    the kernel reads each K/V head for its group of query heads (enable_gqa); elsewhere the K/V heads are expanded
    to the query heads (the expansion wrote qwen3-8b's K and V four times over, 2 x 134 MB a layer of a 16K
    prefill: docs/BENCHMARKS.md, thirty-first session)."""
    n, ctx = q.shape[0], k.shape[0]
    if n > ctx:
        raise ValueError(f"sdpa: {n} queries over {ctx} keys")
    group = q.shape[1] // k.shape[1]
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    mask = None
    if causal and n == 1:
        causal = False  # the last position sees every key
    elif causal and n < ctx:
        if split_applies(q4, k4, v4):
            return split_causal_attention(q4, k4, v4, scale, cudnn_attention_with_lse)[0].transpose(0, 1)
        causal, mask = False, lower_right_causal_mask(n, ctx, q.device)
    native_gqa = group > 1 and half_precision_cuda(q)
    if group > 1 and not native_gqa:
        k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=native_gqa)
    return out[0].transpose(0, 1)


def half_precision_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)


def split_applies(q, k, v) -> bool:
    """Whether a later chunk ([1, H, n, D] queries, fewer than the keys) runs split_causal_attention."""
    return half_precision_cuda(q) and q.shape[2] >= SPLIT_MIN_QUERIES and cudnn_can_attend(q, k, v)


def lower_right_causal_mask(n: int, ctx: int, device) -> torch.Tensor:
    """[n, ctx] bool: query i (at position ctx - n + i) sees key j <= its position."""
    return torch.arange(ctx, device=device)[None, :] <= (ctx - n + torch.arange(n, device=device))[:, None]


def split_causal_attention(q, k, v, scale, attend) -> torch.Tensor:
    """[1, Hq, n, D] queries at the last n of the ctx positions of k/v [1, Hkv, ctx, D]: attention over the ctx - n
    keys before the chunk (every query sees all of them) and, causally, over the chunk's own n keys, merged into one
    softmax by the two parts' log-sum-exps. Neither part needs a mask, so both run the kernel that the masked
    form cannot (it reads the n x ctx mask and skips none of the hidden part).
    attend(q, k, v, scale, causal) -> (out [1, Hq, n, D], logsumexp of the scaled scores [1, Hq, n])."""
    prior = k.shape[2] - q.shape[2]
    before, lse_before = attend(q, k[:, :, :prior], v[:, :, :prior], scale, False)
    own, lse_own = attend(q, k[:, :, prior:], v[:, :, prior:], scale, True)
    lse_before, lse_own = (lse.reshape(*q.shape[:3], 1) for lse in (lse_before, lse_own))  # float32 from cuDNN
    top = torch.maximum(lse_before, lse_own)
    w_before, w_own = torch.exp(lse_before - top), torch.exp(lse_own - top)
    return ((before * w_before + own * w_own) / (w_before + w_own)).to(q.dtype)


def cudnn_attention_with_lse(q, k, v, scale, causal):
    """cuDNN's fused attention, which also returns the log-sum-exp (torch's public SDPA does not)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def cudnn_can_attend(q, k, v) -> bool:
    """Whether torch would run cuDNN's attention on these shapes and dtypes, K/V heads read per group."""
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, q.shape[1] != k.shape[1])
    return torch.backends.cuda.can_use_cudnn_attention(params)
