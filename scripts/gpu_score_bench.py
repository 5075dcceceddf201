"""Block scoring (kernels/block_select.py) at the engine's decode shape, per tuning: microseconds per call
as CUDA-graph replays of one call per layer (gpu_select_bench's per_call_us), the summaries' read
bandwidth against the HBM copy's, and whether each variant's scores equal the default tuning's.
--mass: the same for --block-score mass (kernels/block_mass.py), beside the bound's default tuning; its
tunings change the order of the normaliser's sums, so they are compared with the default to 1e-5.
--parts N: N summaries per block (--summary-tokens 16 / N).

    PYTHONPATH=. python scripts/gpu_score_bench.py [--batch 16] [--blocks 1025] [--mass] [--parts 4] [--json FILE]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from oasiskv.kernels import block_mass
from oasiskv.kernels.block_select import _launch_scores
from scripts.gpu_select_bench import per_call_us


def inputs(batch: int, blocks: int, nq: int, hq: int, hkv: int, d: int, parts: int = 1):
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = batch * blocks + 7
    lo = torch.randn(pool * parts, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    summaries = torch.stack([lo, lo + torch.rand(pool * parts, hkv, d, device="cuda", generator=g).bfloat16()], 1)
    q = torch.randn(nq, batch, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    tables = torch.randperm(pool, device="cuda", generator=g)[:batch * blocks].view(batch, blocks).int()
    counts = torch.full((nq, batch), blocks, dtype=torch.int32, device="cuda")
    counts[0] -= 1  # x_t: one block fewer than its draft
    return q, summaries, tables, counts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--blocks", type=int, default=1025)
    p.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D (qwen3-8b)")
    p.add_argument("--layers", type=int, default=36, help="calls per graph")
    p.add_argument("--mass", action="store_true", help="time --block-score mass's kernels instead")
    p.add_argument("--parts", type=int, default=1, help="summaries per block (--summary-tokens 16 / parts)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    peak = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_us = per_call_us(lambda: peak.clone(), 4)
    hbm = 2 * peak.numel() / copy_us / 1e3  # GB/s, read + write
    rows = mass_rows(args, hq, hkv, d, hbm) if args.mass else bound_rows(args, hq, hkv, d, hbm)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def mass_rows(args, hq: int, hkv: int, d: int, hbm: float) -> list[dict]:
    rows = []
    for nq in (1, 2):
        q, summaries, tables, counts = inputs(args.batch, args.blocks, nq, hq, hkv, d, args.parts)
        read = args.batch * args.blocks * args.parts * summaries[0].numel() * summaries.element_size()
        bound_us = per_call_us(lambda: _launch_scores(q, summaries, tables, counts, args.parts), args.layers)
        ref = block_mass._launch(q, summaries, tables, counts, d ** -0.5, args.parts)
        for block_n, warps in itertools.product((16, 32, 64, 128), (2, 4, 8)):
            run = lambda: block_mass._launch(q, summaries, tables, counts, d ** -0.5, args.parts,  # noqa: E731
                                             block_n=block_n, num_warps=warps)
            close = torch.allclose(run(), ref, rtol=1e-5, atol=1e-7)
            us = per_call_us(run, args.layers)
            row = {"nq": nq, "block_n": block_n, "num_warps": warps, "us": round(us, 2), "bound_us": round(bound_us, 2),
                   "gbps": round(read / us / 1e3, 1), "hbm_gbps": round(hbm, 1), "close": close}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for nq in (1, 2):
        mine = [r for r in rows if r["nq"] == nq]
        best = min((r for r in mine if r["close"]), key=lambda r: r["us"])
        default = next(r for r in mine if (r["block_n"], r["num_warps"]) == (32, 2))
        print(f"mass nq={nq}: default {default['us']} us, best {best['us']} us at block_n={best['block_n']} "
              f"num_warps={best['num_warps']}; the bound's default {default['bound_us']} us")
    return rows


def bound_rows(args, hq: int, hkv: int, d: int, hbm: float) -> list[dict]:
    rows = []
    for nq in (1, 2):
        q, summaries, tables, counts = inputs(args.batch, args.blocks, nq, hq, hkv, d, args.parts)
        ref = _launch_scores(q, summaries, tables, counts, args.parts)
        read = args.batch * args.blocks * args.parts * summaries[0].numel() * summaries.element_size()
        for block_n, warps, stages in itertools.product((16, 32, 64, 128), (2, 4, 8), (None, 3)):
            run = lambda: _launch_scores(q, summaries, tables, counts, args.parts, block_n=block_n,  # noqa: E731
                                         num_warps=warps, num_stages=stages)
            same = torch.equal(run(), ref)
            us = per_call_us(run, args.layers)
            row = {"nq": nq, "block_n": block_n, "num_warps": warps, "num_stages": stages, "us": round(us, 2),
                   "gbps": round(read / us / 1e3, 1), "hbm_gbps": round(hbm, 1), "equal": same}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for nq in (1, 2):
        best = min((r for r in rows if r["nq"] == nq and r["equal"]), key=lambda r: r["us"])
        default = next(r for r in rows
                       if r["nq"] == nq and (r["block_n"], r["num_warps"], r["num_stages"]) == (32, 4, None))
        print(f"nq={nq}: default {default['us']} us ({default['gbps']} GB/s), "
              f"best {best['us']} us ({best['gbps']} GB/s) at block_n={best['block_n']} "
              f"num_warps={best['num_warps']} num_stages={best['num_stages']}; HBM copy {hbm:.0f} GB/s")
    return rows


if __name__ == "__main__":
    main()
