"""Pickled size and gloo broadcast time of a steady decode step plan, sent whole or as block-table deltas
(oasiskv/distributed/plans.py), between two CPU processes, as rank 0 sends plans to the other ranks.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/tp_plan_bench.py [--cases 8x16384,35x16384,8x32768] [--plans 30]
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from oasiskv.distributed.plans import BlockTables
from oasiskv.engine.scheduler import ScheduledChunk, SchedulerOutput

BLOCK = 16
WARMUP = 5


def tables(batch: int, context: int) -> dict[str, list[int]]:
    blocks = -(-context // BLOCK)
    return {str(i): list(range(i * 2 * blocks, i * 2 * blocks + blocks)) for i in range(batch)}


def decode_plan(live: dict[str, list[int]]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledChunk(r, [12345], BLOCK * len(t) - 1, t, True, draft_token_id=777)
                            for r, t in live.items()])


def time_plans(rank: int, group, batch: int, context: int, delta: bool, plans: int) -> tuple[int, float]:
    """(pickled bytes of the last plan, median seconds per broadcast after the warm-up)."""
    sender, receiver, live = BlockTables(), BlockTables(), tables(batch, context)
    seconds, size = [], 0
    for _ in range(plans):
        for t in live.values():  # one decode step: every table may grow by a block
            t.append(t[-1] + 1)
        dist.barrier(group=group)
        time.sleep(0.002)  # the receiver is already waiting, as a rank waits for the next plan
        t0 = time.perf_counter()
        if rank == 0:
            message = (sender.encode(decode_plan(live)) if delta else decode_plan(live), [])
            size = len(pickle.dumps(message))
            box = [message]
        else:
            box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if rank == 1 and delta:
            receiver.decode(box[0][0])
        seconds.append(time.perf_counter() - t0)
    return size, statistics.median(seconds[WARMUP:])


def worker(rank: int, init: str, cases: list[tuple[int, int]], plans: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    for batch, context in cases:
        for delta in (False, True):
            size, median = time_plans(rank, group, batch, context, delta, plans)
            found = [None, None]
            dist.all_gather_object(found, (size, median), group=group)
            if rank == 0:
                print(f"batch {batch:3d} x {context:6d} tokens, {'new blocks only' if delta else 'whole tables   '}: "
                      f"{found[0][0]:8d} B, median ms rank 0 {1e3 * found[0][1]:.3f}, rank 1 {1e3 * found[1][1]:.3f}",
                      flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="8x16384,35x16384,8x32768", help="batch x context, comma-separated")
    p.add_argument("--plans", type=int, default=30)
    args = p.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    mp.spawn(worker, args=(tempfile.mktemp(), cases, args.plans), nprocs=2)


if __name__ == "__main__":
    main()
