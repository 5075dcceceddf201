"""Times the attention of a later prefill chunk (its queries over the cached prefix and itself) in the ways SDPA
can run it, at qwen3-8b's head shapes (bf16), and checks each against a float64 reference.

A chunk of n queries at positions ctx - n .. ctx - 1 sees keys 0 .. its own position: causal attention aligned to
the lower right of the n x ctx score matrix. Variants:
- `mask, K/V expanded`: a boolean n x ctx mask, K/V heads repeated to the query heads (the engine before);
- `mask, enable_gqa`: the same mask, each K/V head read for its group by the kernel;
- `lower_right, enable_gqa`: no mask; torch's `causal_lower_right` bias, which runs a kernel that skips the masked
  part of the matrix (flash or memory-efficient attention);
- `split, cuDNN + merge`: the chunk over the prefix without a mask and over itself causally (both cuDNN, K/V heads
  read per group), the two merged by their log-sum-exps;
- `engine sdpa`: policies/attention.sdpa, which picks one of the above by the chunk's size.

Prints microseconds per call, TFLOP/s of the scores the causal matrix needs (2 x 2 x heads x head_dim per visible
pair), the kernel that ran, and the largest error against float64 next to the first variant's.

    PYTHONPATH=. python3 scripts/gpu_chunk_attention_bench.py [--shapes 4096x8192,...] [--heads 32/8/128] [--json FILE]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from oasiskv.bench.report import print_table, write_json
from oasiskv.policies.attention import (cudnn_attention_with_lse, lower_right_causal_mask, sdpa,
                                        split_causal_attention)
from scripts.gpu_prefill_parts_bench import top_kernel
from scripts.gpu_rms_norm_bench import time_us

HEADS = (32, 8, 128)  # qwen3-8b: query heads, K/V heads, head dim
BF16 = torch.bfloat16


def heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)[None]


def split_merge(q, k, v, scale):
    return split_causal_attention(q, k, v, scale, cudnn_attention_with_lse)


def variants(q, k, v, scale):
    n, ctx = q.shape[0], k.shape[0]
    mask = lower_right_causal_mask(n, ctx, q.device)
    group = q.shape[1] // k.shape[1]
    bias = causal_lower_right(n, ctx)

    def expanded(t):  # timed inside each call, as the engine expands per call
        return heads_first(t.repeat_interleave(group, dim=1))

    return {
        "mask, K/V expanded": lambda: F.scaled_dot_product_attention(
            heads_first(q), expanded(k), expanded(v), attn_mask=mask, scale=scale),
        "mask, enable_gqa": lambda: F.scaled_dot_product_attention(
            heads_first(q), heads_first(k), heads_first(v), attn_mask=mask, scale=scale, enable_gqa=True),
        "lower_right, expanded": lambda: F.scaled_dot_product_attention(
            heads_first(q), expanded(k), expanded(v), attn_mask=bias, scale=scale),
        "lower_right, enable_gqa": lambda: F.scaled_dot_product_attention(
            heads_first(q), heads_first(k), heads_first(v), attn_mask=bias, scale=scale, enable_gqa=True),
        "split, cuDNN + merge": lambda: split_merge(heads_first(q), heads_first(k), heads_first(v), scale),
        "split, expanded + merge": lambda: split_merge(heads_first(q), expanded(k), expanded(v), scale),
        "engine sdpa": lambda: heads_first(sdpa(q, k, v, scale, causal=True)),
    }


def reference(q, k, v, scale, rows: int = 256) -> tuple[torch.Tensor, slice]:
    """float64 attention of the chunk's last `rows` queries (the widest rows), [1, Hq, rows, D]."""
    n, ctx = q.shape[0], k.shape[0]
    sl = slice(n - min(rows, n), n)
    group = q.shape[1] // k.shape[1]
    qd = heads_first(q[sl]).double()
    kd, vd = (heads_first(t.repeat_interleave(group, dim=1)).double() for t in (k, v))
    mask = lower_right_causal_mask(n, ctx, q.device)[sl]
    scores = (qd @ kd.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vd, sl


def shape_rows(n: int, ctx: int, heads: tuple[int, int, int]) -> list[dict]:
    hq, hkv, d = heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n, hq, d, device="cuda", dtype=BF16, generator=gen)
    k, v = (torch.randn(ctx, hkv, d, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
    scale = d ** -0.5
    visible = n * (ctx - n) + n * (n + 1) / 2
    flops = 2 * 2 * hq * d * visible
    ref, sl = reference(q, k, v, scale)
    rows = []
    for name, fn in variants(q, k, v, scale).items():
        try:
            out = fn()
        except RuntimeError as e:  # a backend that refuses the shape: say so, time the others
            rows.append({"chunk": f"{n}x{ctx}", "variant": name, "kernel": f"error: {str(e)[:50]}"})
            continue
        us = time_us(fn, iters=10)
        err = (out[:, :, sl].double() - ref).abs().max().item()
        rows.append({"chunk": f"{n}x{ctx}", "variant": name, "us": round(us, 1),
                     "tflops": round(flops / us / 1e6), "kernel": top_kernel(fn), "max_err_f64": f"{err:.2e}"})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="4096x8192,4096x12288,4096x16384,8192x16384,2048x16384,512x16384,64x4096",
                   help="chunk queries x context, comma-separated")
    p.add_argument("--heads", default="/".join(map(str, HEADS)), help="query heads/K-V heads/head dim")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    heads = tuple(int(x) for x in args.heads.split("/"))
    rows = []
    for shape in args.shapes.split(","):
        n, ctx = (int(x) for x in shape.split("x"))
        rows += shape_rows(n, ctx, heads)
    print_table(rows, ("chunk", "variant", "us", "tflops", "max_err_f64", "kernel"))
    if args.json:
        write_json(args.json, {"rows": rows}, torch.device("cuda"))


if __name__ == "__main__":
    main()
