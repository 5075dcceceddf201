"""Step plans sent to the other tensor-parallel ranks carry only what is new in each block table
(distributed/plans.py); the receiver must rebuild exactly the plan rank 0 scheduled."""
from __future__ import annotations

import pickle
import random

from oasiskv.distributed.plans import BlockTables, common_prefix
from oasiskv.engine.scheduler import ScheduledChunk, SchedulerOutput


def plan(tables: dict[str, list[int]]) -> SchedulerOutput:
    return SchedulerOutput(chunks=[ScheduledChunk(rid, [7], 16 * len(t) - 1, t, sample=True, draft_token_id=3)
                                   for rid, t in tables.items()])


def test_random_table_histories_arrive_exactly():
    """Growth, preemption (a table replaced by other blocks, or cut short), release and id reuse, in a
    random order over 300 steps; the scheduler appends to its lists in place, as the real one does."""
    rng = random.Random(0)
    sender, receiver = BlockTables(), BlockTables()
    live: dict[str, list[int]] = {}
    next_block = 0
    for step in range(300):
        released = []
        for rid in list(live):
            roll = rng.random()
            if roll < 0.05:
                released.append(rid)
                del live[rid]
            elif roll < 0.10:  # preempted and rescheduled: a fresh, possibly shorter table
                live[rid][:] = list(range(next_block, next_block + rng.randint(1, 4)))
                next_block += 4
            elif roll < 0.50:
                live[rid].append(next_block)
                next_block += 1
        while len(live) < 6:
            live[f"r{rng.randint(0, 9)}"] = [next_block]  # ids come back after their release
            next_block += 1
        sender.forget(released)
        sent = sender.encode(plan(live))
        receiver.forget(released)
        got = receiver.decode(pickle.loads(pickle.dumps(sent)))
        assert got == plan(live), step


def test_a_steady_decode_plan_is_small():
    """8 requests at 16K tokens (1024 blocks each): after the first plan only new blocks travel."""
    sender = BlockTables()
    tables = {f"r{i}": list(range(i * 2000, i * 2000 + 1024)) for i in range(8)}
    first = len(pickle.dumps(sender.encode(plan(tables))))
    for t in tables.values():
        t.append(t[-1] + 1)
    steady = len(pickle.dumps(sender.encode(plan(tables))))
    assert first > 20_000 and steady < first / 10


def test_common_prefix():
    assert common_prefix([], [1, 2]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 5, 3], [1, 2, 3]) == 1
    assert common_prefix([4], [1]) == 0
