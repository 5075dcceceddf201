"""--layer-weights: the layers share the tokens of --kv-budget in every layer by weight. Against the transformers
twin of scripts/selection_twin.py with the same budget per layer (teacher-forced rows); retrieval and a perfect
oasis give quest's tokens; dense where every layer's budget covers the context; clear errors where it cannot apply."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from oasiskv.api import LLM
from oasiskv.cli import layer_weights
from oasiskv.config import KVConfig
from oasiskv.evals.harness import expand_variants
from oasiskv.kv.gpu_pool import KVPool
from oasiskv.kv.summaries import BlockSummaries
from oasiskv.policies.sparse import QuestPolicy
from scripts import selection_twin as twin

from tests.test_oasis import SPARSE, run, run_with_perfect_draft
from tests.test_per_kv_head import LONG, SCORED, engine_rows, tiny  # noqa: F401 (tiny: the fixture)

BUDGET, WEIGHTS = 128, ((1, 1.5),)  # 256 tokens over 2 layers: layer 0 gets 102 -> 96, layer 1 153 -> 144


def test_budgets_follow_the_weights_in_whole_blocks_within_the_total():
    kv = KVConfig(mode="quest", budget=2048, layer_weights=tuple((layer, 2.5) for layer in (7, 17, 18, 20, 24)))
    budgets = [kv.layer_budget(layer, 30, 16) for layer in range(30)]
    assert budgets[7] == budgets[24] == 4096 and budgets[0] == 1632  # 61440 tokens over a weight of 37.5
    assert sum(budgets) <= 2048 * 30
    assert KVConfig(mode="quest", budget=BUDGET, layer_weights=WEIGHTS).layer_budget(0, 2, 16) == 96
    assert KVConfig(mode="quest", budget=BUDGET).layer_budget(5, 30, 16) == BUDGET


@pytest.mark.parametrize("mode, score", [("quest", "bound"), ("quest", "mass"), ("oracle", "oracle")])
@pytest.mark.parametrize("select_per", ["layer", "kv-head"])
def test_each_layer_selects_with_its_own_budget_as_the_twin_does(tiny, mode, score, select_per):  # noqa: F811
    path, model, windows = tiny
    per_head = select_per == "kv-head"
    uniform = twin.Rule(score, 16, per_head, BUDGET)
    weighted = twin.Rule(score, 16, per_head, 96, layer_budgets=((1, 144),))
    expected = [twin.scored_rows(model, w, SCORED, [uniform, weighted]) for w in windows]
    engine_score = "bound" if mode == "oracle" else score  # oracle ranks by exact mass whatever --block-score says
    got = engine_rows(path, windows, mode, engine_score, select_per, budget=BUDGET, layer_weights=WEIGHTS)
    for rows, (_, twin_rows) in zip(got, expected):
        torch.testing.assert_close(rows, twin_rows, atol=2e-5, rtol=0)
    assert max((a - b).abs().max().item() for a, b in expected) > 1e-2  # the weights change the rows


def test_budgets_over_the_context_in_every_layer_give_dense(tiny):  # noqa: F811
    path, model, windows = tiny
    dense = [twin.scored_rows(model, w, SCORED, [None])[0] for w in windows]
    # 1024 tokens over 2 layers: 400 and 608, both above the windows' 320 and 260 tokens
    got = engine_rows(path, windows, "quest", "bound", "layer", budget=512, layer_weights=WEIGHTS)
    for rows, want in zip(got, dense):
        torch.testing.assert_close(rows, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("changes, message", [
    (dict(mode="dense"), "needs a sparse --kv-mode"),
    (dict(layer_weights=((2, 1.5),)), r"each in \[0, 1\]"),
    (dict(layer_weights=((1, 1.5), (1, 2.0))), "names each layer once"),
    (dict(layer_weights=((1, -1.0),)), "must be positive"),
    (dict(layer_weights=((1, 9.0),)), "leaves a layer 16 tokens, less than its sink and local blocks"),
])
def test_impossible_weights_are_clear_errors(changes, message):
    kv = KVConfig(**{"mode": "quest", "budget": BUDGET, "layer_weights": WEIGHTS, **changes})
    with pytest.raises(ValueError, match=message):
        kv.validate(16, 2)
    with pytest.raises(ValueError,
                       match="--layer-weights and --shortlist are not supported with --tensor-parallel-size"):
        KVConfig(mode="quest", layer_weights=WEIGHTS).require_layer_layout("--tensor-parallel-size > 1")


def test_the_flag_parses_and_a_sweep_names_its_rows():
    assert layer_weights("7=2.5,18=2") == ((7, 2.5), (18, 2.0)) and layer_weights("none") == ()
    with pytest.raises(argparse.ArgumentTypeError, match="LAYER=WEIGHT"):
        layer_weights("7:2.5")
    rows = expand_variants(["dense", "quest", "oasis"], [2048], [0.05], None, layer_weights=[(), ((7, 2.5),)])
    assert [v.label for v in rows] == ["quest budget=2048", "quest+layers(7=2.5) budget=2048",
                                       "oasis@0.05 budget=2048", "oasis+layers(7=2.5)@0.05 budget=2048"]


def test_steps_where_a_layers_budget_covers_the_context_are_not_captured():
    """A layer whose budget covers the context attends densely: until the context outgrows the largest budget the
    step runs eagerly, then it is captured under the key of one budget."""
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=8)
    kv = KVConfig(mode="quest", budget=BUDGET, layer_weights=WEIGHTS)  # 6 and 9 blocks
    summaries = BlockSummaries(cfg, 32, torch.float32, torch.device("cpu"))
    policy = QuestPolicy(KVPool(cfg, 32, 16, torch.float32, torch.device("cpu")), kv, summaries, 16, 1.0,
                         torch.device("cpu"), timing=False)
    policy.meta = SimpleNamespace(decode_max_seq_len=0)
    keys = {}
    for blocks in (5, 7, 9, 10, 12):
        policy.num_decode_blocks, policy.meta.decode_max_seq_len = blocks, blocks * 16
        keys[blocks] = policy.graph_key()
        assert [policy.is_dense_layer(layer) for layer in (0, 1)] == [blocks <= 6, blocks <= 9]
    assert keys[5] is keys[7] is keys[9] is None
    assert keys[10] == keys[12] == ("sparse", 0)


# SmolLM2, SPARSE's 64 tokens a layer: 1920 over 30 layers at a weight of 32, so layers 7 and 18 get 112 and the
# others 48 (3 blocks: the sink, the local block and one more)
SMOLLM2_WEIGHTS = ((7, 2.0), (18, 2.0))


@pytest.fixture(scope="module")
def quest_weighted():
    return run(LLM(show_progress=False, kv_mode="quest", layer_weights=SMOLLM2_WEIGHTS, **SPARSE), LONG)


def test_weights_change_smollm2s_tokens_and_retrieval_gives_quests(quest_weighted):
    assert quest_weighted != run(LLM(show_progress=False, kv_mode="quest", **SPARSE), LONG)
    llm = LLM(show_progress=False, kv_mode="retrieval", layer_weights=SMOLLM2_WEIGHTS, **SPARSE)
    assert run(llm, LONG) == quest_weighted
    assert llm.engine.policy.ws.width == 7  # the largest budget, 112 tokens
    assert llm.engine.stats_dict()["kv_misses"] > 0


@pytest.mark.parametrize("miss_policy", ["skip", "fill"])
def test_perfect_draft_with_full_cap_gives_quest_tokens_with_weights(quest_weighted, miss_policy):
    llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, layer_weights=SMOLLM2_WEIGHTS,
              miss_policy=miss_policy, **SPARSE)
    oasis, stats = run_with_perfect_draft(llm, LONG, quest_weighted)
    assert oasis == quest_weighted
    assert stats["kv_prefetched_blocks"] > 0


@pytest.mark.parametrize("mode", ["quest", "oasis"])
def test_weighted_budgets_above_the_context_are_dense(mode):
    roomy = dict(kv_budget=2048, kv_cache_gb=0.4, host_kv_gb=0.5, layer_weights=SMOLLM2_WEIGHTS)  # 1904 and 3824
    dense = run(LLM(show_progress=False, kv_mode="dense", kv_cache_gb=0.2), LONG)
    assert run(LLM(show_progress=False, kv_mode=mode, **roomy), LONG) == dense


@pytest.mark.parametrize("miss_policy", ["skip", "fill"])
def test_a_dense_layer_inside_a_prediction_group_with_a_perfect_draft_gives_quest_tokens(miss_policy):
    """70 tokens growing to 94: 5 to 6 blocks, over the others' 3 but within layers 7 and 18's 7, which attend
    densely; the prediction groups around them (layers 6-11 and 18-23) lose a layer from their middle."""
    prompt = LONG[:1]
    quest = run(LLM(show_progress=False, kv_mode="quest", layer_weights=SMOLLM2_WEIGHTS, **SPARSE), prompt)
    llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, layer_weights=SMOLLM2_WEIGHTS,
              miss_policy=miss_policy, **SPARSE)
    oasis, stats = run_with_perfect_draft(llm, prompt, quest)
    assert oasis == quest
    assert stats["kv_prefetched_blocks"] > 0


def test_the_benchmarks_warm_up_reaches_a_context_where_every_layer_selects():
    """Steps where a layer's budget covers the context run eagerly: a warm-up too short for the largest budget
    leaves the run's CUDA graphs to be captured inside its timed window."""
    from oasiskv.bench.workload import warm_up

    weights = ((7, 8.0),)  # 1920 tokens over 30 layers at a weight of 37: layer 7 gets 400, the others 48
    llm = LLM(show_progress=False, kv_mode="quest", layer_weights=weights, **SPARSE)
    policy = llm.engine.policy
    assert llm.engine.config.kv.largest_budget(30, 16) == 400 == 16 * max(policy.layer_budget_blocks)
    warm_up(llm.engine, input_len=2 * 400 + 16 + 1, steps=2, seed=0)  # the decode part's own length: no long prefill
    assert not any(policy.is_dense_layer(layer) for layer in range(30))


def test_sparse_layers_before_dense_last_layers_are_still_predicted():
    """Weights that make the last two layers attend densely (their budget covers the context): the group of sparse
    layers before them ended at a dense layer, which made no prediction, so it was dropped at the next step's begin
    (no block of layers 24-27 was ever prefetched; a helper's differential test found it)."""
    from oasiskv.api import SamplingParams
    from oasiskv.evals.texts import load_corpus

    llm = LLM(show_progress=False, kv_mode="oasis", kv_budget=96, sink_blocks=1, local_blocks=1, kv_cache_gb=0.3,
              host_kv_gb=0.1, fetch_cap=0.5, layer_weights=((28, 3.0), (29, 3.0)))
    text = " ".join(load_corpus("sample")[0].split()[:160])
    llm.generate(text, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    agreement = llm.engine.stats_dict()["kv_agreement_per_layer"]
    assert agreement[28:] == [None, None]  # dense: no prediction to judge
    assert all(a is not None and a > 0.5 for a in agreement[:28]), agreement
