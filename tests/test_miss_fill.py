"""Oasis's "fill" miss policy: fill_misses against a row-by-row brute force, and in the engine every
attended block is resident, appears once, and a miss gives its place to a resident block."""
from __future__ import annotations

import pytest
import torch

from oasiskv.api import LLM
from oasiskv.policies.miss_fill import fill_misses, fill_misses_reference

from tests.test_oasis import GREEDY, PROMPTS, SPARSE, run, run_random_requests, tiny_engine


def random_case(batch: int, k: int, width: int, extra: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    nblocks = torch.randint(1, width + 1, (batch,), generator=gen)
    selection = torch.full((batch, k), -1, dtype=torch.int32)
    for b in range(batch):
        n = int(torch.randint(0, min(k, int(nblocks[b])) + 1, (), generator=gen))
        selection[b, :n] = torch.randperm(int(nblocks[b]), generator=gen)[:n].int()
    resident = torch.rand(batch, width, generator=gen) < 0.6
    held = resident.gather(1, selection.clamp(min=0).long()) & (selection >= 0)
    attended = torch.where(held, selection, -1)
    if extra:
        attended = torch.cat([attended, torch.randint(-1, width, (batch, extra), generator=gen).int()], 1)
    scores = torch.randn(batch, width, generator=gen)  # distinct: the order is unique
    return attended, selection, scores, resident, nblocks.int()


@pytest.mark.parametrize("batch, k, width, extra", [(1, 4, 8, 1), (5, 8, 40, 1), (7, 16, 12, 0), (3, 32, 300, 1),
                                                    (9, 6, 6, 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fill_misses_equals_brute_force(batch, k, width, extra, seed):
    case = random_case(batch, k, width, extra, seed)
    got, filled = fill_misses(*case)
    want, want_filled = fill_misses_reference(*case)
    assert torch.equal(got, want) and torch.equal(filled, want_filled)
    attended, selection = case[0], case[1]
    misses = (selection >= 0) & (attended[:, :k] < 0)
    assert bool((filled <= misses).all()) and torch.equal(got[:, k:], attended[:, k:])


def test_fill_misses_changes_nothing_without_misses():
    attended, selection, scores, resident, nblocks = random_case(6, 8, 50, 1, 4)
    attended[:, :8] = selection  # every selected block resident
    got, filled = fill_misses(attended, selection, scores, resident, nblocks)
    assert torch.equal(got, attended) and not filled.any()


def test_fill_misses_rejects_mismatched_shapes():
    attended, selection, scores, resident, nblocks = random_case(2, 4, 10, 1, 0)
    with pytest.raises(ValueError, match="scores and resident"):
        fill_misses(attended, selection, scores[:, :5], resident, nblocks)
    with pytest.raises(ValueError, match="attended"):
        fill_misses(attended[:, :2], selection, scores, resident, nblocks)


def test_engine_fills_misses_with_resident_blocks_only(tmp_path):
    engine = tiny_engine(tmp_path, fetch_cap=0.25, draft="ngram", miss_policy="fill")  # cap: one block a step
    policy, checked = engine.policy, []
    inner = policy.resident_selection

    def checking(layer, q, dense, draft=None):
        attended, scores = inner(layer, q, dense, draft)
        if not dense:
            slot_of = policy.ws._slot_of[layer, policy.rows.long()]
            for row, blocks in enumerate(attended[:, :-1].tolist()):
                blocks = [b for b in blocks if b >= 0]
                assert len(blocks) == len(set(blocks)), (layer, row, blocks)  # a block attended once
                assert all(int(slot_of[row, b]) >= 0 for b in blocks)  # and resident
            checked.append(layer)
        return attended, scores

    policy.resident_selection = checking
    run_random_requests(engine, seed=1, lengths=(150, 190, 230), max_tokens=80)
    stats = engine.stats_dict()
    assert checked and stats["kv_misses"] > 0
    # random weights move the selection every step: many misses, and resident blocks to fill them with
    assert 0 < stats["kv_filled_blocks"] <= stats["kv_misses"]


def test_fill_with_budget_above_context_is_dense():
    dense = run(LLM(show_progress=False, kv_mode="dense", kv_cache_gb=0.2))
    roomy = LLM(show_progress=False, kv_mode="oasis", miss_policy="fill", kv_budget=2048, kv_cache_gb=0.2,
                host_kv_gb=0.5)
    assert run(roomy) == dense
    sparse = LLM(show_progress=False, kv_mode="oasis", miss_policy="fill", fetch_cap=0.25, **SPARSE)
    assert len(run(sparse, PROMPTS, GREEDY)) == len(PROMPTS)
    assert sparse.engine.stats_dict()["kv_filled_blocks"] > 0
