"""Cost of the collectives tensor parallelism adds per layer, beside each other:

  score all-reduce   the block-score sum that keeps one selection per (request, layer): [B, blocks] fp32,
                     once per sparse layer for the decode token (and once more for the oasis draft);
  score all-gather   the same when KV heads are replicated (more ranks than KV heads);
  hidden all-reduce  what every tensor-parallel layer pays twice anyway (o_proj, down_proj): [B, H] in
                     the model dtype.

Usage: python -m oasiskv.bench.tp_collectives --world 2 [--device cuda] [--blocks 1024] [--hidden 4096]
(gloo on the CPU, NCCL on GPUs). Prints microseconds per call (median of --iters) on rank 0."""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def time_call(fn, iters: int, cuda: bool) -> float:
    """Median microseconds of fn() over iters calls, after 5 warm-up calls (all ranks in lockstep)."""
    samples = []
    for i in range(iters + 5):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= 5:
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def run(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        scores = torch.randn(batch, args.blocks, device=device)
        hidden = torch.randn(batch, args.hidden, device=device, dtype=dtype)
        parts = [torch.empty_like(scores) for _ in range(world)]
        rows.append((batch,
                     time_call(lambda: dist.all_reduce(scores), args.iters, cuda),
                     time_call(lambda: dist.all_gather(parts, scores), args.iters, cuda),
                     time_call(lambda: dist.all_reduce(hidden), args.iters, cuda)))
    if rank == 0:
        print(f"{'gloo' if not cuda else 'nccl'}, {world} ranks, {args.blocks} blocks "
              f"({args.blocks * 16} tokens), hidden {args.hidden} ({dtype}); microseconds per call (median)")
        print(f"{'batch':>6} {'score all-reduce':>17} {'score all-gather':>17} {'hidden all-reduce':>18}")
        for batch, reduce, gather, hid in rows:
            print(f"{batch:>6} {reduce:>17.1f} {gather:>17.1f} {hid:>18.1f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--blocks", type=int, default=1024, help="blocks per request (1024 = 16K tokens)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (Qwen3-8B: 4096)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run, args=(args.world, os.path.join(d, "init"), args), nprocs=args.world)


if __name__ == "__main__":
    main()
