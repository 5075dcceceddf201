"""This process's place in the tensor-parallel group, and the collectives the engine needs.

Tensors (activations, logits, block scores) go through the default group: NCCL on CUDA, gloo on
the CPU. Plain data (the step plan, sizes the ranks agree on) goes through a second, gloo group, so
it never waits on a GPU stream."""
from __future__ import annotations

import contextlib
import datetime
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from oasiskv.distributed.plans import BlockTables

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # ranks load the model between collectives
IDLE_TIMEOUT = datetime.timedelta(days=365)  # ranks wait for the next plan as long as the engine idles
_current: weakref.ref | None = None  # the group of this process, if any (a weak reference: the engine owns it)


@dataclass(eq=False)
class TensorParallel:
    rank: int
    world: int
    device: torch.device
    cpu_group: dist.ProcessGroup
    released: list[str] = field(default_factory=list)  # rank 0: requests released since the last plan
    shutdown: object = None  # rank 0: stops the workers (idempotent); set by launch
    procs: list = field(default_factory=list)  # rank 0: the spawned ranks' processes
    # weak references to callables run before leaving the group (graph release); weak, so that a hook
    # never keeps the engine, and with it this group, alive
    before_leave: list = field(default_factory=list)
    combiner: object = None  # the sparse policy's ScoreCombiner, for its statistics
    plans_sent: int = 0
    plan_seconds: float = 0.0  # rank 0: pickling and broadcasting step plans
    tables: BlockTables = field(default_factory=BlockTables)  # block tables the other ranks hold
    failed: str | None = None  # rank 0: the error that broke off a step, after which the ranks were stopped

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- plain data (gloo) ----------------------------------------------------------------------------
    def agree_min(self, value: float) -> float:
        """The smallest of every rank's value (memory each rank can spare), on every rank."""
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return type(value)(t.item())

    def note_release(self, request_id: str) -> None:
        self.released.append(request_id)

    def send_step(self, plan, tokens_follow: bool = False) -> None:
        """Rank 0: the step plan and the requests released before it, to every other rank; `tokens_follow`: the
        step's sampled tokens follow by send_tokens (async scheduling)."""
        if self.failed is not None:
            raise RuntimeError(f"a step of this tensor-parallel engine failed midway ({self.failed}), so its ranks "
                               "were stopped: this engine cannot run again; create a new one")
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank process {dead[0].name} exited (code {dead[0].exitcode}): "
                               "this engine cannot run; close it and start a new one")
        t0 = time.perf_counter()
        self.tables.forget(self.released)
        self.broadcast((self.tables.encode(plan), self.released, tokens_follow))
        self.released = []
        self.plans_sent += 1
        self.plan_seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def lockstep(self):
        """Rank 0: the part of a step in which the other ranks follow its collectives. An error or Ctrl-C inside it
        leaves them waiting in a collective that no later message can reach (a stop message included), so they
        are stopped at once and the group is left: the engine fails fast instead of waiting out the timeout."""
        try:
            yield
        except BaseException as e:
            self.abort(repr(e))
            raise

    def abort(self, reason: str) -> None:
        """Rank 0: kills the other ranks (wherever they wait) and leaves the group; idempotent."""
        self.failed = self.failed or reason
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()
        self.shutdown()  # with the ranks gone it sends no stop message and aborts the group

    def receive_step(self):
        """Other ranks: (plan, released request ids, whether its tokens follow), or None when the engine closes."""
        message = self.broadcast(None)
        if message is None:
            return None
        plan, released, tokens_follow = message
        self.tables.forget(released)
        return self.tables.decode(plan), released, tokens_follow

    def stats(self) -> dict:
        out = {"tp_size": self.world, "tp_plans_sent": self.plans_sent,
               "tp_plan_broadcast_s": round(self.plan_seconds, 6)}
        return {**out, **(self.combiner.stats() if self.combiner else {})}

    def send_tokens(self, tokens: torch.Tensor) -> None:
        """Rank 0, async scheduling: a step's sampled tokens (int64 on the device) to the other ranks, whose next
        step reads them on the device as rank 0's does (engine/overlap.py)."""
        dist.broadcast(tokens, src=0)

    def receive_tokens(self, count: int) -> torch.Tensor:
        """Other ranks: the `count` tokens rank 0 sampled in the step just run."""
        tokens = torch.empty(count, dtype=torch.long, device=self.device)
        dist.broadcast(tokens, src=0)
        return tokens

    def broadcast(self, message):
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


def current() -> TensorParallel | None:
    return _current() if _current is not None else None


def join_group(rank: int, world: int, init_file: str, device_type: str) -> TensorParallel:
    """Joins the group through a file rendezvous; cuda ranks use GPU `rank`."""
    global _current
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process (or torch.distributed "
                           "was initialised by the caller): close it first")
    if device_type == "cuda":
        if torch.cuda.device_count() < world:
            raise ValueError(f"--tensor-parallel-size {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT, device_id=device if device.type == "cuda" else None)
    tp = TensorParallel(rank, world, device, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))
    _current = weakref.ref(tp)
    return tp


def run_before_leave(hooks: list) -> None:
    """Calls the hooks whose objects are still alive (a freed object has nothing left to release)."""
    for ref in hooks:
        hook = ref()
        if hook is not None:
            hook()


def leave_group(abort: bool = False) -> None:
    """Leaves the group. `abort`: a peer is gone, so NCCL's communicators are aborted first (their
    orderly teardown would wait for it)."""
    global _current
    _current = None
    if not dist.is_initialized():
        return
    aborter = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort and aborter is not None and dist.get_backend() == "nccl":
        aborter()
    if dist.is_initialized():  # an abort may already have taken the group down
        dist.destroy_process_group()
