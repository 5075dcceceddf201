"""On this machine's CPU, fp32: models/linear.py's `linear` (thin products as W @ xᵀ) against F.linear, and the
embedded SmolLM2's forward of a few tokens with and without fused q/k/v and gate/up (attention left out: a backend
that returns q). Times are medians of alternating rounds.

    PYTHONPATH=. python scripts/cpu_linear_bench.py [--rows 1,2,4,8,64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from oasiskv.models.linear import linear
from oasiskv.models.loader import load_model

SHAPES = {"SmolLM2 head 49152 x 576": (49152, 576), "SmolLM2 up 1536 x 576, 30 layers' worth": (1536, 576)}


def median_ms(fn, calls: int, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1000 / calls)
    return statistics.median(times)


def products(rows: list[int], rounds: int) -> None:
    for name, (n, k) in SHAPES.items():
        copies = 1 if n > 10000 else 30  # distinct weights, so that each call reads its weight from memory
        weights = [torch.randn(n, k) for _ in range(copies)]
        gb = n * k * 4 * copies / 1e9
        for m in rows:
            x = torch.randn(m, k)
            base = median_ms(lambda: [F.linear(x, w) for w in weights], 3, rounds)
            thin = median_ms(lambda: [linear(x, w) for w in weights], 3, rounds)
            print(f"{name:40s} rows {m:3d}: F.linear {base:7.2f} ms ({gb / base * 1e3:5.1f} GB/s), "
                  f"linear {thin:7.2f} ms ({gb / thin * 1e3:5.1f} GB/s)")


def forward(tokens: int, rounds: int) -> None:
    class NoAttention:
        def attend(self, layer, q, k, v):
            return q

    model = load_model(None, "auto", torch.device("cpu"), torch.float32, 0, False, with_tokenizer=False).model
    ids, positions = torch.arange(tokens) + 5, torch.arange(tokens) + 100
    times = {"unfused": [], "fused": []}
    for _ in range(rounds):
        for variant in times:
            for layer in model.model.layers:
                layer.self_attn.qkv = layer.mlp.gate_up = None
            if variant == "fused":
                model.fuse_projections()
            times[variant].append(median_ms(lambda: model(ids, positions, NoAttention()), 10, 1))
    for variant, ms in times.items():
        print(f"SmolLM2 forward, {tokens} tokens, {variant}: median {statistics.median(ms):.1f} ms "
              f"(rounds {', '.join(f'{t:.1f}' for t in ms)})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,2,4,8,64")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with torch.inference_mode():
        products([int(r) for r in args.rows.split(",")], args.rounds)
        forward(2, args.rounds)


if __name__ == "__main__":
    main()
