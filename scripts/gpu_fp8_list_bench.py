"""The list pass (kernels/shortlist_mass.py) over fp8 keys on the GPU: widened to bf16 or to fp16, at 4 / 8 / 16
listed blocks a program and 4 / 8 warps, against the bf16 keys at the default tile; qwen3-8b's heads, a list of 3x
the 2048-token budget (384 blocks) at 16K, 21 and 43 rows. Inputs over several pools' worth of rows (more than the
L2), replayed from a CUDA graph; errors against the torch twin on the same keys (the fp16 rows: q rounded to fp16).

    PYTHONPATH=. python3 scripts/gpu_fp8_list_bench.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench_cudagraph

from oasiskv.bench.kernel_shortlist import shortlist_cases
from oasiskv.kernels.shortlist_mass import fp8_key_copy, shortlist_block_lse, shortlist_block_lse_reference

SHAPES = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
WIDTH, BLOCK, CONTEXT = 384, 16, 16384


def variants(fp8):
    """name -> (launch(case), reads fp8 keys, q rounded to fp16)"""
    out = {"bf16 keys, 8 cols": (lambda c: shortlist_block_lse(*c, cols=8), False, False)}
    for cols in (4, 8, 16):
        out[f"fp8 -> bf16, {cols} cols"] = (lambda c, k=cols: shortlist_block_lse(*c, cols=k, fp8_keys=fp8),
                                            True, False)
        for warps in (4, 8):
            out[f"fp8 -> fp16, {cols} cols, {warps} warps"] = (
                lambda c, k=cols, w=warps: shortlist_block_lse(*c, cols=k, fp8_keys=fp8, widen_f16=True, num_warps=w),
                True, True)
    return out


def bench(batch: int) -> list[dict]:
    key_bytes = batch * WIDTH * BLOCK * SHAPES["kv_heads"] * SHAPES["head_dim"] * 2
    rotations = max(1, -(-(256 << 20) // key_bytes))  # L2 is 60 MB
    cases = shortlist_cases(batch, CONTEXT, WIDTH, SHAPES, torch.bfloat16, torch.device("cuda"), rotations)
    fp8 = fp8_key_copy(cases[0][1])
    rows = []
    for name, (launch, with_fp8, f16) in variants(fp8).items():
        q, *rest = cases[0]
        ref = shortlist_block_lse_reference(q.half().float() if f16 else q, *rest, fp8_keys=fp8 if with_fp8 else None)
        err = (launch(cases[0]) - ref).abs().max().item()
        us = do_bench_cudagraph(lambda: [launch(c) for c in cases], rep=50, return_mode="median") * 1000 / rotations
        read = key_bytes // 2 + batch * WIDTH * BLOCK * SHAPES["kv_heads"] * 4 if with_fp8 else key_bytes
        rows.append({"rows": batch, "variant": name, "us": round(us, 1), "gbps": round(read / us / 1e3),
                     "key_mb": round(read / 1e6, 1), "max_abs_err": err})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = bench(21) + bench(43)
    print(f"{'rows':>5} {'variant':<28} {'key MB':>7} {'us':>8} {'GB/s':>7} {'max err':>9}")
    for r in rows:
        print(f"{r['rows']:>5} {r['variant']:<28} {r['key_mb']:>7} {r['us']:>8} {r['gbps']:>7} "
              f"{r['max_abs_err']:>9.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
