"""Launching the ranks and running them.

The engine's own process is rank 0: it keeps the scheduler, the sampler and the draft source. It
spawns ranks 1..N-1 (torch.multiprocessing, spawn); each builds the same engine on its share of the
model and KV, then runs the step plans rank 0 broadcasts (with the requests released since the
previous plan, so every rank frees and reuses working-set rows in the same order). Sampled tokens
reach the other ranks as the next plan's decode tokens.

Shutdown: closing (or garbage-collecting) rank 0's engine broadcasts a stop; ranks leave the group
and exit; any that do not within a few seconds are terminated. A rank whose parent died exits on its
own (a watchdog thread), so no process outlives the engine. A step that fails midway on rank 0 (an
error, Ctrl-C) leaves the others inside one of its collectives, where no stop message reaches them: rank 0
kills them at once and the engine refuses to run again (TensorParallel.lockstep)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import weakref

import torch
import torch.multiprocessing as mp
from tqdm.auto import tqdm
from multiprocessing import connection as mp_connection

from oasiskv.config import HEAD_DRAFTS, EngineConfig
from oasiskv.distributed.group import TensorParallel, current, join_group, leave_group, run_before_leave
from oasiskv.distributed.shard import check_shardable
from oasiskv.engine.runner import PendingTokens

JOIN_TIMEOUT_S = 10.0


def start_tensor_parallel(config: EngineConfig, device_type: str) -> TensorParallel | None:
    """None for one rank. In rank 0 (the caller's process) spawns the other ranks and joins the
    group; in a spawned rank returns the group it already joined."""
    world = config.tensor_parallel_size
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {world}")
    tp = current()
    if tp is not None and tp.rank != 0:  # a spawned rank, which joined its group before building its engine
        return tp
    if world == 1:
        return None
    if tp is not None:  # the caller's group belongs to an engine still alive: joining it would hang both
        raise RuntimeError("a tensor-parallel engine is already running in this process: close it (LLM.close(), "
                           "or drop every reference to it) before starting another")
    if config.kv.draft in HEAD_DRAFTS and config.kv.mode == "oasis":
        raise ValueError(f"--draft {config.kv.draft} is not supported with --tensor-parallel-size > 1 (its EAGLE-3 "
                         "head reads the full embedding); use --draft ngram or repeat")
    if config.kv.draft == "target" and config.kv.mode == "oasis":
        raise ValueError("--draft target is not supported with --tensor-parallel-size > 1 (the draft rows' logits "
                         "would need every rank's share of the output head); use --draft ngram or repeat")
    config.kv.require_layer_layout("--tensor-parallel-size > 1")
    from oasiskv.models.loader import model_config_of

    check_shardable(model_config_of(config.model), world)  # here, not in a spawned rank's traceback
    rendezvous = tempfile.mkdtemp(prefix="oasiskv-tp-")
    init_file = os.path.join(rendezvous, "init")
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)]  # (read, write): "started" signals
    procs = [ctx.Process(target=run_rank, args=(config, rank, world, init_file, device_type, os.getpid(), w),
                         daemon=True, name=f"oasiskv-tp-rank{rank}") for rank, (_, w) in enumerate(pipes, 1)]
    for p, (_, signal) in zip(procs, pipes):
        p.start()
        signal.close()  # the child holds the write end now: its death reads as end-of-file
    try:
        wait_started(procs, [r for r, _ in pipes])
        tp = join_group(0, world, init_file, device_type)
    except BaseException:
        stop_workers(None, procs, rendezvous)
        raise
    tp.shutdown = weakref.finalize(tp, stop_workers, tp.cpu_group, procs, rendezvous, tp.before_leave)
    tp.procs = procs
    return tp


def wait_started(procs: list, signals: list) -> None:
    """Returns once every spawned rank runs our code; raises if one died first (a script that starts
    an engine must guard its entry point with `if __name__ == "__main__":`, as spawn re-imports it)."""
    waiting = dict(zip(signals, procs))
    while waiting:
        for ready in mp_connection.wait(list(waiting)):
            proc = waiting.pop(ready)
            try:
                ready.recv()
            except EOFError:
                proc.join(JOIN_TIMEOUT_S)
                raise RuntimeError(f"tensor-parallel rank process {proc.name} exited with code {proc.exitcode} "
                                   "before joining (see its error above; a script that creates the engine must "
                                   "guard its entry point with `if __name__ == \"__main__\":`)") from None


def stop_workers(cpu_group, procs: list, rendezvous: str, before_leave: list = ()) -> None:
    stopped = False
    if cpu_group is not None and all(p.is_alive() for p in procs):
        try:
            import torch.distributed as dist

            dist.broadcast_object_list([None], src=0, group=cpu_group)
            stopped = True
        except Exception:  # a rank already gone: the others are terminated below
            pass
    if cpu_group is not None:
        # NCCL's teardown waits for every rank: leave while the ranks leave too (before joining them),
        # and abort instead when a rank is gone, since a destroy would wait for it forever
        if stopped:
            run_before_leave(before_leave)
        leave_group(abort=not stopped)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()) if cpu_group is not None else 0.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(JOIN_TIMEOUT_S)
    shutil.rmtree(rendezvous, ignore_errors=True)


def run_rank(config: EngineConfig, rank: int, world: int, init_file: str, device_type: str, parent: int,
             started) -> None:
    """Body of a spawned rank: join, build the engine, run plans until told to stop."""
    watch_parent(parent)
    tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock, which a fast exit would leak
    started.send(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        tp = join_group(rank, world, init_file, device_type)
        from oasiskv.engine.engine import LLMEngine  # after joining: the engine finds the group

        engine = LLMEngine(config.replace(show_progress=False))  # rank 0 shows the progress
        run_plans(engine, tp)
        run_before_leave(tp.before_leave)
    except Exception:
        traceback.print_exc()
        os._exit(1)  # the peers see the connection close
    leave_group()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's slow teardown: the engine waits for this exit


def run_plans(engine, tp: TensorParallel) -> None:
    pending = None  # async scheduling: the tokens rank 0 sampled in the last step, which the next plan reads
    while (message := tp.receive_step()) is not None:
        plan, released, tokens_follow = message
        for request_id in released:
            engine.policy.release(request_id)
            engine.policy.request_stats(request_id)  # forget its counters: only rank 0 reports them
        if plan.chunks:
            result = engine.runner.execute(plan, pending)
            pending = None
            if tokens_follow and result.request_ids:  # rank 0 overlapped this step (it may pause: engine.overlap_now)
                tokens = tp.receive_tokens(len(result.request_ids))
                pending = PendingTokens(tokens, {rid: i for i, rid in enumerate(result.request_ids)})


def watch_parent(parent: int) -> None:
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="oasiskv-parent-watchdog").start()
