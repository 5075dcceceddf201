"""Decode step time with and without tensor parallelism, and what rank 0 spent in the collectives TP
adds (score combines, plan broadcasts), from the engine's `tp_*` statistics. Runs on the CPU (gloo)
or GPUs (NCCL).

    python scripts/tp_step_cost.py --tp 3 --mode quest            # the embedded SmolLM2, fp32 on the CPU
    python scripts/tp_step_cost.py --model qwen3-8b --load-format dummy --tp 2 --mode oasis --prompt-len 16384
"""
from __future__ import annotations

import argparse
import time

import torch

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
from oasiskv.engine.engine import LLMEngine

KEYS = ("tp_score_combines", "tp_score_combine_s", "tp_plans_sent", "tp_plan_broadcast_s")


def measure(args, tp: int) -> dict:
    torch.set_num_threads(args.threads)  # other ranks take (cores // ranks) threads
    extra = {"fetch_cap": args.fetch_cap, "host_kv_gb": args.host_kv_gb} if args.mode == "oasis" else {}
    engine = LLMEngine(EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, show_progress=False,
        tensor_parallel_size=tp, kv=KVConfig(mode=args.mode, budget=args.budget, **extra),
        cache=CacheConfig(kv_cache_gb=args.kv_cache_gb),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.prompt_len)))
    gen = torch.Generator().manual_seed(0)
    vocab = min(engine.model_config.vocab_size, 32000)
    for _ in range(args.requests):
        engine.add_request(torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True))
    for _ in range(args.requests + 1):  # prefills, then the first decode step
        engine.step()
    before, t0, steps = engine.stats_dict(), time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    seconds, after = time.perf_counter() - t0, engine.stats_dict()
    engine.close()
    return {"tp": tp, "mode": args.mode, "decode_steps": steps, "ms_per_step": round(1000 * seconds / steps, 1),
            **{k: round(after.get(k, 0) - before.get(k, 0), 4) for k in KEYS}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--mode", default="quest", choices=["dense", "quest", "retrieval", "oasis"])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--fetch-cap", type=float, default=0.25)
    p.add_argument("--kv-cache-gb", type=float, default=0.3)
    p.add_argument("--host-kv-gb", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1, help="rank 0's CPU threads (1: steadier on a shared CPU)")
    args = p.parse_args()
    for tp in (1, args.tp):
        print(measure(args, tp), flush=True)


if __name__ == "__main__":
    main()
