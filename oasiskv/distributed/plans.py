"""Step plans as they travel from rank 0 to the other ranks.

A plan carries each scheduled request's whole block table, which grows with its context (sizes in
docs/BENCHMARKS.md, scripts/tp_plan_bench.py). Every rank keeps the tables it has been sent, so a plan
carries per request only how many known blocks still hold and the blocks after them. Any change of a table
(growth, preemption, a new allocation) is a new suffix after the longest unchanged prefix, so the receiver
always rebuilds the exact table."""
from __future__ import annotations

import dataclasses

from oasiskv.engine.scheduler import SchedulerOutput


@dataclasses.dataclass
class TableDelta:
    kept: int  # blocks of the table the receiver already holds that are still the table's first ones
    new: list[int]  # the blocks after them


class BlockTables:
    """One side of the channel: rank 0 encodes with it, every other rank decodes; both keep the tables
    of the requests that were scheduled and not released since."""

    def __init__(self):
        self.known: dict[str, list[int]] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.known.pop(request_id, None)

    def encode(self, plan: SchedulerOutput) -> SchedulerOutput:
        chunks = []
        for chunk in plan.chunks:
            table, old = chunk.block_ids, self.known.get(chunk.request_id, [])
            kept = common_prefix(old, table)
            self.known[chunk.request_id] = list(table)  # a copy: the scheduler appends to its own list
            chunks.append(dataclasses.replace(chunk, block_ids=TableDelta(kept, table[kept:])))
        return dataclasses.replace(plan, chunks=chunks)

    def decode(self, plan: SchedulerOutput) -> SchedulerOutput:
        chunks = []
        for chunk in plan.chunks:
            delta = chunk.block_ids
            table = self.known.get(chunk.request_id, [])[: delta.kept] + delta.new
            self.known[chunk.request_id] = table
            chunks.append(dataclasses.replace(chunk, block_ids=list(table)))
        return dataclasses.replace(plan, chunks=chunks)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix; tables usually only grow, so try the whole of `a` first."""
    if len(a) <= len(b) and b[: len(a)] == a:
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
