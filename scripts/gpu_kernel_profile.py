"""Where the GPU time of a decode step goes: torch.profiler over a few eager decode steps per mode, the
kernels sorted by total device time (the same kernels a CUDA graph replays). Random-weight model.

    PYTHONPATH=. python scripts/gpu_kernel_profile.py [--model qwen3-8b] [--context 16384] [--batch 16]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from scripts.gpu_graph_check import engine_for, prompts_for
from oasiskv.config import SamplingParams


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
    args = p.parse_args()
    prompts = prompts_for(args.batch, args.context, stride=0)
    for mode in args.modes.split(","):
        engine = engine_for(args, mode, True, "bfloat16", args.context, 16)
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        while any(len(r.output_token_ids) < 4 for r in engine.requests.values()):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70)
        total = sum(e.self_device_time_total for e in prof.key_averages()) / 1000 / args.steps
        print(f"===== {mode}: {total:.1f} ms of kernels per step (batch {args.batch}, context {args.context})")
        print(table, flush=True)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
