"""Continuous batching with chunked prefill and preemption by recompute. Ints only.

Two policies (SchedulerConfig.schedule_policy): "mixed" runs every decode each step and fills the rest
of the token budget with prefill chunks; "prefill-first" runs prefill chunks alone while there is
prefill work that can start, and decodes only when there is none.

Every request is a list of tokens (prompt + outputs so far) of which the first num_computed_tokens
have K/V in the cache. A step computes the next chunk of each scheduled request; when a chunk reaches
the end of the known tokens, the step samples one more token. Decode, prefill, chunked prefill and
recompute after preemption are the same operation with different chunk lengths.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from oasiskv.config import SchedulerConfig
from oasiskv.engine.request import Request, RequestStatus
from oasiskv.kv.block_allocator import BlockAllocator


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    token_ids: list[int]
    start: int  # position of token_ids[0] in the request
    block_ids: list[int]  # the request's block table, covering start + len(token_ids) tokens
    sample: bool  # the chunk ends at the last known token: sample the next one
    draft_token_id: int | None = None  # a guess of the token after this chunk (oasis lookahead); never emitted
    table_epoch: int | None = None  # block_ids only grow while this stays the same (Scheduler.epoch_of); None: unknown
    # every prompt token's K/V must reach the host store (a prefill instance exports them)
    prompt_to_host: bool = False
    # the chunk holds prompt tokens: a prefill, the prompt's last token alone too (a decode would attend to the
    # sparse modes' selection, where the same token in a longer chunk attends to the whole prefix)
    prefill: bool = False


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


# what an allocator's blocks live in, named for the error a user can act on
GPU_POOL = "GPU KV pool (--kv-cache-gb or --num-kv-blocks)"
HOST_STORE = "host KV store (--host-kv-gb or --num-kv-blocks)"


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: BlockAllocator, block_size: int, max_model_len: int,
                 kv_memory: str = GPU_POOL):
        self.cfg, self.allocator, self.block_size = cfg, allocator, block_size
        self.max_model_len = max_model_len
        self.kv_memory = kv_memory
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.table_epochs = itertools.count()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks(self, req: Request, n: int) -> int:
        """Blocks req must be given before computing its next n tokens."""
        return self.blocks_for(req.num_computed_tokens + n) - len(req.block_ids)

    def check_admissible(self, req: Request) -> None:
        """Raises ValueError for a request that could never run: the caller rejects it alone."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len}, and a prompt leaves room "
                             f"for one output token: at most {self.max_model_len - 1} (truncate_prompt_tokens "
                             f"{self.max_model_len - 1} keeps its last tokens)")
        # the last sampled token's K/V is never computed: the request ends as it is sampled
        longest = min(n + req.params.max_tokens, self.max_model_len) - 1
        if self.blocks_for(longest) > self.allocator.num_blocks:
            raise ValueError(
                f"request needs up to {self.blocks_for(longest)} KV blocks ({longest} tokens) but the "
                f"{self.kv_memory} has {self.allocator.num_blocks}; lower max_tokens or enlarge it"
            )

    def add(self, req: Request) -> None:
        self.check_admissible(req)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        prefill_only = self.cfg.schedule_policy == "prefill-first" and self._prefill_pending()
        self._fill(out, prefill_only)
        if prefill_only and not out.chunks:  # the pending prefill could not run (it preempted itself)
            self._fill(out, prefill_only=False)
        return out

    def _fill(self, out: SchedulerOutput, prefill_only: bool) -> None:
        budget = self.cfg.max_num_batched_tokens
        # Decodes (one token) before partial prefills, so a long prompt never starves running decodes
        # (with prefill_only, decodes wait instead).
        for req in sorted(self.running, key=lambda r: (r.num_uncomputed > 1, r.arrival_time)):
            if budget == 0 or req.status != RequestStatus.RUNNING or (prefill_only and req.num_uncomputed == 1) \
                    or req.last_pending:
                continue
            n = min(req.num_uncomputed, budget)
            if not self._reserve_blocks(req, n, out):
                continue
            out.chunks.append(self._chunk(req, n))
            budget -= n
        if not out.preempted:
            self._admit_waiting(out, budget)

    def _prefill_pending(self) -> bool:
        """A running request has an unfinished prefill, or the head of the queue can be admitted now."""
        if any(r.num_uncomputed > 1 for r in self.running):
            return True
        if not self.waiting or len(self.running) >= self.cfg.max_running:
            return False
        req = self.waiting[0]
        n = min(req.num_uncomputed, self.cfg.max_num_batched_tokens)
        return self.allocator.can_allocate(self.new_blocks(req, n))

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            n = min(req.num_uncomputed, budget)
            need = self.new_blocks(req, n)
            if not self.allocator.can_allocate(need):
                return
            self.waiting.popleft()
            req.block_ids += self.allocator.allocate(need)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, n))
            budget -= n

    def _reserve_blocks(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocates the blocks req needs for n more tokens, preempting the latest arrivals if the
        pool is short. Returns False if req itself had to be preempted."""
        need = self.new_blocks(req, n)
        scheduled = {c.request_id for c in out.chunks}
        while not self.allocator.can_allocate(need):
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = max(candidates, key=lambda r: r.arrival_time)
            self.preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        req.block_ids += self.allocator.allocate(need)
        return True

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(req.request_id, req.token_slice(start, start + n), start, list(req.block_ids),
                              sample=start + n == req.num_tokens, draft_token_id=req.draft_token_id,
                              table_epoch=self.epoch_of(req),
                              prompt_to_host=req.prompt_to_host and start < len(req.prompt_token_ids),
                              prefill=start < len(req.prompt_token_ids))

    def epoch_of(self, req: Request) -> int:
        """A number that stays the same while req's block table only grows. A table is only ever extended in
        place (+=) and starts again as a new list (preemption; a decode instance's attach), so the list object
        tells; it is kept referenced, so no later list can take its identity."""
        if req.table_list is not req.block_ids:
            req.table_list, req.table_epoch = req.block_ids, next(self.table_epochs)
        return req.table_epoch

    def preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, go back to the head of the queue."""
        self.running.remove(req)
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.draft_token_id = None
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
