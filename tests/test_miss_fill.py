"""Oasis's "fill" miss policy in the engine: every attended block is resident and appears once, misses give
their places to resident blocks, and with a budget above the context the tokens are dense's (the kernel
itself: tests/test_kernel_miss_fill.py)."""
from __future__ import annotations

import pytest
import torch

from oasiskv.api import LLM

from tests.test_oasis import GREEDY, PROMPTS, SPARSE, run, run_random_requests, tiny_engine


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
    # the rate is over the misses left to the policy: cold-start misses are fetched, never filled (it was over all
    # misses, so a run that filled every miss it saw reported less than 1)
    left_out = stats["kv_misses"] - stats["kv_cold_fetched_blocks"] - stats["kv_miss_fetched_blocks"]
    assert stats["kv_cold_fetched_blocks"] > 0 and stats["kv_misses_to_fill"] == left_out
    assert stats["kv_filled_blocks"] <= left_out
    assert stats["kv_fill_rate"] == round(stats["kv_filled_blocks"] / left_out, 6)


def test_fill_with_budget_above_context_is_dense():
    dense = run(LLM(show_progress=False, kv_mode="dense", kv_cache_gb=0.2))
    roomy = LLM(show_progress=False, kv_mode="oasis", miss_policy="fill", kv_budget=2048, kv_cache_gb=0.2,
                host_kv_gb=0.5)
    assert run(roomy) == dense
    sparse = LLM(show_progress=False, kv_mode="oasis", miss_policy="fill", fetch_cap=0.25, **SPARSE)
    assert len(run(sparse, PROMPTS, GREEDY)) == len(PROMPTS)
    assert sparse.engine.stats_dict()["kv_filled_blocks"] > 0
