"""Times the fused rotary kernel (oasiskv/kernels/rotary.py) on the GPU at the engine's shapes: decode batches and a
16K prefill of qwen3-8b's heads and SmolLM2's, q and k as views of one fused qkv output (as the model passes them).
Prints microseconds, GB/s of the bytes it must move, and a device copy of as many bytes in the same process; with
--compare-file, the same for another version of the module (e.g. `git show REV:oasiskv/kernels/rotary.py`), after
checking that both give the torch reference's bits. Each launch is timed alone, Python's launch path included, as
an eager prefill runs it (scripts/gpu_select_bench.py's per_call_us times CUDA-graph replays instead, as decode runs).

    python scripts/gpu_rotary_bench.py --compare-file /tmp/rotary_old.py --json rotary.json
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

sys.path.insert(0, ".")
from oasiskv.bench.report import write_json  # noqa: E402
from oasiskv.kernels import rotary  # noqa: E402

SHAPES = [("qwen3-8b decode", 43, 32, 8, 128), ("qwen3-8b decode", 256, 32, 8, 128),
          ("qwen3-8b prefill", 16384, 32, 8, 128), ("smollm2 decode", 43, 9, 3, 64),
          ("smollm2 prefill", 8192, 9, 3, 64)]


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("rotary_compared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(t: int, hq: int, hkv: int, d: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(t)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    angles = torch.rand(t, 1, d, device="cuda", generator=g) * 6.3
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def time_us(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare-file", default=None, help="another version of oasiskv/kernels/rotary.py")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    versions = {"this tree": rotary}
    if args.compare_file:
        versions["compared"] = load_module(args.compare_file)
    rows = []
    print(f"{torch.cuda.get_device_name()}, bf16, median of {args.reps}")
    print(f"{'shape':18} {'T':>6} {'version':>10} {'us':>8} {'GB/s':>7} {'copy us':>8} {'copy GB/s':>9}")
    for name, t, hq, hkv, d in SHAPES:
        q, k, cos, sin = inputs(t, hq, hkv, d)
        ref_q, ref_k = rotary.apply_rotary_qk_reference(q, k, cos, sin)
        moved = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_us = time_us(lambda: dst.copy_(src), args.reps)
        for version, module in versions.items():
            out_q, out_k = module.apply_rotary_qk(q, k, cos, sin)
            if not (torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)):
                raise SystemExit(f"{version} differs from the torch reference at {name} T={t}")
            us = time_us(lambda: module.apply_rotary_qk(q, k, cos, sin), args.reps)
            row = {"shape": name, "tokens": t, "heads": [hq, hkv, d], "version": version, "us": round(us, 2),
                   "gb_s": round(moved / us / 1e3, 1), "copy_us": round(copy_us, 2),
                   "copy_gb_s": round(moved / copy_us / 1e3, 1)}
            rows.append(row)
            print(f"{name:18} {t:>6} {version:>10} {us:>8.1f} {row['gb_s']:>7} {copy_us:>8.1f} {row['copy_gb_s']:>9}")
    if args.json:
        write_json(args.json, {"rows": rows}, torch.device("cuda"))


if __name__ == "__main__":
    main()
