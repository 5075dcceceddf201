"""The engine in one background thread. The asyncio side never touches the engine: it queues commands
(callables that run on the engine thread between steps) and reads the outputs the thread pushes into
asyncio queues after every step."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from oasiskv.config import SamplingParams
from oasiskv.engine.logprobs import LogprobSampler, TokenLogprob, prompt_logprobs

log = logging.getLogger("oasiskv.server")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class Output:
    """What one request produced since its previous Output."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool = False
    finish_reason: str | None = None
    text: str | None = None  # when finished: the engine's final text (a matched stop string cut off)
    error: str | None = None
    stop_reason: str | int | None = None  # when finished: the stop string or stop token id it stopped at


@dataclass
class Tracked:
    """A request the loop reports on: where its outputs go, what was sent, when (for metrics)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int  # the choice index its outputs are tagged with
    num_prompt_tokens: int
    sent: int = 0
    arrival: float = field(default_factory=time.perf_counter)  # when the HTTP side submitted it
    first_token: float | None = None
    last_token: float | None = None


class EngineLoop:
    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.sampler = LogprobSampler(engine.sampler)
        engine.sampler = self.sampler  # the one hook: see logprobs.py
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.tracked: dict[str, Tracked] = {}
        self.error: str | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="oasiskv-engine", daemon=True)

    # -- asyncio side ----------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Ends the thread after the current step and gives the engine its own sampler back."""
        self.commands.put(self._stop)
        self.thread.join(timeout=30)
        self.engine.sampler = self.sampler.inner

    def post(self, fn: Callable[[], None]) -> None:
        """Runs fn on the engine thread; fire and forget (safe from any thread)."""
        self.commands.put(fn)

    async def call(self, fn: Callable):
        """Runs fn on the engine thread between steps and returns its result (or raises its error)."""
        if self.error:
            raise EngineDeadError(self.error)
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run():
            try:
                if self.error:  # the engine died while this command waited
                    raise EngineDeadError(self.error)
                result, error = fn(), None
            except Exception as e:  # handed to the caller
                result, error = None, e
            loop.call_soon_threadsafe(settle, future, result, error)

        self.post(run)
        return await future

    async def add(self, prompts: list[list[int]], params: list[SamplingParams], top_logprobs: int | None,
                  kv_transfer_params: dict | None = None) -> tuple[list[str], asyncio.Queue]:
        """Queues one engine request per (prompt, params), all or none. Outputs arrive in the returned
        queue as (choice index, Output). kv_transfer_params go to a prefill or decode engine."""
        loop, out, arrival = asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter()
        base = f"http-{uuid.uuid4().hex[:16]}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        extra = {} if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        await self.call(lambda: self._add_all(ids, prompts, params, top_logprobs, (loop, out, arrival), extra))
        return ids, out

    def abort(self, request_ids: list[str]) -> None:
        self.post(lambda: self._abort(request_ids))

    async def prompt_logprobs(self, token_ids: list[int], k: int) -> list[TokenLogprob | None]:
        return await self.call(lambda: prompt_logprobs(self.engine.model, token_ids, k, self.engine.device))

    async def snapshot(self) -> dict:
        return await self.call(self._snapshot)

    # -- engine thread ---------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping:
            self.run_commands(block=not self.has_work())
            if self.stopping or not self.has_work():
                continue
            try:
                self.engine.step()
                self.publish()
            except Exception as e:  # the engine is broken: fail everyone, refuse new work
                log.exception("engine step failed")
                self.fail(f"engine step failed: {e!r}")

    def has_work(self) -> bool:
        return self.error is None and self.engine.has_unfinished()

    def run_commands(self, block: bool) -> None:
        try:
            command = self.commands.get(block=block)
            while True:
                try:
                    command()
                except Exception:
                    log.exception("engine command failed")
                command = self.commands.get_nowait()
        except queue.Empty:
            pass

    def _stop(self) -> None:
        self.stopping = True

    def _add_all(self, ids, prompts, params, top_logprobs, reply_to, extra) -> None:
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(prompt, p, request_id=rid, **extra)
                added.append(rid)
        except ValueError as e:
            for rid in added:
                self.engine.abort(rid)
                self.engine.pop_finished(rid)
            prefix = f"prompt {len(added)}: " if len(ids) > 1 else ""
            error = ValueError(prefix + str(e))
            error.retry_later = getattr(e, "retry_later", False)  # (the server answers 503 for those)
            raise error from e
        loop, out, arrival = reply_to
        for index, (rid, prompt) in enumerate(zip(ids, prompts)):
            self.tracked[rid] = Tracked(loop, out, index, len(prompt), arrival=arrival)
            if top_logprobs is not None:
                self.sampler.wanted[rid] = top_logprobs

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            t = self.tracked.pop(rid, None)
            if t is None:
                continue  # finished already
            self.engine.abort(rid)
            self.engine.pop_finished(rid)
            self.sampler.drop(rid)
            self.sampler.forget(rid)
            if self.metrics:
                self.metrics.on_finish(t, "abort", time.perf_counter())

    def publish(self) -> None:
        """Sends every tracked request's new tokens (and its end) to its queue."""
        now = time.perf_counter()
        for rid, t in list(self.tracked.items()):
            req = self.engine.requests[rid]
            new = req.output_token_ids[t.sent:]
            if not new and not req.finished:
                continue
            t.sent += len(new)
            out = Output(list(new), self.sampler.take(rid), req.finished, req.finish_reason,
                         req.output_text if req.finished else None, error=req.error,
                         stop_reason=req.stop_reason if req.finished else None)
            if self.metrics and new:
                self.metrics.on_tokens(t, len(new), now)
            t.first_token = t.first_token or now
            t.last_token = now
            if req.finished:
                self.tracked.pop(rid)
                self.engine.pop_finished(rid)
                self.sampler.drop(rid)
                if self.metrics:
                    self.metrics.on_finish(t, req.finish_reason, now)
            t.loop.call_soon_threadsafe(t.queue.put_nowait, (t.index, out))

    def fail(self, message: str) -> None:
        self.error = message
        now = time.perf_counter()
        for t in self.tracked.values():
            if self.metrics:  # (counted as vLLM counts a failed request: finished_reason="abort")
                self.metrics.on_finish(t, "abort", now)
            t.loop.call_soon_threadsafe(t.queue.put_nowait, (t.index, Output([], [], True, "abort", error=message)))
        self.tracked.clear()

    def _snapshot(self) -> dict:
        e = self.engine
        return {"running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                "tracked": len(self.tracked), **kv_accounting(e), "stats": e.stats_dict()}


def kv_accounting(engine) -> dict:
    """Blocks and bytes held: GPU pool (dense, quest) or host store plus GPU working set (offloaded)."""
    alloc = engine.allocator
    used = alloc.num_blocks - alloc.num_free
    out = {"kv_blocks_used": used, "gpu_kv_usage": alloc.usage, "host_kv_usage": 0.0, "host_kv_bytes_used": 0}
    if getattr(engine, "host", None) is not None:
        ws = getattr(engine.policy, "ws", None)
        rows_used = (ws.rows - ws.num_free_rows) if ws is not None else 0
        out["gpu_kv_usage"] = rows_used / ws.rows if ws is not None and ws.rows else 0.0
        out["gpu_working_set_rows_used"] = rows_used
        out["host_kv_usage"] = alloc.usage
        out["host_kv_bytes_used"] = used * engine.block_size * engine.kv_bytes_per_token
    return out


def settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
