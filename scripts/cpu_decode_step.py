"""Milliseconds per decode step on this machine's CPU: the embedded SmolLM2 (fp32), two requests, budget 64 (the
engines of tests/test_sparse_modes.py's 500-step test), and how much of it the model's matmuls take.

    PYTHONPATH=. python scripts/cpu_decode_step.py [--mode retrieval] [--steps 60] [--unfused]

--unfused skips the engine's fusion of q/k/v and gate/up (models/linear.py), to time the difference.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.models.llama import CausalLM

PROMPTS = ["Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing "
           "to do: once or twice she had peeped into the book her sister was reading.",
           "The numbers are " + ", ".join(str(i) for i in range(40))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="retrieval")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--unfused", action="store_true")
    args = p.parse_args()
    if args.unfused:
        CausalLM.fuse_projections = lambda self: None
    engine = LLMEngine(EngineConfig(show_progress=False, kv=KVConfig(mode=args.mode, budget=64, sink_blocks=1,
                                                                     local_blocks=1),
                                    cache=CacheConfig(kv_cache_gb=0.2),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=128)))
    params = SamplingParams(temperature=0, max_tokens=args.steps + 40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, request_id=str(i))
    for _ in range(20):  # prefill and the first decode steps
        engine.step()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    step_ms = (time.perf_counter() - start) * 1000 / args.steps
    stats = pstats.Stats(profile).stats
    matmul_s = sum(v[2] for k, v in stats.items() if k[2] in ("<built-in method torch.mm>",
                                                              "<built-in method torch._C._nn.linear>"))
    print(f"{args.mode}{' unfused' if args.unfused else ''}: {step_ms:.1f} ms per decode step "
          f"(profiled), of which matmuls {matmul_s * 1000 / args.steps:.1f} ms")


if __name__ == "__main__":
    main()
