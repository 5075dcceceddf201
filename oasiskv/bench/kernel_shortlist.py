"""The shortlist's second pass (kernels/shortlist_mass.py) in `oasiskv bench kernels`: per request a list of
`factor` x the budget's blocks at random places of a `context`-token sequence; the kernel reads each listed
block's keys once. GB/s of those keys against the device-to-device copy, per chunk width (listed blocks per
program), replayed from a CUDA graph over inputs larger than the L2 on the GPU; checked against the torch twin. A last
row reads fp8_key_copy's e4m3 keys and per-token scales instead (the list pass at half the key bytes), at the default
width (8 blocks a program); its error is against the twin on the same fp8 keys."""
from __future__ import annotations

import math

import torch

from oasiskv.bench.ceilings import timed_ms
from oasiskv.bench.kernel_paged_decode import make_case
from oasiskv.bench.report import sig
from oasiskv.kernels.shortlist_mass import fp8_key_copy, shortlist_block_lse, shortlist_block_lse_reference

BLOCK = 16
COLS = (1, 4, 8, 16)  # listed blocks per program (the default: 128 // BLOCK)


def shortlist_cases(batch: int, context: int, width: int, shapes: dict, dtype, device, rotations: int):
    """`rotations` argument tuples of `batch` requests over one pool, each listing `width` distinct random blocks."""
    nb = -(-context // BLOCK)
    q, kv, tables, seq_lens = make_case(batch * rotations, context, shapes["q_heads"], shapes["kv_heads"],
                                        shapes["head_dim"], BLOCK, dtype, device, seed=batch)
    g = torch.Generator().manual_seed(batch)
    listed = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in range(batch * rotations)]).int()
    listed = listed.to(device)
    scale = shapes["head_dim"] ** -0.5
    return [(q[r * batch:(r + 1) * batch], kv, tables[r * batch:(r + 1) * batch], listed[r * batch:(r + 1) * batch],
             seq_lens[r * batch:(r + 1) * batch], scale) for r in range(rotations)]


def bench_shortlist(batch: int, context: int, budget: int, factor: float, shapes: dict, dtype, device,
                    copy_gbps: float) -> list[dict]:
    width = min(-(-context // BLOCK), int(factor * budget // BLOCK))
    key_bytes = batch * width * BLOCK * shapes["kv_heads"] * shapes["head_dim"] * dtype.itemsize
    rotations = max(1, math.ceil((256 << 20) / key_bytes)) if device.type == "cuda" else 1  # L2 is 60 MB
    cases = shortlist_cases(batch, context, width, shapes, dtype, device, rotations)
    fp8 = fp8_key_copy(cases[0][1])  # one pool for every rotation
    fp8_bytes = batch * width * BLOCK * shapes["kv_heads"] * (shapes["head_dim"] + 4)  # e4m3 keys, fp32 scales
    rows = []
    # (listed blocks a program, fp8 keys); on the CPU the twin (cols None) runs instead of the kernel
    on_gpu = device.type == "cuda"
    variants = [(cols, False) for cols in COLS] + [(8, True)] if on_gpu else [(None, False), (None, True)]
    for cols, with_fp8 in variants:
        extra = {"fp8_keys": fp8} if with_fp8 else {}
        ref = shortlist_block_lse_reference(*cases[0], **extra)
        lse = (lambda *a: shortlist_block_lse(*a, cols=cols, **extra)) if cols else \
            (lambda *a: shortlist_block_lse_reference(*a, **extra))
        out = lse(*cases[0])
        err = (out - ref).abs().max().item()
        row = {"batch": batch, "listed_blocks": width, "keys": "fp8" if with_fp8 else str(dtype).split(".")[-1],
               "cols": cols or "-", "key_mb": sig((fp8_bytes if with_fp8 else key_bytes) / 1e6),
               "max_abs_err": sig(err), "correct": bool(err < 5e-2 and torch.isfinite(out).all())}
        if device.type == "cuda":
            from triton.testing import do_bench_cudagraph

            def all_cases():
                for c in cases:
                    lse(*c)
            us = do_bench_cudagraph(all_cases, rep=50, return_mode="median") * 1000 / rotations
        else:
            us = 1000 * timed_ms(lambda: lse(*cases[0]), device)
        read = fp8_bytes if with_fp8 else key_bytes
        row.update(us=sig(us), gbps=sig(read / us / 1e3), vs_copy=sig(read / us / 1e3 / copy_gbps))
        rows.append(row)
    return rows
