"""Where one decode step's time goes, phase by phase (`oasiskv bench throughput --profile-step`).

B requests are prefilled, then `steps` pure decode steps are run three times:
1. as they are (mean wall time per step);
2. under torch.profiler on the GPU (the time kernels ran, all streams summed): wall minus kernel time is
   the host-bound gap, the Python and launch overhead a CUDA graph removes;
3. with synchronising timers around the engine's phases (scheduling, step inputs, selection, attention,
   gather waits, draft, sampling, ...). Each phase's time is exclusive of the phases nested in it; what the
   engine does outside them is "engine loop (Python)". The timers wait only for the compute stream, so the
   copy stream's prefetches stay asynchronous and only their exposed waits are counted.
The timers wrap methods of this engine's objects (instance attributes) and the dense policy's attention
functions for the duration of the profile, and are removed afterwards; a method a policy lacks is not timed.
Work replayed inside a captured CUDA graph is not visible to them: profile with graphs off.
"""
from __future__ import annotations

import importlib
import time
from contextlib import contextmanager

import torch

from oasiskv.bench.workload import random_prompts
from oasiskv.config import SamplingParams

# (object on the engine, method, phase); nested calls are subtracted from their callers
PHASES = (
    ("scheduler", "schedule", "scheduling"),
    ("runner", "prepare", "step inputs (host -> GPU)"),
    ("policy", "begin_step", "step inputs (host -> GPU)"),
    ("runner", "execute", "model: embeddings, projections, MLP, norms"),
    ("policy", "attend", "KV write, summaries, working set"),
    ("policy", "select", "selection (scores + top-k)"),
    ("policy", "resident_selection", "selection (scores + top-k)"),
    ("policy", "fetch", "gather (synchronous)"),
    ("policy", "wait_for_copies", "gather wait"),
    ("policy", "wait_for_prefetch", "gather wait"),
    ("policy", "attention", "attention"),
    ("policy", "attend_with_draft", "attention"),
    ("policy", "predict_and_prefetch", "draft: prediction + prefetch issue"),
    ("model", "logits", "sampling (logits + sampler)"),
    ("sampler", "sample", "sampling (logits + sampler)"),
    ("engine", "propose_drafts", "draft: next draft tokens"),
)
ROOT = "engine loop (Python)"
# functions a policy calls by module name: (module, function, phase)
FUNCTIONS = (("oasiskv.policies.dense", "paged_decode_attention", "attention"),
             ("oasiskv.policies.dense", "paged_decode_reference", "attention"))


class PhaseClock:
    """Exclusive seconds per phase from nested, synchronised timers."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.totals: dict[str, float] = {}
        self.stack: list[list] = []  # [phase, start, time spent in nested phases]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            self.sync()
            self.stack.append([phase, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                name, start, nested = self.stack.pop()
                spent = time.perf_counter() - start
                self.totals[name] = self.totals.get(name, 0.0) + spent - nested
                if self.stack:
                    self.stack[-1][2] += spent
        return timed


@contextmanager
def phase_timers(engine, clock: PhaseClock):
    """Installs the timers on this engine's objects; removes them on exit."""
    installed = []
    for owner_name, method, phase in PHASES + (("engine", "step", ROOT),):
        owner = engine if owner_name == "engine" else getattr(engine, owner_name, None)
        if owner is None or not callable(getattr(owner, method, None)) or method in vars(owner):
            continue
        setattr(owner, method, clock.wrap(phase, getattr(owner, method)))
        installed.append((owner, method))
    patched = []
    for module_name, name, phase in FUNCTIONS:
        module = importlib.import_module(module_name)
        patched.append((module, name, getattr(module, name)))
        setattr(module, name, clock.wrap(phase, getattr(module, name)))
    try:
        yield
    finally:
        for owner, method in installed:
            delattr(owner, method)
        for module, name, original in patched:
            setattr(module, name, original)


def decode_batch(engine, batch: int, input_len: int, steps: int, seed: int) -> list[str]:
    """Adds `batch` requests (fewer if their longer outputs do not fit) and steps until every one of them is
    decoding. Returns their ids."""
    prefill_steps = batch + -(-batch * input_len // engine.scheduler.cfg.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + 3 * steps + 4, ignore_eos=True)
    batch = min(batch, engine.max_concurrency(input_len + params.max_tokens))
    ids = [engine.add_request(p, params)
           for p in random_prompts(batch, input_len, engine.model_config.vocab_size, seed)]
    while any(not engine.requests[i].output_token_ids for i in ids):
        engine.step()
    if engine.scheduler.waiting or any(engine.requests[i].finished for i in ids):
        raise RuntimeError(f"profile: {batch} requests of {input_len} tokens do not decode together; lower the batch")
    return ids


def wall_ms_per_step(engine, steps: int) -> float:
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return 1000 * (time.perf_counter() - t) / steps


def gpu_kernel_ms_per_step(engine, steps: int) -> float | None:
    if engine.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return device_busy_us(prof.key_averages()) / 1000 / steps


def device_busy_us(rows) -> float:
    """The kernels' own time: a CPU op's row also carries its kernels' time (self_device_time_total), so counting
    every row counted each op-launched kernel twice; the device rows alone count it once, as torch's table total."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in rows if e.device_type == DeviceType.CUDA)


def profile_step(engine, batch: int, input_len: int, steps: int, seed: int = 0) -> dict:
    """Phase breakdown of `steps` decode steps at `batch` requests of `input_len` tokens (ms per step)."""
    ids = decode_batch(engine, batch, input_len, steps, seed)
    for _ in range(2):
        engine.step()
    wall = wall_ms_per_step(engine, steps)
    kernels = gpu_kernel_ms_per_step(engine, steps)
    clock = PhaseClock(engine.device.type == "cuda")
    with phase_timers(engine, clock):
        synced = wall_ms_per_step(engine, steps)
    for i in ids:
        engine.abort(i)
        engine.pop_finished(i)
    phases = {k: round(1000 * v / steps, 3) for k, v in sorted(clock.totals.items(), key=lambda kv: -kv[1])}
    return {"batch": len(ids), "steps": steps, "step_ms": round(wall, 3),
            "gpu_kernel_ms": None if kernels is None else round(kernels, 3),
            "host_gap_ms": None if kernels is None else round(wall - kernels, 3),
            "synced_step_ms": round(synced, 3), "phases_ms": phases}


def format_profile(mode: str, prof: dict) -> str:
    lines = [f"\n{mode}: one decode step at batch {prof['batch']}, {prof['step_ms']:.2f} ms as run "
             f"({prof['synced_step_ms']:.2f} ms with the phase timers)"]
    if prof["gpu_kernel_ms"] is not None:
        lines.append(f"  GPU kernels {prof['gpu_kernel_ms']:.2f} ms/step (all streams); host-bound gap "
                     f"{prof['host_gap_ms']:.2f} ms/step (Python, launches)")
    for phase, ms in prof["phases_ms"].items():
        lines.append(f"  {phase:<44} {ms:9.3f} ms  {100 * ms / max(prof['synced_step_ms'], 1e-9):5.1f}%")
    return "\n".join(lines)
