"""Each engine step's host time, with whether it replayed or captured a graph: where a short run's time goes (Triton
compiles, captures, eager steps). Rounds of `--batch` requests run one after another in one process, so round 0 pays
the compiles and later rounds show the steady state. Usage (GPU):

    PYTHONPATH=. python scripts/gpu_step_times.py --model qwen3-0.6b --modes oasis --async-scheduling on,off
"""
from __future__ import annotations

import argparse
import time

import torch

from oasiskv.config import SamplingParams
from scripts.gpu_graph_check import engine_for, prompts_for

SETTINGS = {"on": True, "off": False, "default": None}


def run(args, mode: str, overlap: bool | None) -> None:
    args = argparse.Namespace(**vars(args), async_scheduling=overlap)  # engine_for's default: None, the engine's
    engine = engine_for(args, mode, False, "bfloat16", args.context, args.tokens, overlap)
    counts = engine.runner.graphs.counts if engine.runner.graphs else {}
    for round_ in range(args.rounds):
        for prompt in prompts_for(args.batch, args.context, stride=0):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
        rows = []
        while engine.has_unfinished():
            before = dict(counts)
            t = time.perf_counter()
            engine.step()
            ms = (time.perf_counter() - t) * 1000
            rows.append((round(ms, 1), *(counts.get(k, 0) - before.get(k, 0)
                                         for k in ("cuda_graph_replays", "cuda_graph_captures"))))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        slow = [(i, *r) for i, r in enumerate(rows) if r[0] > args.slow_ms]
        print(f"{mode} async={engine.async_scheduling} round {round_}: {len(rows)} steps, "
              f"{sum(r[0] for r in rows):.0f} ms; "
              f"steps over {args.slow_ms} ms (index, ms, replays, captures): {slow}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--modes", default="oasis")
    p.add_argument("--async-scheduling", dest="settings", default="on,off", help="comma list of on, off, default")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--gpu-gb", type=float, default=40)
    p.add_argument("--host-gb", type=float, default=8)
    args = p.parse_args()
    for mode in args.modes.split(","):
        for setting in args.settings.split(","):
            run(args, mode, SETTINGS[setting])


if __name__ == "__main__":
    main()
