"""Times the MLP's SiLU(gate) x up (oasiskv/kernels/silu_mul.py) against the torch ops it replaced, at qwen3-8b's
shapes: the halves of the fused gate/up product of a 16K prefill and of a 43-request decode step with its drafts.
Prints microseconds per call (eager, as a prefill runs it), GB/s of the bytes each must move (the kernel: read gate
and up, write the product; torch also writes and reads back SiLU's output), and the largest difference from torch.

    PYTHONPATH=. python3 scripts/gpu_silu_mul_bench.py [--json FILE]
"""
from __future__ import annotations

import argparse

import torch

from oasiskv.bench.report import print_table, write_json
from oasiskv.kernels.silu_mul import silu_mul, silu_mul_reference
from scripts.gpu_rms_norm_bench import time_us

INTERMEDIATE = 12288


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for phase, tokens in (("prefill 16K", 16384), ("decode 43+43", 86)):
        both = torch.randn(tokens, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16) * 3
        gate, up = both[:, :INTERMEDIATE], both[:, INTERMEDIATE:]
        ref = silu_mul_reference(gate, up)
        values = gate.numel() * gate.element_size()
        for name, fn, moved in (("torch", silu_mul_reference, 5 * values), ("kernel", silu_mul, 3 * values)):
            err = (fn(gate, up).float() - ref.float()).abs().max().item()
            mismatched = (fn(gate, up) != ref).float().mean().item()
            us = time_us(lambda: fn(gate, up))
            rows.append({"phase": phase, "impl": name, "shape": [tokens, INTERMEDIATE], "us": round(us, 2),
                         "gbps": round(moved / us / 1e3), "max_abs_err": err, "share_not_equal": mismatched})
    print_table(rows, ("phase", "impl", "us", "gbps", "max_abs_err", "share_not_equal"))
    if args.json:
        write_json(args.json, {"rows": rows}, torch.device("cuda"))


if __name__ == "__main__":
    main()
