"""--shortlist F (quest, retrieval, oasis): the block scores keep F x the budget, the listed blocks' exact attention
mass in a softmax over their keys alone picks the budget. Against the transformers twin of scripts/selection_twin.py
(teacher-forced rows); F = 1 is quest itself, a list of every block the oracle; oasis with a perfect draft at cap 1
and retrieval are quest with the same list; clear errors where it cannot apply."""
from __future__ import annotations

import pytest
import torch

from oasiskv.api import LLM
from oasiskv.config import KVConfig
from oasiskv.evals.harness import expand_variants
from scripts import selection_twin as twin

from tests.test_oasis import SPARSE, run, run_with_perfect_draft
from tests.test_per_kv_head import BUDGET, LONG, SCORED, engine_rows, tiny  # noqa: F401 (tiny: the fixture)


@pytest.mark.parametrize("score", ["bound", "mass"])
@pytest.mark.parametrize("select_per", ["layer", "kv-head"])
def test_the_second_pass_selects_what_the_twin_selects(tiny, score, select_per):  # noqa: F811
    path, model, windows = tiny
    alone = twin.Rule(score, 16, select_per == "kv-head", BUDGET)
    listed = twin.Rule(score, 16, select_per == "kv-head", BUDGET, shortlist=2)  # 12 of 17-20 blocks
    expected = [twin.scored_rows(model, w, SCORED, [alone, listed]) for w in windows]
    got = engine_rows(path, windows, "quest", score, select_per, shortlist=2.0)
    for rows, (_, second_pass) in zip(got, expected):
        torch.testing.assert_close(rows, second_pass, atol=2e-5, rtol=0)
    assert max((a - b).abs().max().item() for a, b in expected) > 1e-2  # the second pass changes the rows


@pytest.fixture(scope="module")
def quest_tokens():
    return run(LLM(show_progress=False, kv_mode="quest", **SPARSE), LONG)


def test_a_list_of_the_budget_itself_gives_quests_tokens(quest_tokens):
    assert run(LLM(show_progress=False, kv_mode="quest", shortlist=1.0, **SPARSE), LONG) == quest_tokens


def test_a_list_of_every_block_gives_the_oracles_tokens(quest_tokens):
    """SPARSE's 4-block budget: a list of 20 blocks holds the 70- and 120-token prompts and their 24 tokens."""
    oracle = run(LLM(show_progress=False, kv_mode="oracle", **SPARSE), LONG)
    assert oracle != quest_tokens
    assert run(LLM(show_progress=False, kv_mode="quest", shortlist=5.0, **SPARSE), LONG) == oracle


def test_a_budget_above_the_context_gives_dense():
    dense = run(LLM(show_progress=False, kv_mode="dense", kv_cache_gb=0.2), LONG)
    assert run(LLM(show_progress=False, kv_mode="quest", shortlist=2.0, kv_budget=2048, kv_cache_gb=0.4), LONG) == dense


@pytest.mark.parametrize("changes, message", [
    (dict(shortlist=0.5), "0 \\(off\\) or at least 1"),
    (dict(mode="oracle"), "applies to quest, retrieval and oasis, not oracle"),
])
def test_impossible_settings_are_clear_errors(changes, message):
    kv = KVConfig(**{"mode": "quest", "shortlist": 2.0, **changes})
    with pytest.raises(ValueError, match=message):
        kv.validate(16, 30)


def test_other_modes_of_a_sweep_drop_it_and_layouts_that_need_one_pass_refuse_it():
    kv = KVConfig(mode="quest", shortlist=2.0)
    assert kv.for_mode("oracle").shortlist == 0 and kv.for_mode("oasis").shortlist == 2.0
    assert kv.for_mode("oasis").working_set_blocks(30, 16) == 256  # the list of the 128-block budget
    assert kv.shortlist_blocks(128) == 256 and KVConfig(shortlist=1.5).shortlist_blocks(5) == 7
    with pytest.raises(ValueError, match="--shortlist are not supported with --tensor-parallel-size"):
        kv.require_layer_layout("--tensor-parallel-size > 1")


def test_the_eval_sweeps_it_on_the_rows_of_modes_that_take_it():
    rows = expand_variants(["quest", "oracle", "oasis"], [2048], [0.05], None, shortlists=[0.0, 2.0])
    assert [v.label for v in rows] == ["quest budget=2048", "quest+shortlist2 budget=2048", "oracle budget=2048",
                                       "oasis@0.05 budget=2048", "oasis+shortlist2@0.05 budget=2048"]


def test_the_triton_kernel_in_the_engine_gives_the_torch_paths_rows(tiny, monkeypatch):  # noqa: F811
    """The engine's CUDA path of the second pass (under the interpreter, set by conftest), on what the engine passes."""
    import oasiskv.policies.sparse as sparse
    from oasiskv.kernels.shortlist_mass import shortlist_block_lse

    path, _, windows = tiny
    torch_path = engine_rows(path, windows, "quest", "bound", "layer", shortlist=2.0)
    monkeypatch.setattr(sparse, "shortlist_block_lse_reference", shortlist_block_lse)
    kernel = engine_rows(path, windows, "quest", "bound", "layer", shortlist=2.0)
    for a, b in zip(kernel, torch_path):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def quest_listed():
    return run(LLM(show_progress=False, kv_mode="quest", shortlist=2.0, **SPARSE), LONG)


@pytest.mark.parametrize("miss_policy", ["skip", "fill"])
def test_perfect_draft_with_full_cap_gives_quests_tokens_with_the_same_list(quest_listed, quest_tokens, miss_policy):
    assert quest_listed != quest_tokens
    llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, shortlist=2.0, miss_policy=miss_policy, **SPARSE)
    assert llm.engine.policy.ws.width == 9  # the list of 8 blocks and the block a draft opens
    oasis, stats = run_with_perfect_draft(llm, LONG, quest_listed)
    assert oasis == quest_listed
    assert stats["kv_prefetched_blocks"] > 0 and stats["kv_cold_fetched_blocks"] > 0


def test_oasis_with_a_list_and_a_budget_above_the_context_gives_dense():
    dense = run(LLM(show_progress=False, kv_mode="dense", kv_cache_gb=0.2), LONG)
    roomy = dict(kv_budget=2048, kv_cache_gb=0.4, host_kv_gb=0.5, shortlist=2.0)
    assert run(LLM(show_progress=False, kv_mode="oasis", **roomy), LONG) == dense


def test_retrieval_fetches_the_list_and_gives_quests_tokens_with_the_same_list(quest_listed):
    llm = LLM(show_progress=False, kv_mode="retrieval", shortlist=2.0, **SPARSE)
    assert run(llm, LONG) == quest_listed
    assert llm.engine.policy.ws.width == 8
    stats = llm.engine.stats_dict()
    assert stats["kv_misses"] > 0 and stats["kv_selected_blocks"] > 0  # the list's blocks, fetched when missing


def test_per_kv_head_with_layer_weights_a_perfect_draft_gives_quests_tokens_with_the_same_lists():
    """The finer settings together: a list per KV head, each of its layer's weighted budget."""
    finer = dict(shortlist=2.0, select_per="kv-head", layer_weights=((7, 2.0),), **SPARSE)
    quest = run(LLM(show_progress=False, kv_mode="quest", **finer), LONG)
    llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, miss_policy="fill", **finer)
    oasis, stats = run_with_perfect_draft(llm, LONG, quest)
    assert oasis == quest
    assert stats["kv_prefetched_blocks"] > 0


def test_a_list_of_the_budget_counts_the_misses_of_no_list():
    """A list of the budget itself selects what no list selects. The list's fetch (cold rows; every row under fetch)
    ran before the residency check, which then counted the blocks it brought as hits: 0 misses under fetch where no
    list had 18 (a helper's run). Same tokens, so the same hits and misses."""
    stats = {}
    for shortlist in (0.0, 1.0):
        llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=0.25, miss_policy="fetch", draft="repeat",
                  shortlist=shortlist, **SPARSE)
        tokens = run(llm)
        counts = llm.engine.stats_dict()
        stats[shortlist] = (tokens, *(counts[k] for k in ("kv_selected_blocks", "kv_hits", "kv_misses")))
    assert stats[0.0][0] == stats[1.0][0]
    assert stats[0.0][3] > 0 and stats[0.0][1:] == stats[1.0][1:]
