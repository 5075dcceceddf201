"""Tables and JSON of the throughput benchmarks (columns named as `vllm bench throughput` names them)."""
from __future__ import annotations

import json
import os
import platform
import time

import torch

MODE_COLUMNS = ("mode", "max_concurrency_held", "num_prompts", "requests_per_s", "output_tok_s", "total_tok_s",
                "mean_tpot_ms", "decode_tok_s", "decode_step_ms", "replay_step_ms", "pcie_gb_per_step", "hit_rate",
                "agreement", "fill_rate", "output_vs_dense", "decode_vs_dense")
SWEEP_COLUMNS = ("mode", "concurrency", "max_concurrency_held", "output_tok_s", "decode_tok_s", "decode_step_ms",
                 "replay_step_ms", "mean_tpot_ms", "pcie_gb_per_step", "roofline_fraction")
CAP_COLUMNS = ("fetch_cap", "max_concurrency_held", "output_tok_s", "decode_tok_s", "decode_step_ms",
               "replay_step_ms", "pcie_gb_per_step", "pcie_gbps", "prefetch_gb_per_step",
               "prefetch_exposed_ms_per_eager_step",
               "hit_rate",
               "agreement", "fill_rate")


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each mode's output and decode throughput over dense's (None without a dense row)."""
    dense = next((r for r in rows if r["mode"] == "dense"), None)
    for r in rows:
        for key, base in (("output_vs_dense", "output_tok_s"), ("decode_vs_dense", "decode_tok_s")):
            ok = dense and dense.get(base) and r.get(base) is not None
            r[key] = sig(r[base] / dense[base]) if ok else None
    return rows


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (CPU runs are orders of magnitude below GPU ones)."""
    return float(f"{x:.{digits}g}")


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.1f}"
    return str(value)


def print_table(rows: list[dict], columns: tuple[str, ...]) -> None:
    width = max(len(c) for c in columns) + 1
    print(" ".join(f"{c:>{width}}" for c in columns))
    for r in rows:
        print(" ".join(f"{cell(r.get(c)):>{width}}" for c in columns))


def print_modes_table(rows: list[dict]) -> None:
    print()
    for r in rows:
        source = f"  (from {r['from']})" if "from" in r else ""
        policy = f", misses {r['miss_policy']}" if r.get("miss_policy") else ""
        kv = r.get("kv", "")  # (the description starts with the mode: "dense: 25453 GPU blocks")
        print(f"{kv if kv.startswith(r['mode']) else r['mode'] + ': ' + kv}{policy}{source}")
        print(f"  Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tok_s']:.2f} total tokens/s, "
              f"{r['output_tok_s']:.2f} output tokens/s  (concurrency {r['max_concurrency_held']} held, "
              f"{r['num_prompts']} prompts, {r['elapsed_s']:.1f} s)")
        if r.get("prefill_time_s") is not None:
            print(f"  Time: {r['prefill_time_s']:.1f} s in {r['prefill_steps']} steps that prefilled "
                  f"({r['prefill_s_per_prompt']:.3f} s a prompt), {r['pure_decode_time_s']:.1f} s in "
                  f"{r['pure_decode_steps']} pure decode steps, {r['other_time_s']:.1f} s between and beside them")
        if r.get("roofline_fraction") is not None:
            print(f"  Roofline: {r['hbm_gb_per_step']:.3f} GB per pure decode step (weights + KV) at "
                  f"{r['hbm_gbps']:.0f} GB/s = {r['roofline_tok_s']:.1f} tok/s; achieved {r['decode_tok_s']:.1f} "
                  f"tok/s = {100 * r['roofline_fraction']:.1f}% of the roofline ({r['achieved_gbps']:.0f} GB/s)")
    print()
    print_table(rows, MODE_COLUMNS)


def print_sweep_table(rows: list[dict]) -> None:
    print()
    print_table([r for r in rows if "skipped" not in r], SWEEP_COLUMNS)
    for r in rows:
        if "skipped" in r:
            print(f"{r['mode']} at {r['concurrency']}: skipped, {r['skipped']}")


def print_cap_table(rows: list[dict]) -> None:
    print()
    print_table(rows, CAP_COLUMNS)


def device_label(device: torch.device) -> str:
    """The device as the JSON names it: the GPU's name, or cpu."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def write_json(path: str, result: dict, device: torch.device) -> None:
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "device": device_label(device),
              "torch": torch.__version__, "python": platform.python_version(), **result}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
