"""Times the RMSNorm kernel (oasiskv/kernels/rms_norm.py) on the GPU at qwen3-8b's shapes, per tile size (rows a
program = tile // the row's padded width; tile 1 is one row a program, the kernel before the thirtieth session):
the hidden-state norms and the q/k norms (views of one fused qkv output, as the model passes them) of a 16K prefill
and of a 43-request decode step with its drafts. Prints microseconds per launch (eager, Python's launch path
included, as a prefill runs it), GB/s of the bytes it must move, and the largest difference from the torch reference.

    PYTHONPATH=. python3 scripts/gpu_rms_norm_bench.py [--tiles 1,1024,2048,4096] [--json FILE]
"""
from __future__ import annotations

import argparse

import torch

from oasiskv.bench.report import print_table, write_json
from oasiskv.kernels import rms_norm as rn

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128


def cases(tokens: int) -> dict[str, torch.Tensor]:
    """name -> the tensor normed, as the model hands it over (q and k: [T, heads, D] views of the qkv product)."""
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return {"hidden": torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16),
            "q": qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM),
            "k": qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)}


def time_us(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles", default="1,1024,2048,4096")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for phase, tokens in (("prefill 16K", 16384), ("decode 43+43", 86)):
        for name, x in cases(tokens).items():
            weight = torch.rand(x.shape[-1], device="cuda", dtype=torch.bfloat16) + 0.5
            ref = rn.rms_norm_reference(x, weight, 1e-6)
            moved = 2 * x.numel() * x.element_size()
            for tile in map(int, args.tiles.split(",")):
                rn._TILE_ELEMENTS = tile
                err = (rn.rms_norm(x, weight, 1e-6).float() - ref.float()).abs().max().item()
                us = time_us(lambda: rn.rms_norm(x, weight, 1e-6))
                rows.append({"phase": phase, "tensor": name, "shape": list(x.shape), "tile": tile, "us": round(us, 2),
                             "gbps": round(moved / us / 1e3), "max_abs_err": err})
    print_table(rows, ("phase", "tensor", "shape", "tile", "us", "gbps", "max_abs_err"))
    if args.json:
        write_json(args.json, {"rows": rows}, torch.device("cuda"))


if __name__ == "__main__":
    main()
