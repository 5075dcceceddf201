"""CPU tests for the scheduler's prefill-first policy (SchedulerConfig.schedule_policy), driven by the
harness of tests/test_scheduler.py. Its random workloads run under both policies there."""
import pytest

from oasiskv.config import SchedulerConfig

from tests.test_scheduler import Harness, make_req, make_sched, summary


def test_prefill_first_decodes_wait_while_a_prompt_prefills():
    h = Harness(make_sched(num_blocks=40, max_num_batched_tokens=8, policy="prefill-first"))
    d = [h.add(make_req(f"d{i}", 4, 50, arrival=float(i))) for i in range(2)]
    h.step()  # d0, d1 prefill (4 + 4 tokens)
    p = h.add(make_req("p", 20, 3, arrival=10.0))
    assert [summary(h.step()) for _ in range(3)] == [
        [("p", 0, 8, [2], False)], [("p", 8, 8, [2], False)], [("p", 16, 4, [2, 3], True)]]
    assert [len(r.output_token_ids) for r in d] == [1, 1]  # the decodes waited three steps
    # no prefill left: every running request decodes in the same step
    assert [(c.request_id, len(c.token_ids)) for c in h.step().chunks] == [("d0", 1), ("d1", 1), ("p", 1)]


def test_prefill_first_decodes_run_when_the_queue_head_cannot_start():
    h = Harness(make_sched(num_blocks=4, policy="prefill-first"))
    a = h.add(make_req("a", 40, 3, arrival=0.0))
    h.step()  # a holds 3 blocks
    b = h.add(make_req("b", 32, 1, arrival=1.0))  # needs 2 blocks, 1 is free: it cannot be admitted
    assert summary(h.step()) == [("a", 40, 1, [0, 1, 2], True)]
    assert list(h.s.waiting) == [b]
    h.step()  # a's last decode; it finishes and frees its blocks
    assert a.finished and summary(h.step()) == [("b", 0, 32, [3, 0], True)]


def test_prefill_first_same_tokens_as_mixed():
    runs = {}
    for policy in ("mixed", "prefill-first"):
        h = Harness(make_sched(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=16, policy=policy))
        for i in range(6):
            h.add(make_req(f"r{i}", 10 + 7 * i, 5 + i, arrival=float(i)))
        steps = 0
        while h.s.has_unfinished():
            h.step()
            steps += 1
        runs[policy] = ({rid: r.output_token_ids for rid, r in h.reqs.items()}, sorted(h.finished), steps)
    assert runs["mixed"][:2] == runs["prefill-first"][:2]


def test_unknown_schedule_policy_is_refused():
    with pytest.raises(ValueError, match="schedule_policy must be one of mixed, prefill-first"):
        SchedulerConfig(schedule_policy="fifo")
