"""Where a sparse decode step spends its host time: cProfile of a few decode steps per mode, and the
step time with and without a device sync. Random-weight model, B requests of CTX tokens.

    PYTHONPATH=. python scripts/gpu_profile_step.py [--model qwen3-0.6b] [--context 4096] [--batch 16]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
from oasiskv.engine.engine import LLMEngine


def profile(args, mode: str) -> None:
    cfg = EngineConfig(model=args.model, load_format="dummy", show_progress=False,
                       kv=KVConfig(mode=mode, budget=args.budget, host_kv_gb=16),
                       cache=CacheConfig(gpu_memory_gb=40),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16384, max_model_len=args.context + 512))
    engine = LLMEngine(cfg)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(torch.randint(0, 32000, (args.context,), generator=gen).tolist(), params)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t) * 100
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(f"===== {mode}: {step_ms:.1f} ms/step at batch {args.batch}, context {args.context}")
    print("\n".join(out.getvalue().splitlines()[:45]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--modes", default="quest,oasis")
    args = p.parse_args()
    for mode in args.modes.split(","):
        profile(args, mode)


if __name__ == "__main__":
    main()
