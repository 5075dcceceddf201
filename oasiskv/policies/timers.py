"""Timers of the policies' phases: host wall time around phases (PhaseTimer, synchronising on the GPU only when
enabled) and GPU-side durations from CUDA event pairs (EventClock, never synchronising)."""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseTimer:
    """Seconds per phase; on the GPU it synchronises around phases only when enabled. A phase inside another is
    the inner one's time alone (the outer's excludes it), so the phases add up to the time they cover."""

    def __init__(self, enabled: bool, cuda: bool):
        self.enabled, self.cuda = enabled, cuda
        self.totals: dict[str, float] = defaultdict(float)
        self.open: list[str] = []  # the phases entered and not yet left, outermost first

    def __call__(self, phase: str):
        return _Phase(self, phase)


class _Phase:
    def __init__(self, timer: PhaseTimer, phase: str):
        self.timer, self.phase = timer, phase

    def __enter__(self):
        if self.timer.enabled:
            if self.timer.cuda:
                torch.cuda.synchronize()
            self.timer.open.append(self.phase)
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.timer.enabled:
            if self.timer.cuda:
                torch.cuda.synchronize()
            spent = time.perf_counter() - self.t0
            self.timer.totals[self.phase] += spent
            self.timer.open.pop()
            if self.timer.open:  # (the enclosing phase adds its whole time when it ends)
                self.timer.totals[self.timer.open[-1]] -= spent


class EventClock:
    """GPU-side durations from pairs of CUDA events, summed once both have completed (no sync)."""

    def __init__(self):
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.totals: dict[str, float] = defaultdict(float)

    @staticmethod
    def mark(stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def close(self, name: str, start: torch.cuda.Event, stream) -> torch.cuda.Event:
        end = self.mark(stream)
        self.pending.append((name, start, end))
        return end

    def collect(self) -> None:
        waiting = []
        for name, start, end in self.pending:
            if end.query():
                self.totals[name] += start.elapsed_time(end) / 1000
            else:
                waiting.append((name, start, end))
        self.pending = waiting
