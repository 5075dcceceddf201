"""Where the wall time of replayed decode steps goes on the host, without a profiler (which inflates host
costs): per phase of LLMEngine.step the host time (perf_counter, no added syncs), the time the sampler
blocks waiting for the GPU, and the device time of the replayed graph (CUDA events around replay).

    PYTHONPATH=. python scripts/gpu_host_phases.py [--modes quest,oasis] [--strides 0,1] [--batch 16]

Stride 0: equal prompts, so decode positions are staggered (prefilled one per step) and some draft opens a
block in every step; stride 1 aligns them (all drafts open together, once in 16 steps)."""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict

import torch

from scripts.gpu_graph_check import engine_for, prompts_for
from oasiskv.config import SamplingParams
from oasiskv.policies.oasis import OasisPolicy


class HostClock:
    """Exclusive host seconds per wrapped method (nested wrapped calls are subtracted from their caller)."""

    def __init__(self):
        self.totals, self.stack = defaultdict(float), []

    def wrap(self, obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **kw):
            self.stack.append([time.perf_counter(), 0.0])
            try:
                return inner(*a, **kw)
            finally:
                start, nested = self.stack.pop()
                spent = time.perf_counter() - start
                self.totals[phase] += spent - nested
                if self.stack:
                    self.stack[-1][1] += spent
        setattr(obj, name, timed)


def measure(args, mode: str, stride: int) -> dict:
    # prefill-first: request i starts decoding about i steps after request 0; none may finish during the timing
    tokens = args.batch + args.warmup + args.steps + 8
    engine = engine_for(args, mode, False, "bfloat16", args.context + args.batch * stride, tokens)
    for prompt in prompts_for(args.batch, args.context, stride=stride):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    while any(len(r.output_token_ids) < 2 for r in engine.requests.values()):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    torch.cuda.synchronize()
    clock, graphs = HostClock(), engine.runner.graphs
    device_ms, replays = [], []
    real_replay = torch.cuda.CUDAGraph.replay

    def replay(graph):
        if torch.cuda.current_stream() != torch.cuda.default_stream():  # oasis's tail graph, on the copy stream
            real_replay(graph)
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        real_replay(graph)
        clock.totals["graph.replay() call"] += time.perf_counter() - t
        clock.stack[-1][1] += time.perf_counter() - t
        end.record()
        replays.append((start, end))
    for obj, name, phase in ((engine.scheduler, "schedule", "schedule"), (engine.runner, "prepare", "prepare"),
                             (engine.policy, "begin_step", "policy.begin_step"), (graphs, "run", "graphs.run (rest)"),
                             (engine.sampler, "sample", "sample (waits for the GPU)"),
                             (engine, "propose_drafts", "propose_drafts")):
        clock.wrap(obj, name, phase)
    torch.cuda.CUDAGraph.replay = replay
    before, captures = graphs.counts["cuda_graph_replays"], graphs.counts["cuda_graph_captures"]
    if args.gc_freeze:  # move every object alive now out of the collector's generations
        gc.collect()
        gc.freeze()
    step_ms = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - t) * 1000)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1000 / args.steps
    gc.unfreeze()
    torch.cuda.CUDAGraph.replay = real_replay
    device_ms = [s.elapsed_time(e) for s, e in replays]
    row = {"mode": mode, "stride": stride, "prefetch_programs": OasisPolicy.PREFETCH_PROGRAMS,
           "tail_layers": OasisPolicy.TAIL_LAYERS, "batch": args.batch, "wall_ms_per_step": round(wall, 3),
           "replays": graphs.counts["cuda_graph_replays"] - before,
           "captures": graphs.counts["cuda_graph_captures"] - captures, "gc_freeze": args.gc_freeze,
           "step_ms_median": round(statistics.median(step_ms), 3), "step_ms_max": round(max(step_ms), 3),
           "graph_device_ms": round(sum(device_ms) / max(len(device_ms), 1), 3),
           "host_ms_per_step": {k: round(v * 1000 / args.steps, 3) for k, v in sorted(clock.totals.items())}}
    row["host_ms_per_step"]["elsewhere in step()"] = round(wall - sum(row["host_ms_per_step"].values()), 3)
    del engine
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--modes", default="quest,oasis")
    p.add_argument("--strides", default="0,1")
    p.add_argument("--steps", type=int, default=48)
    # at least two of every recurring step shape (e.g. the steps where some draft opens a block, every block_size
    # steps): the first runs eagerly, the second captures; a capture inside the timed steps costs ~100 ms
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--prefetch-programs", type=int, default=None, help="OasisPolicy.PREFETCH_PROGRAMS")
    p.add_argument("--tail-layers", type=int, default=None, help="OasisPolicy.TAIL_LAYERS (0: no tail graph)")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--gpu-gb", type=float, default=72)
    p.add_argument("--host-gb", type=float, default=64)
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the timed steps")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.prefetch_programs is not None:
        OasisPolicy.PREFETCH_PROGRAMS = args.prefetch_programs
    if args.tail_layers is not None:
        OasisPolicy.TAIL_LAYERS = args.tail_layers
    rows = []
    for mode in args.modes.split(","):
        for stride in (int(s) for s in args.strides.split(",")):
            row = measure(args, mode, stride)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'mode':6} {'stride':>6} {'wall ms':>8} {'median':>7} {'max':>7} {'captures':>8} {'graph dev ms':>12}  "
          "host ms per step by phase")
    for r in rows:
        phases = ", ".join(f"{k} {v}" for k, v in r["host_ms_per_step"].items())
        print(f"{r['mode']:6} {r['stride']:6d} {r['wall_ms_per_step']:8.2f} {r['step_ms_median']:7.2f} "
              f"{r['step_ms_max']:7.2f} {r['captures']:8d} {r['graph_device_ms']:12.2f}  {phases}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
