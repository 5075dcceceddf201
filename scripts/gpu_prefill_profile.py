"""Where a 16K prefill step's time goes, per mode: wall time and GPU time (CUDA events) of prefill steps
of one prompt each, then one step under torch.profiler, with the kernels by device time and the host-side
operators by self CPU time. Random-weight model; each prompt samples one token and finishes.

    PYTHONPATH=. python scripts/gpu_prefill_profile.py [--model qwen3-8b] [--context 16384] [--modes quest,oasis] \\
        [--chunk 4096] [--prefill-keep-tokens 0]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from oasiskv.config import SamplingParams
from scripts.gpu_graph_check import engine_for, prompts_for


def prefill_once(engine, prompt) -> tuple[float, float]:
    """(wall s, GPU s) of the steps that prefill `prompt` and sample its one token."""
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    start_ev.record()
    while engine.has_unfinished():
        engine.step()
    end_ev.record()
    torch.cuda.synchronize()
    return time.perf_counter() - start, start_ev.elapsed_time(end_ev) / 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--modes", default="quest,oasis")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=16384, help="--max-num-batched-tokens: prefill chunk size")
    p.add_argument("--gpu-gb", type=float, default=72)
    p.add_argument("--host-gb", type=float, default=32)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--json", default=None)
    p.add_argument("--prefill-keep-tokens", type=int, default=None, help="retrieval/oasis (default: the engine's)")
    p.add_argument("--trace-dir", default=None, help="also save each mode's profiled step there (MODE.json)")
    args = p.parse_args()
    prompts = prompts_for(args.prompts + 2, args.context, stride=0)
    results = []
    for mode in args.modes.split(","):
        engine = engine_for(args, mode, False, "bfloat16", args.context, 8)
        prefill_once(engine, prompts[0])  # warm-up: compiles, allocates
        times = [prefill_once(engine, prompt) for prompt in prompts[1:-1]]
        wall = sum(t[0] for t in times) / len(times)
        gpu = sum(t[1] for t in times) / len(times)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            prefill_once(engine, prompts[-1])
        events = prof.key_averages()
        if args.trace_dir:
            prof.export_chrome_trace(f"{args.trace_dir}/{mode}.json")
        python = cProfile.Profile()  # host time outside torch's operators (scheduling, drafts, bookkeeping)
        python.enable()
        prefill_once(engine, prompts[-2])
        python.disable()
        pstats.Stats(python).sort_stats("tottime").print_stats(args.rows)
        print(f"===== {mode}: {wall * 1000:.1f} ms wall, {gpu * 1000:.1f} ms GPU (events) per {args.context}-token "
              f"prefill, mean of {len(times)}")
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        kernels = sorted(((e.key, e.self_device_time_total / 1000, e.count) for e in events
                          if e.self_device_time_total > 0), key=lambda x: -x[1])
        results.append({"mode": mode, "wall_ms": round(wall * 1000, 2), "gpu_ms": round(gpu * 1000, 2),
                        "walls_ms": [round(t[0] * 1000, 2) for t in times],
                        "device_ms_by_op": [(k, round(ms, 3), n) for k, ms, n in kernels]})
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "device_ms_by_op"}))
    if len(results) >= 2:  # where the first two modes differ most
        a, b = ({k: ms for k, ms, _ in r["device_ms_by_op"]} for r in results[:2])
        diff = sorted(((ms - b.get(k, 0.0), k) for k, ms in a.items()), reverse=True)
        diff += sorted(((-ms, k) for k, ms in b.items() if k not in a))
        print(f"device ms per prefill, {results[0]['mode']} minus {results[1]['mode']}:")
        for d, k in diff[:15] + diff[-8:]:
            print(f"  {d:+9.3f}  {k[:90]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
