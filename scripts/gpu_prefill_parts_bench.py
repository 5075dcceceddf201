"""Times three parts of a 16K qwen3-8b prefill layer, each against what it replaced, at the model's shapes (bf16):

- causal attention with the K/V heads expanded to the query heads (repeat_interleave, then SDPA) against SDPA
  reading each K/V head for its group itself (enable_gqa; policies/attention.py sdpa); also the masked form a later
  prefill chunk ran until the thirty-third session (now `scripts/gpu_chunk_attention_bench.py` times it against the
  split the engine runs);
- the KV write into the paged pool: two index_put writes against kernels/kv_write.py;
- the residual add and the next RMSNorm: torch's add, then the rms_norm kernel, against add_rms_norm (16K rows,
  and a decode step's 86).

Prints microseconds per call (eager, as a prefill runs them), GB/s of the bytes each must move, the kernel each
attention variant ran (from the profiler) and whether its output equals the replaced one's bit for bit.

    PYTHONPATH=. python3 scripts/gpu_prefill_parts_bench.py [--json FILE]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from oasiskv.bench.report import print_table, write_json
from oasiskv.kernels.kv_write import write_kv_reference, write_kv_slots
from oasiskv.kernels.rms_norm import add_rms_norm, rms_norm
from oasiskv.policies.attention import sdpa
from scripts.gpu_rms_norm_bench import time_us

TOKENS, HQ, HKV, D, HIDDEN, BS = 16384, 32, 8, 128, 4096, 16
BF16 = torch.bfloat16


def expanded_sdpa(q, k, v, scale, mask=None, causal=False):
    """The attention before: K/V heads repeated to the query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=causal, scale=scale)
    return out[0].transpose(0, 1)


def top_kernel(fn) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return max(events, key=lambda e: e.self_device_time_total).key[:60] if events else "-"


def attention_rows() -> list[dict]:
    rows, scale = [], D ** -0.5
    q = torch.randn(TOKENS, HQ, D, device="cuda", dtype=BF16)
    k, v = (torch.randn(TOKENS, HKV, D, device="cuda", dtype=BF16) for _ in range(2))
    flops = 2 * 2 * HQ * D * TOKENS * TOKENS / 2  # causal: half the score matrix, QK^T and PV
    before = expanded_sdpa(q, k, v, scale, causal=True)
    for name, fn in (("causal, K/V expanded", lambda: expanded_sdpa(q, k, v, scale, causal=True)),
                     ("causal, enable_gqa (sdpa)", lambda: sdpa(q, k, v, scale, causal=True))):
        out = fn()
        us = time_us(fn, iters=10)
        rows.append({"part": "attention", "variant": name, "us": round(us, 1), "tflops": round(flops / us / 1e6),
                     "kernel": top_kernel(fn), "equal_to_before": bool(torch.equal(out, before)),
                     "max_abs_diff": (out.float() - before.float()).abs().max().item(),
                     "out_contiguous": out.is_contiguous()})
    half = TOKENS // 2  # a second chunk of 8K over a 16K context: the masked path
    mask = torch.arange(TOKENS, device="cuda")[None, :] <= (half + torch.arange(half, device="cuda"))[:, None]
    masked = {"masked chunk, K/V expanded": lambda: expanded_sdpa(q[half:], k, v, scale, mask=mask),
              "masked chunk, enable_gqa": lambda: F.scaled_dot_product_attention(
                  q[half:].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                  scale=scale, enable_gqa=True)[0].transpose(0, 1)}
    before = masked["masked chunk, K/V expanded"]()
    for name, fn in masked.items():
        out = fn()
        rows.append({"part": "attention", "variant": name, "us": round(time_us(fn, iters=10), 1), "tflops": "-",
                     "kernel": top_kernel(fn), "equal_to_before": bool(torch.equal(out, before)),
                     "max_abs_diff": (out.float() - before.float()).abs().max().item(),
                     "out_contiguous": out.is_contiguous()})
    return rows


def kv_write_rows() -> list[dict]:
    blocks = TOKENS // BS * 3
    pool = torch.zeros(blocks, 2, BS, HKV, D, device="cuda", dtype=BF16)
    slots = torch.randperm(blocks, device="cuda")[:TOKENS // BS]  # whole blocks, scattered, as a prefill gets them
    sb = slots.repeat_interleave(BS)
    so = torch.arange(BS, device="cuda").repeat(TOKENS // BS)
    k, v = (torch.randn(TOKENS, HKV, D, device="cuda", dtype=BF16) for _ in range(2))
    moved = 2 * 2 * k.numel() * k.element_size()  # read K and V, write them
    expected = pool.clone()
    write_kv_reference(expected, sb, so, k, v)
    rows = []
    for name, fn in (("index_put x 2", write_kv_reference), ("kv_write kernel", write_kv_slots)):
        pool.zero_()
        fn(pool, sb, so, k, v)
        us = time_us(lambda: fn(pool, sb, so, k, v))
        rows.append({"part": "kv write", "variant": name, "us": round(us, 1), "gbps": round(moved / us / 1e3),
                     "equal_to_before": bool(torch.equal(pool, expected))})
    return rows


def add_norm_rows() -> list[dict]:
    rows = []
    for tokens in (TOKENS, 86):
        x, delta = (torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16) for _ in range(2))
        w = torch.rand(HIDDEN, device="cuda", dtype=BF16) + 0.5
        before = (x + delta, rms_norm(x + delta, w, 1e-6))
        values = x.numel() * x.element_size()
        variants = (("add, then rms_norm", lambda: (lambda s: (s, rms_norm(s, w, 1e-6)))(x + delta), 5 * values),
                    ("add_rms_norm", lambda: add_rms_norm(x, delta, w, 1e-6), 4 * values))
        for name, fn, moved in variants:
            out = fn()
            us = time_us(fn)
            rows.append({"part": f"add + norm, {tokens} rows", "variant": name, "us": round(us, 1),
                         "gbps": round(moved / us / 1e3),
                         "equal_to_before": all(torch.equal(a, b) for a, b in zip(out, before))})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = attention_rows() + kv_write_rows() + add_norm_rows()
    print_table(rows, ("part", "variant", "us", "tflops", "gbps", "equal_to_before", "max_abs_diff", "kernel",
                       "out_contiguous"))
    if args.json:
        write_json(args.json, {"rows": rows}, torch.device("cuda"))


if __name__ == "__main__":
    main()
