"""The policies' CPU phase timers: nested phases are counted once (a helper's audit of the statistics found --shortlist's
list fetch, a "gather" inside "select", counted in both, so the phases added up to more than the step)."""
from __future__ import annotations

import itertools

from oasiskv.policies import timers
from oasiskv.policies.timers import PhaseTimer


def test_an_inner_phase_is_left_out_of_the_outer_one(monkeypatch):
    clock = itertools.count()  # each reading one second later: 0, 1, 2, ...
    monkeypatch.setattr(timers.time, "perf_counter", lambda: float(next(clock)))
    timer = PhaseTimer(enabled=True, cuda=False)
    with timer("select"):  # enters at 0
        with timer("gather"):  # 1 to 2
            pass
        with timer("gather"):  # 3 to 4
            pass
    # leaves at 5
    assert dict(timer.totals) == {"select": 3.0, "gather": 2.0} and not timer.open
    with timer("attention"):  # 6 to 7: a phase alone keeps its whole time
        pass
    assert timer.totals["attention"] == 1.0
