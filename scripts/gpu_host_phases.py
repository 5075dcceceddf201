"""Where the wall time of replayed decode steps goes on the host, without a profiler (which inflates host
costs): per phase of LLMEngine.step the host time (perf_counter, no added syncs), the time the sampler
blocks waiting for the GPU, and the device time of the replayed graph (CUDA events around replay).

    PYTHONPATH=. python scripts/gpu_host_phases.py [--modes quest,oasis] [--strides 0,1] [--batch 16]

Stride 0: equal prompts, so decode positions are staggered (prefilled one per step) and some draft opens a
block in every step; stride 1 aligns them (all drafts open together, once in 16 steps)."""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import time
from collections import defaultdict

import torch

from scripts.gpu_graph_check import engine_for, prompts_for
from oasiskv.config import SamplingParams
from oasiskv.engine.cuda_graph import CapturedStep
from oasiskv.policies.oasis import OasisPolicy


class HostClock:
    """Exclusive host seconds per wrapped method (nested wrapped calls are subtracted from their caller)."""

    def __init__(self):
        self.totals, self.stack = defaultdict(float), []

    def timed(self, inner, phase: str):
        def run(*a, **kw):
            self.stack.append([time.perf_counter(), 0.0])
            try:
                return inner(*a, **kw)
            finally:
                start, nested = self.stack.pop()
                spent = time.perf_counter() - start
                self.totals[phase] += spent - nested
                if self.stack:
                    self.stack[-1][1] += spent
        return run

    def wrap(self, obj, name: str, phase: str) -> None:
        setattr(obj, name, self.timed(getattr(obj, name), phase))

    def wrap_class(self, cls, name: str, phase: str):
        """Every instance's `name` as defined on `cls` (a method that calls super() is split by class).
        Returns the original, to put back."""
        inner = cls.__dict__[name]
        setattr(cls, name, self.timed(inner, phase))
        return inner


def measure(args, mode: str, stride: int) -> dict:
    # prefill-first: request i starts decoding about i steps after request 0; none may finish during the timing
    tokens = args.batch + args.warmup + args.steps + 8
    kv = {"draft": args.draft} if mode == "oasis" and args.draft else {}
    engine = engine_for(args, mode, False, "bfloat16", args.context + args.batch * stride, tokens, **kv)
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
                             (engine, "land", "land (waits for the GPU)"),
                             (engine, "propose_drafts", "propose_drafts")):
        clock.wrap(obj, name, phase)
    policy, split = engine.policy, []
    for cls in type(policy).__mro__:  # begin_step by class: which layer of the policy's hierarchy costs what
        if "begin_step" in cls.__dict__ and cls is not type(policy):
            split.append((cls, "begin_step", f"policy.begin_step ({cls.__name__})"))
    split.append((CapturedStep, "load", "graphs.run: load inputs"))
    originals = [(cls, name, clock.wrap_class(cls, name, phase)) for cls, name, phase in split]
    for name in ("before_replay", "replay_tail", "graph_key"):
        clock.wrap(policy, name, f"graphs.run: policy.{name}")
    if engine.drafter is not None:
        clock.wrap(engine.drafter, "propose", "propose_drafts: drafter.propose")
    torch.cuda.CUDAGraph.replay = replay
    before, captures = graphs.counts["cuda_graph_replays"], graphs.counts["cuda_graph_captures"]
    if args.gc_freeze:  # move every object alive now out of the collector's generations
        gc.collect()
        gc.freeze()
    step_ms = []
    profiler = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    for _ in range(args.steps):
        t = time.perf_counter()
        if profiler:
            profiler.enable()
        engine.step()
        if profiler:
            profiler.disable()
        step_ms.append((time.perf_counter() - t) * 1000)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1000 / args.steps
    for cls, name, original in originals:  # the classes' own methods back
        setattr(cls, name, original)
    if profiler:
        with open(args.profile, "a") as f:
            f.write(f"== {mode}, stride {stride}, {args.steps} steps (tottime per call in s)\n")
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(45)
    gc.unfreeze()
    torch.cuda.CUDAGraph.replay = real_replay
    device_ms = [s.elapsed_time(e) for s, e in replays]
    row = {"mode": mode, "async_scheduling": engine.async_scheduling, "draft": kv.get("draft"),
           "block_score": engine.config.kv.block_score, "miss_policy": engine.config.kv.miss_policy,
           "profiled": bool(profiler), "stride": stride,
           "prefetch_programs": OasisPolicy.PREFETCH_PROGRAMS,
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
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan each step while the last runs (default: the engine's, on for a GPU and device drafts)")
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the timed steps")
    p.add_argument("--draft", default=None, help="oasis's --draft (default: the config's)")
    p.add_argument("--block-score", default=None, help="--block-score (default: the config's)")
    p.add_argument("--miss-policy", default=None, help="oasis's --miss-policy (default: the config's)")
    p.add_argument("--profile", default=None, help="also cProfile the timed steps, appending the top to this file "
                   "(inflates the times)")
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
