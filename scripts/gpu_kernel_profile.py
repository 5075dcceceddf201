"""Where the GPU time of a decode step goes: torch.profiler over a few decode steps per mode (eager, or
graph replays with --graphs), the kernels sorted by total device time, and per CUDA stream the busy
time and the span of the profiled steps (from the trace). Random-weight model.

    PYTHONPATH=. python scripts/gpu_kernel_profile.py [--model qwen3-8b] [--context 16384] [--batch 16]
        [--block-score mass] [--summary-tokens 4] [--select-per kv-head]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from scripts.gpu_graph_check import engine_for, prompts_for
from oasiskv.config import SHORTLIST_MODES, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--modes", default="quest,oasis")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--gpu-gb", type=float, default=72)
    p.add_argument("--host-gb", type=float, default=64)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--graphs", action="store_true", help="profile CUDA graph replays (default: eager steps)")
    p.add_argument("--warmup-steps", type=int, default=40, help="two periods of the step shapes that recur every "
                   "block_size steps: each is seen eagerly, then captured, before the profile")
    p.add_argument("--stride", type=int, default=0, help="prompt i has context + i * stride tokens")
    p.add_argument("--trace-dir", default=None, help="also save each mode's trace there (MODE.json.gz)")
    p.add_argument("--block-score", default=None, help="the selecting modes' --block-score (default: the engine's)")
    p.add_argument("--miss-policy", default=None, help="oasis's --miss-policy (default: the engine's)")
    p.add_argument("--summary-tokens", type=int, default=None, help="the selecting modes' --summary-tokens")
    p.add_argument("--select-per", default="layer", help="the selecting modes' --select-per: layer or kv-head")
    p.add_argument("--shortlist", type=float, default=0.0, help="quest's and oasis's --shortlist (0: none)")
    args = p.parse_args()
    prompts = prompts_for(args.batch, args.context, stride=args.stride)
    for mode in args.modes.split(","):
        tokens = args.batch + args.warmup_steps + args.steps + 8  # none finishes before the profile ends
        finer = {} if mode == "dense" else {"summary_tokens": args.summary_tokens, "select_per": args.select_per}
        if mode in SHORTLIST_MODES:
            finer["shortlist"] = args.shortlist
        engine = engine_for(args, mode, not args.graphs, "bfloat16", args.context + args.batch * args.stride, tokens,
                            **finer)
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        while any(len(r.output_token_ids) < 2 for r in engine.requests.values()):
            engine.step()
        for _ in range(args.warmup_steps):
            engine.step()
        torch.cuda.synchronize()
        # a mode whose pool holds fewer than --batch requests runs the rest in a later wave: the profile then sees
        # only the requests of that wave, so per-call times compare between modes only per running request
        running = len(engine.scheduler.running)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1000 / args.steps
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70)
        total = sum(e.self_device_time_total for e in prof.key_averages()) / 1000 / args.steps
        print(f"===== {mode}: {total:.1f} ms of kernels per step, {wall_ms:.2f} ms wall per step (batch {args.batch}, "
              f"{running} running in the profile, context {args.context}, prompt stride {args.stride})")
        print(table, flush=True)
        print_streams(prof, args.steps, args.trace_dir and os.path.join(args.trace_dir, f"{mode}.json.gz"))
        del engine
        torch.cuda.empty_cache()


def print_streams(prof, steps: int, keep: str | None = None) -> None:
    """Busy milliseconds per step of each stream's kernels and copies, and the span they cover; `keep`:
    where to save the trace (gzip-compressed)."""
    path = os.path.join(tempfile.mkdtemp(), "trace.json.gz" if keep else "trace.json")
    prof.export_chrome_trace(path)
    with (gzip.open(path, "rt") if keep else open(path)) as f:
        events = json.load(f)["traceEvents"]
    if keep:
        os.makedirs(os.path.dirname(keep) or ".", exist_ok=True)
        shutil.copy(path, keep)
    busy, first, last = defaultdict(float), float("inf"), 0.0
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            stream = e.get("args", {}).get("stream", "?")
            busy[stream] += e["dur"]
            first, last = min(first, e["ts"]), max(last, e["ts"] + e["dur"])
    print(f"span of the device work: {(last - first) / 1000 / steps:.2f} ms per step")
    for stream, us in sorted(busy.items(), key=lambda kv: -kv[1]):
        print(f"  stream {stream}: {us / 1000 / steps:.2f} ms busy per step")


if __name__ == "__main__":
    main()
