"""What fusing q/k/v and gate/up (models/linear.py's FusedLinears) does to qwen3-8b's forward on the GPU, attention
left out (a backend that returns q), random weights, bf16: decode-sized batches replayed from CUDA graphs, and a
16K prefill run eagerly, with and without the fusion, alternating rounds. (The numbers in docs/BENCHMARKS.md came
from e73bace, which timed the mean of 20 replays; it now takes gpu_select_bench's median.) Prefill is also timed
fused (the engine does not fuse above FUSED_MAX_ROWS rows) to show why, with its activation peak.

    PYTHONPATH=. python scripts/gpu_fuse_bench.py [--model qwen3-8b] [--rows 23,43,86] [--prefill 16384] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from oasiskv.models import linear as linear_module
from oasiskv.models.loader import load_model
from scripts.gpu_select_bench import per_call_us


class NoAttention:
    def attend(self, layer, q, k, v):
        return q


def unfuse(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.qkv = layer.mlp.gate_up = None


def graph_ms(model, rows: int) -> float:
    """One decode-sized forward replayed from a CUDA graph: the median of 20 replays."""
    ids = torch.randint(0, 1000, (rows,), device="cuda")
    positions = torch.arange(rows, device="cuda") + 16384
    backend = NoAttention()
    return per_call_us(lambda: model(ids, positions, backend), calls=1, repeats=20) / 1000


def prefill_ms(model, tokens: int) -> tuple[float, float]:
    ids = torch.randint(0, 1000, (tokens,), device="cuda")
    positions = torch.arange(tokens, device="cuda")
    model(ids, positions, NoAttention())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    model(ids, positions, NoAttention())
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--rows", default="23,43,86")
    p.add_argument("--prefill", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = load_model(args.model, "dummy", torch.device("cuda"), torch.bfloat16, 0, False, with_tokenizer=False).model
    times: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for variant in ("unfused", "fused"):
                unfuse(model)
                if variant == "fused":
                    model.fuse_projections()
                for rows in map(int, args.rows.split(",")):
                    times.setdefault(f"decode {rows} rows, {variant}", []).append(graph_ms(model, rows))
                for label, limit in (("", linear_module.FUSED_MAX_ROWS), (" forced", 1 << 30)):
                    if variant == "unfused" and label:
                        continue
                    linear_module.FUSED_MAX_ROWS = limit
                    ms, peak = prefill_ms(model, args.prefill)
                    linear_module.FUSED_MAX_ROWS = 256
                    key = f"prefill {args.prefill}, {variant}{label}"
                    times.setdefault(key, []).append(ms)
                    peaks[key] = peak
    rows = [{"case": k, "median_ms": round(statistics.median(v), 3), "all_ms": [round(x, 3) for x in v],
             "activation_peak_gib": round(peaks[k], 3) if k in peaks else None} for k, v in times.items()]
    for r in rows:
        peak = f"  activation peak {r['activation_peak_gib']:.2f} GiB" if r["activation_peak_gib"] is not None else ""
        print(f"{r['case']:40s} {r['median_ms']:9.3f} ms  {r['all_ms']}{peak}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
