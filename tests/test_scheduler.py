"""CPU tests for the continuous-batching scheduler, driven by hand the way the engine drives it.

After each schedule() the harness does what Engine.step does: every chunk advances
num_computed_tokens by its length; a sampling chunk appends one (fake) output token; a request with
max_tokens outputs is finished with reason "length".
"""
import random
import zlib

import pytest

from oasiskv.config import SamplingParams, SchedulerConfig
from oasiskv.engine.request import Request, RequestStatus
from oasiskv.engine.scheduler import Scheduler
from oasiskv.kv.block_allocator import BlockAllocator

BS = 16


def ceil_div(a, b):
    return -(-a // b)


def make_sched(num_blocks, max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=4096, policy="mixed"):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          schedule_policy=policy)
    return Scheduler(cfg, BlockAllocator(num_blocks), BS, max_model_len)


def make_req(rid, prompt_len, max_tokens, arrival, base=None):
    base = (_h(rid) % 1000) * 1000 if base is None else base
    prompt = [base + i for i in range(prompt_len)]
    return Request(rid, None, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=arrival)


def _h(rid):
    return zlib.crc32(rid.encode())


def fake_token(req):
    """Deterministic output token: depends only on the request and the output index."""
    return 900_000 + 1000 * (_h(req.request_id) % 100) + len(req.output_token_ids)


class Harness:
    def __init__(self, sched):
        self.s = sched
        self.reqs = {}
        self.finished = []
        self.emitted = {}  # every token ever appended, per request: outputs must never be lost

    def add(self, req):
        self.s.add(req)
        self.reqs[req.request_id] = req
        return req

    def step(self):
        out = self.s.schedule()
        for c in out.chunks:
            req = self.reqs[c.request_id]
            # a chunk always continues exactly where the cache ends, with the request's own tokens
            assert c.start == req.num_computed_tokens
            assert c.token_ids == (req.prompt_token_ids + req.output_token_ids)[c.start:c.start + len(c.token_ids)]
            assert c.block_ids == req.block_ids
            assert len(c.block_ids) == ceil_div(c.start + len(c.token_ids), BS)
            assert c.sample == (c.start + len(c.token_ids) == req.num_tokens)
        for c in out.chunks:
            self.reqs[c.request_id].num_computed_tokens += len(c.token_ids)
        for c in out.chunks:
            if c.sample:
                req = self.reqs[c.request_id]
                tok = fake_token(req)
                req.output_token_ids.append(tok)
                self.emitted.setdefault(req.request_id, []).append(tok)
                if len(req.output_token_ids) >= req.params.max_tokens:
                    self.s.finish(req, "length")
                    self.finished.append(req.request_id)
        return out


def summary(out):
    return [(c.request_id, c.start, len(c.token_ids), c.block_ids, c.sample) for c in out.chunks]


# --------------------------------------------------------------------------------------------------
def test_single_request_block_ids_and_decode():
    h = Harness(make_sched(num_blocks=10))
    a = h.add(make_req("a", 30, 5, arrival=0.0))
    assert h.s.has_unfinished()
    out = h.step()
    assert summary(out) == [("a", 0, 30, [0, 1], True)]
    assert out.preempted == []
    assert a.status == RequestStatus.RUNNING and h.s.running == [a] and not h.s.waiting
    assert a.token_slice(0, 30) == a.prompt_token_ids
    # decodes: positions 30, 31 fit in two blocks; position 32 needs a third (block 2)
    assert summary(h.step()) == [("a", 30, 1, [0, 1], True)]
    assert summary(h.step()) == [("a", 31, 1, [0, 1], True)]
    assert summary(h.step()) == [("a", 32, 1, [0, 1, 2], True)]
    assert h.s.allocator.num_free == 7
    assert summary(h.step()) == [("a", 33, 1, [0, 1, 2], True)]
    assert a.finished and a.finish_reason == "length"
    assert len(a.output_token_ids) == 5
    assert a.block_ids == [] and h.s.allocator.num_free == 10 and h.s.allocator.usage == 0
    assert not h.s.has_unfinished()
    assert summary(h.step()) == []
    # FIFO: the next request gets never-used blocks first, then the freed ones in free order
    b = h.add(make_req("b", 16 * 9, 1, arrival=1.0))
    assert summary(h.step()) == [("b", 0, 144, [3, 4, 5, 6, 7, 8, 9, 0, 1], True)]
    assert b.finished


def test_block_ids_of_several_requests_and_reuse_order():
    h = Harness(make_sched(num_blocks=8))
    a = h.add(make_req("a", 20, 1, arrival=0.0))
    b = h.add(make_req("b", 40, 3, arrival=1.0))
    out = h.step()
    assert summary(out) == [("a", 0, 20, [0, 1], True), ("b", 0, 40, [2, 3, 4], True)]
    assert a.finished  # max_tokens=1: freed [0, 1]
    c = h.add(make_req("c", 16, 2, arrival=2.0))
    d = h.add(make_req("d", 33, 1, arrival=3.0))
    out = h.step()
    # b decodes first; then c gets never-used 5, d gets 6, 7 and then the freed 0
    assert summary(out) == [
        ("b", 40, 1, [2, 3, 4], True),
        ("c", 0, 16, [5], True),
        ("d", 0, 33, [6, 7, 0], True),
    ]
    out = h.step()
    assert summary(out) == [("b", 41, 1, [2, 3, 4], True), ("c", 16, 1, [5, 1], True)]
    assert b.finished and c.finished and d.finished
    assert h.s.allocator.num_free == 8


def test_chunked_prefill_boundaries():
    h = Harness(make_sched(num_blocks=10, max_num_batched_tokens=16))
    a = h.add(make_req("a", 40, 2, arrival=0.0))
    chunks = []
    out = h.step()
    chunks += summary(out)
    assert a.output_token_ids == []
    out = h.step()
    chunks += summary(out)
    assert a.output_token_ids == []
    out = h.step()
    chunks += summary(out)
    assert len(a.output_token_ids) == 1
    assert chunks == [
        ("a", 0, 16, [0], False),
        ("a", 16, 16, [0, 1], False),
        ("a", 32, 8, [0, 1, 2], True),
    ]
    assert [c.token_ids for c in h.s.schedule().chunks] == [[a.output_token_ids[0]]]


def test_prefill_chunks_exactly_fill_the_budget_and_admit_the_next_request():
    h = Harness(make_sched(num_blocks=10, max_num_batched_tokens=16))
    h.add(make_req("a", 20, 1, arrival=0.0))
    h.add(make_req("b", 30, 1, arrival=1.0))
    assert summary(h.step()) == [("a", 0, 16, [0], False)]
    # a finishes its prompt (4 tokens) and b gets the remaining 12 tokens of the budget
    assert summary(h.step()) == [("a", 16, 4, [0, 1], True), ("b", 0, 12, [2], False)]
    assert summary(h.step()) == [("b", 12, 16, [2, 3], False)]
    assert summary(h.step()) == [("b", 28, 2, [2, 3], True)]
    assert not h.s.has_unfinished()


def test_decodes_scheduled_before_partial_prefills():
    h = Harness(make_sched(num_blocks=10, max_num_batched_tokens=16))
    # b arrived first but is queued behind a; after step 1, a decodes while b is mid-prefill
    a = h.add(make_req("a", 4, 10, arrival=1.0))
    b = h.add(make_req("b", 40, 10, arrival=0.0))
    assert summary(h.step()) == [("a", 0, 4, [0], True), ("b", 0, 12, [1], False)]
    # by arrival b would go first and take the whole budget; decode-first gives a its token
    assert summary(h.step()) == [("a", 4, 1, [0], True), ("b", 12, 15, [1, 2], False)]
    assert summary(h.step()) == [("a", 5, 1, [0], True), ("b", 27, 13, [1, 2, 3], True)]
    # both decoding now: arrival order among decodes
    assert summary(h.step()) == [("b", 40, 1, [1, 2, 3], True), ("a", 6, 1, [0], True)]
    assert len(a.output_token_ids) == 4 and len(b.output_token_ids) == 2


def test_decodes_are_not_starved_by_a_long_prefill():
    h = Harness(make_sched(num_blocks=40, max_num_batched_tokens=8))
    d = [h.add(make_req(f"d{i}", 4, 50, arrival=float(i))) for i in range(2)]
    h.step()  # d0, d1 prefill (4 + 4 tokens)
    p = h.add(make_req("p", 200, 1, arrival=10.0))
    for _ in range(5):
        out = h.step()
        ids = [c.request_id for c in out.chunks]
        assert ids[:2] == ["d0", "d1"]
        assert [len(c.token_ids) for c in out.chunks] == [1, 1, 6]
        assert out.num_tokens == 8
    assert len(d[0].output_token_ids) == 6 and p.num_computed_tokens == 30


@pytest.mark.parametrize("policy", ["mixed", "prefill-first"])
@pytest.mark.parametrize("prompt_len", [1, 2])
def test_running_requests_never_outnumber_the_token_budget(policy, prompt_len):
    # 5 requests, 2 tokens a step: at most 2 run at once, so every running decode gets its token in every step
    # and the waiting requests are admitted as the running ones finish (prefill-first admitted all 5, and then
    # the newest decodes waited for the oldest to finish; vLLM refuses such a budget)
    h = Harness(make_sched(num_blocks=40, max_num_batched_tokens=2, policy=policy))
    reqs = [h.add(make_req(f"r{i}", prompt_len, 6, arrival=float(i))) for i in range(5)]
    steps = 0
    while h.s.has_unfinished():
        running = [r for r in h.s.running if r.num_uncomputed == 1]
        out = h.step()
        steps += 1
        assert len(h.s.running) <= 2 and out.num_tokens <= 2
        left_out = {r.request_id for r in running} - {c.request_id for c in out.chunks}
        prefilled = any(c.start < prompt_len for c in out.chunks)
        assert not left_out or (policy == "prefill-first" and prefilled)  # decodes wait only for a prefill
    assert all(len(r.output_token_ids) == 6 for r in reqs) and steps <= 20


def test_max_num_seqs_respected():
    h = Harness(make_sched(num_blocks=20, max_num_seqs=2))
    a = h.add(make_req("a", 5, 2, arrival=0.0))
    b = h.add(make_req("b", 5, 3, arrival=1.0))
    c = h.add(make_req("c", 5, 1, arrival=2.0))
    assert [x.request_id for x in h.step().chunks] == ["a", "b"]
    assert list(h.s.waiting) == [c] and c.status == RequestStatus.WAITING and c.block_ids == []
    assert [x.request_id for x in h.step().chunks] == ["a", "b"]
    assert a.finished
    # a's slot is free: c is admitted in the same step as b's decode
    out = h.step()
    assert summary(out) == [("b", 6, 1, [1], True), ("c", 0, 5, [2], True)]
    assert b.finished and c.finished


def test_waiting_requests_wait_while_blocks_are_short():
    h = Harness(make_sched(num_blocks=4))
    a = h.add(make_req("a", 48, 2, arrival=0.0))
    b = h.add(make_req("b", 32, 1, arrival=1.0))
    c = h.add(make_req("c", 16, 1, arrival=2.0))
    out = h.step()
    # b needs 2 blocks, only 1 is free: b waits, and c (which would fit) does not overtake it
    assert summary(out) == [("a", 0, 48, [0, 1, 2], True)]
    assert list(h.s.waiting) == [b, c]
    assert b.block_ids == [] and c.block_ids == [] and b.num_computed_tokens == 0
    out = h.step()
    assert summary(out) == [("a", 48, 1, [0, 1, 2, 3], True)]
    assert a.finished and h.s.allocator.num_free == 4
    out = h.step()
    assert summary(out) == [("b", 0, 32, [0, 1], True), ("c", 0, 16, [2], True)]
    assert b.finished and c.finished
    assert out.preempted == [] and h.s.num_preemptions == 0


def test_preemption_by_recompute():
    # 3 blocks; a and b each fit alone (16 + 4 tokens -> 2 blocks); max_num_seqs keeps c waiting
    h = Harness(make_sched(num_blocks=3, max_num_seqs=2))
    a = h.add(make_req("a", 16, 4, arrival=0.0))
    b = h.add(make_req("b", 16, 4, arrival=1.0))
    c = h.add(make_req("c", 16, 1, arrival=2.0))
    out = h.step()
    assert summary(out) == [("a", 0, 16, [0], True), ("b", 0, 16, [1], True)]
    b_out = list(b.output_token_ids)
    assert len(b_out) == 1

    # a's decode takes the last free block; b (latest arrival, not yet scheduled) is preempted
    out = h.step()
    assert summary(out) == [("a", 16, 1, [0, 2], True)]
    assert out.preempted == ["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.output_token_ids == b_out and b.num_preemptions == 1 and h.s.num_preemptions == 1
    assert list(h.s.waiting) == [b, c] and h.s.running == [a]
    assert h.s.allocator.num_free == 1
    # c would fit in the freed block, but no request is admitted in a step that preempted

    # b needs 2 blocks to recompute 17 tokens; only 1 free -> b waits at the head, c does not pass
    out = h.step()
    assert summary(out) == [("a", 17, 1, [0, 2], True)]
    assert list(h.s.waiting) == [b, c]
    out = h.step()
    assert summary(out) == [("a", 18, 1, [0, 2], True)]
    assert a.finished and h.s.allocator.num_free == 3

    # b resumes: one chunk re-covers prompt + its output so far, then samples its next token
    out = h.step()
    assert summary(out) == [("b", 0, 17, [1, 0], True), ("c", 0, 16, [2], True)]
    assert out.chunks[0].token_ids == b.prompt_token_ids + b_out
    assert b.output_token_ids[:1] == b_out and len(b.output_token_ids) == 2
    assert c.finished
    assert summary(h.step()) == [("b", 17, 1, [1, 0], True)]
    assert summary(h.step()) == [("b", 18, 1, [1, 0], True)]
    assert b.finished and len(b.output_token_ids) == 4
    assert b.output_token_ids == [900_000 + 1000 * (_h("b") % 100) + i for i in range(4)]
    assert h.s.allocator.num_free == 3 and not h.s.has_unfinished()


def _put_running(sched, req, computed, outputs=0):
    """Puts req straight into the running set with `computed` tokens cached (consistent state)."""
    sched.check_admissible(req)
    req.output_token_ids = [fake_token(req) + i for i in range(outputs)]
    req.num_computed_tokens = computed
    req.block_ids = sched.allocator.allocate(ceil_div(computed, BS))
    req.status = RequestStatus.RUNNING
    sched.running.append(req)


def test_victim_is_latest_arrival_not_yet_scheduled():
    s = make_sched(num_blocks=5, max_num_batched_tokens=33)
    p = make_req("p", 64, 1, arrival=0.0)
    v = make_req("v", 64, 1, arrival=1.0)
    x = make_req("x", 16, 5, arrival=2.0)
    _put_running(s, p, 16)  # partial prefill, block 0
    _put_running(s, v, 16)  # partial prefill, block 1
    _put_running(s, x, 16, outputs=1)  # decode, block 2; latest arrival
    out = s.schedule()
    # x decodes first (block 3). p wants 32 tokens -> 2 more blocks, 1 free: the victim is v, the
    # latest arrival among requests not yet scheduled, although x arrived later
    assert out.preempted == ["v"]
    assert summary(out) == [("x", 16, 1, [2, 3], True), ("p", 16, 32, [0, 4, 1], False)]
    assert v.status == RequestStatus.WAITING and v.block_ids == [] and v.num_computed_tokens == 0
    assert list(s.waiting) == [v] and s.running == [p, x]
    assert s.allocator.num_free == 0


def test_two_victims_in_one_step_queue_by_arrival():
    s = make_sched(num_blocks=6, max_num_batched_tokens=64)
    a = make_req("a", 90, 1, arrival=0.0)
    b = make_req("b", 30, 1, arrival=1.0)
    c = make_req("c", 30, 1, arrival=2.0)
    w = make_req("w", 8, 1, arrival=3.0)
    _put_running(s, a, 16)  # block 0; wants 64 more tokens -> 5 blocks in all
    _put_running(s, b, 16)  # block 1
    _put_running(s, c, 16)  # block 2
    s.add(w)
    out = s.schedule()
    # a needs 4 more blocks, 3 free: preempting c (the latest arrival) frees a 4th, enough
    assert out.preempted == ["c"]
    assert summary(out) == [("a", 16, 64, [0, 3, 4, 5, 2], False)]
    assert list(s.waiting) == [c, w]

    s2 = make_sched(num_blocks=6, max_num_batched_tokens=80)
    a = make_req("a", 90, 1, arrival=0.0)
    b = make_req("b", 30, 1, arrival=1.0)
    c = make_req("c", 30, 1, arrival=2.0)
    _put_running(s2, a, 16)
    _put_running(s2, b, 16)
    _put_running(s2, c, 16)
    w2 = make_req("w", 8, 1, arrival=3.0)
    s2.add(w2)
    out = s2.schedule()
    # a wants its remaining 74 tokens -> 6 blocks in all, 5 more: both c and b must go, c first
    assert out.preempted == ["c", "b"]
    assert summary(out) == [("a", 16, 74, [0, 3, 4, 5, 2, 1], True)]
    # each victim goes to the head of the queue: the earlier arrival (b) ends up first
    assert list(s2.waiting) == [b, c, w2]
    assert s2.num_preemptions == 2 and s2.allocator.num_free == 0


def test_request_preempts_itself_when_it_is_the_latest():
    s = make_sched(num_blocks=3, max_num_batched_tokens=64)
    a = make_req("a", 16, 10, arrival=0.0)
    b = make_req("b", 16, 10, arrival=1.0)
    _put_running(s, a, 16, outputs=1)
    _put_running(s, b, 16, outputs=1)
    out = s.schedule()
    assert summary(out) == [("a", 16, 1, [0, 2], True)]
    assert out.preempted == ["b"]
    assert b.status == RequestStatus.WAITING and len(b.output_token_ids) == 1


def test_check_admissible_errors_leave_state_unchanged():
    s = make_sched(num_blocks=4, max_model_len=100)
    s.add(make_req("ok", 10, 1, arrival=0.0))
    free_before = s.allocator.num_free
    bad = [
        make_req("empty", 0, 1, arrival=1.0),
        make_req("eq", 100, 1, arrival=1.0),  # prompt == max_model_len
        make_req("over", 101, 1, arrival=1.0),
        make_req("pool", 61, 5, arrival=1.0),  # 66 - 1 = 65 computed tokens -> 5 blocks > 4
        make_req("pool2", 10, 90, arrival=1.0),  # min(100, 100) = 100 tokens -> 7 blocks
    ]
    for r in bad:
        with pytest.raises(ValueError):
            s.check_admissible(r)
        with pytest.raises(ValueError):
            s.add(r)
        assert r.status == RequestStatus.WAITING and r.block_ids == [] and r.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["ok"]
    assert s.running == [] and s.allocator.num_free == free_before == 4


def test_check_admissible_accepts_boundaries():
    s = make_sched(num_blocks=4, max_model_len=100)
    s.check_admissible(make_req("a", 1, 1, arrival=0.0))
    s.check_admissible(make_req("b", 60, 4, arrival=0.0))  # 64 tokens: exactly the pool
    s.check_admissible(make_req("c", 63, 1, arrival=0.0))  # 64 tokens
    s.check_admissible(make_req("c2", 1, 63, arrival=0.0))  # 64 tokens
    s2 = make_sched(num_blocks=4, max_model_len=64)
    # max_tokens is capped by max_model_len: prompt 60 + up to 4 tokens
    s2.check_admissible(make_req("d", 60, 1000, arrival=0.0))
    s2.check_admissible(make_req("e", 63, 1000, arrival=0.0))
    assert not s.waiting and not s2.waiting


def test_check_admissible_accepts_request_needing_exactly_the_pool():
    # prompt 64 + max_tokens 1: the engine computes 64 tokens (4 blocks) and stops after sampling
    # one token, so the 4-block pool suffices. Shown by running it with the check bypassed:
    s = make_sched(num_blocks=4)
    h = Harness(s)
    r = make_req("r", 64, 1, arrival=0.0)
    h.reqs["r"] = r
    s.waiting.append(r)
    assert summary(h.step()) == [("r", 0, 64, [0, 1, 2, 3], True)]
    assert r.finished
    s.check_admissible(make_req("r2", 64, 1, arrival=0.0))


def test_finish_waiting_and_running_requests():
    h = Harness(make_sched(num_blocks=4, max_num_seqs=1))
    a = h.add(make_req("a", 20, 5, arrival=0.0))
    b = h.add(make_req("b", 5, 5, arrival=1.0))
    h.step()
    h.s.finish(b, "abort")  # still waiting
    assert b.finished and b.finish_reason == "abort" and list(h.s.waiting) == []
    h.s.finish(a, "abort")  # running, holds 2 blocks
    assert a.finished and a.block_ids == [] and h.s.running == []
    assert h.s.allocator.num_free == 4 and not h.s.has_unfinished()


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["mixed", "prefill-first"])
@pytest.mark.parametrize("seed", range(20))
def test_random_workload_invariants(seed, policy):
    rng = random.Random(seed)
    num_blocks = rng.choice([6, 8, 12])
    cfg = dict(max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([8, 16, 33, 64]))
    s = make_sched(num_blocks=num_blocks, max_model_len=512, policy=policy, **cfg)
    h = Harness(s)
    n_req = 40
    pending = []
    for i in range(n_req):
        while True:
            p, m = rng.randint(1, 90), rng.randint(1, 40)
            if ceil_div(p + m, BS) <= num_blocks:
                break
        pending.append((rng.randint(0, 60), make_req(f"r{i}", p, m, arrival=float(i), base=10_000 * i)))
    pending.sort(key=lambda t: t[0])
    step = 0
    preempted_total = 0
    while pending or s.has_unfinished():
        while pending and pending[0][0] <= step:
            h.add(pending.pop(0)[1])
        before = {r.request_id: (r.num_uncomputed, r.arrival_time) for r in s.running}
        had_work = s.has_unfinished()
        out = h.step()
        step += 1
        assert step < 5000, "no progress"
        # whenever work exists, every step schedules something (no livelock)
        assert bool(out.chunks) == had_work
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids))
        assert out.num_tokens <= cfg["max_num_batched_tokens"]
        assert all(len(c.token_ids) >= 1 for c in out.chunks)
        # decodes of already-running requests come before their partial prefills, by arrival
        keys = [(before[i][0] > 1, before[i][1]) for i in ids if i in before]
        assert keys == sorted(keys)
        if policy == "prefill-first" and not out.preempted:
            # an unfinished prefill runs without decodes (a newly admitted prompt may join decodes: its
            # first chunk fit only in the budget the decodes left, so no prefill-only step could start it)
            decodes = [i for i in ids if i in before and before[i][0] == 1]
            assert not (decodes and any(before[i][0] > 1 for i in ids if i in before))
        assert len(s.running) <= cfg["max_num_seqs"]
        preempted_total += len(out.preempted)
        for rid in out.preempted:
            r = h.reqs[rid]
            assert rid not in ids and r in s.waiting and r.block_ids == [] and r.num_computed_tokens == 0
        # block accounting
        held = [b for r in s.running for b in r.block_ids]
        assert len(held) == len(set(held)), "a block is held twice"
        assert len(held) + s.allocator.num_free == num_blocks
        assert sorted(held + list(s.allocator._free)) == list(range(num_blocks))
        for r in s.running:
            assert r.status == RequestStatus.RUNNING
            assert len(r.block_ids) == ceil_div(r.num_computed_tokens, BS)
            assert 1 <= r.num_uncomputed
        for r in s.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0 and r.status == RequestStatus.WAITING
    assert s.num_preemptions == preempted_total
    assert len(h.finished) == n_req
    for r in h.reqs.values():
        assert r.finished and r.finish_reason == "length"
        base = 900_000 + 1000 * (_h(r.request_id) % 100)
        assert r.output_token_ids == [base + i for i in range(r.params.max_tokens)]
        assert h.emitted[r.request_id] == r.output_token_ids  # each token sampled once, none dropped
    assert s.allocator.num_free == num_blocks


def test_many_long_decodes_preempt_and_all_finish():
    s = make_sched(num_blocks=6, max_num_seqs=8, max_num_batched_tokens=64)
    h = Harness(s)
    for i in range(8):
        h.add(make_req(f"r{i}", 20, 40, arrival=float(i)))
    steps = 0
    while s.has_unfinished():
        h.step()
        steps += 1
        assert steps < 2000
    assert s.num_preemptions > 0
    for r in h.reqs.values():
        assert r.output_token_ids == [900_000 + 1000 * (_h(r.request_id) % 100) + i for i in range(40)]
    assert s.allocator.num_free == 6
