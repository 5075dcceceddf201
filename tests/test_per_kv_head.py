"""--select-per kv-head (each KV head selects its own blocks) and --summary-tokens (blocks ranked by their
sub-blocks' summaries). Against the transformers twin of scripts/selection_twin.py (teacher-forced rows), and
exact where the sparse modes must be."""
from __future__ import annotations

import pytest
import torch

from oasiskv.api import LLM
from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SchedulerConfig
from oasiskv.evals.forced import teacher_forced
from oasiskv.evals.harness import expand_variants
from scripts import selection_twin as twin

from tests.test_oasis import SPARSE, run, run_with_perfect_draft
from tests.test_sparse_modes import PROMPTS

LONG = PROMPTS[:2]  # 70 and 120 tokens: both outgrow the 4-block budget
SCORED, BUDGET = 24, 96  # 6 blocks of 16: the sink, the 4-block local window (the twin's 64 tokens) and one more


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama with 3 KV heads, saved for the engine and kept for the twin. Its q and k weights are
    scaled up so that attention is peaked and a selection changes the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3)
            layer.self_attn.k_proj.weight.mul_(3)
    path = tmp_path_factory.mktemp("tiny-3kv")
    model.save_pretrained(path, safe_serialization=True)
    model.set_attn_implementation(twin.register())
    g = torch.Generator().manual_seed(3)
    windows = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (320, 260)]
    return str(path), model, windows


def engine_rows(path: str, windows, mode: str, score: str, select_per: str,
                summary_tokens: int | None = None, **kv_changes) -> list[torch.Tensor]:
    kv = KVConfig(**{"mode": mode, "budget": BUDGET, "block_score": score, "select_per": select_per,
                     "summary_tokens": summary_tokens, **kv_changes})
    config = EngineConfig(model=path, dtype="float32", device="cpu", show_progress=False,
                          cache=CacheConfig(num_kv_blocks=64), kv=kv, scheduler=SchedulerConfig(max_num_seqs=2))
    return [torch.stack(s.rows) for s in teacher_forced(LLM.from_config(config), windows, SCORED, keep_rows=True)]


@pytest.mark.parametrize("mode, score", [("quest", "bound"), ("quest", "mass"), ("oracle", "oracle")])
def test_each_kv_head_selects_what_the_twin_selects(tiny, mode, score):
    path, model, windows = tiny
    engine_score = "bound" if mode == "oracle" else score  # oracle ranks by exact mass whatever --block-score says
    per_layer, per_head = twin.Rule(score, 16, False, BUDGET), twin.Rule(score, 16, True, BUDGET)
    expected = [twin.scored_rows(model, w, SCORED, [None, per_layer, per_head]) for w in windows]
    for select_per, rule_index in (("layer", 1), ("kv-head", 2)):
        got = engine_rows(path, windows, mode, engine_score, select_per)
        for rows, (dense, *rules) in zip(got, expected):
            torch.testing.assert_close(rows, (dense, *rules)[rule_index], atol=2e-5, rtol=0)
    # the two rules really differ on these windows (else the comparison above would show nothing)
    assert max((layer - head).abs().max().item() for _, layer, head in expected) > 1e-2


@pytest.mark.parametrize("score", ["bound", "mass"])
@pytest.mark.parametrize("select_per", ["layer", "kv-head"])
def test_sub_block_summaries_select_what_the_twin_selects(tiny, score, select_per):
    """--summary-tokens 4: a block ranks by its 4-token sub-blocks (per head, mass: their sum, bound: the best
    one's)."""
    path, model, windows = tiny
    whole, sub = (twin.Rule(score, 16, select_per == "kv-head", BUDGET, summary=s) for s in (None, 4))
    expected = [twin.scored_rows(model, w, SCORED, [whole, sub]) for w in windows]
    got = engine_rows(path, windows, "quest", score, select_per, summary_tokens=4)
    for rows, (_, finer) in zip(got, expected):
        torch.testing.assert_close(rows, finer, atol=2e-5, rtol=0)
    assert max((a - b).abs().max().item() for a, b in expected) > 1e-2  # finer summaries change the rows


@pytest.fixture(scope="module")
def quest_per_head():
    return run(LLM(show_progress=False, kv_mode="quest", select_per="kv-head", **SPARSE), LONG)


def test_per_kv_head_changes_smollm2s_tokens(quest_per_head):
    assert quest_per_head != run(LLM(show_progress=False, kv_mode="quest", **SPARSE), LONG)


def test_retrieval_equals_quest_per_kv_head(quest_per_head):
    llm = LLM(show_progress=False, kv_mode="retrieval", select_per="kv-head", **SPARSE)
    assert run(llm, LONG) == quest_per_head
    stats = llm.engine.stats_dict()
    assert stats["kv_misses"] > 0 and stats["kv_fetched_blocks"] > 0  # the host store served every head


def test_perfect_draft_with_full_cap_gives_quest_tokens_per_kv_head(quest_per_head):
    llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, select_per="kv-head", **SPARSE)
    oasis, stats = run_with_perfect_draft(llm, LONG, quest_per_head)
    assert oasis == quest_per_head
    assert stats["kv_prefetched_blocks"] > 0
    per_head, per_layer = stats["kv_agreement_per_kv_head"], stats["kv_agreement_per_layer"]
    assert len(per_head) == len(per_layer) == 30 and all(len(heads) == 3 for heads in per_head)
    assert per_layer == [pytest.approx(sum(heads) / 3, abs=1e-6) for heads in per_head]


@pytest.mark.parametrize("mode", ["quest", "oasis"])
def test_budget_above_the_context_is_dense_per_kv_head(mode):
    roomy = dict(kv_budget=2048, kv_cache_gb=0.4, host_kv_gb=0.5, select_per="kv-head", summary_tokens=4)
    dense = run(LLM(show_progress=False, kv_mode="dense", kv_cache_gb=0.2), LONG)
    assert run(LLM(show_progress=False, kv_mode=mode, **roomy), LONG) == dense


def test_dense_layers_count_layers_not_lanes():
    """--dense-layers 30 leaves SmolLM2's 30 layers, all 90 of their lanes, dense: dense's tokens at a small budget."""
    dense = run(LLM(show_progress=False, kv_mode="dense", kv_cache_gb=0.2), LONG)
    llm = LLM(show_progress=False, kv_mode="quest", select_per="kv-head", dense_layers=30, **SPARSE)
    assert run(llm, LONG) == dense
    assert llm.engine.policy.cfg.dense_layers == 90


def test_sub_block_summaries_keep_retrieval_and_a_perfect_oasis_equal_to_quest():
    finer = dict(SPARSE, block_score="mass", select_per="kv-head", summary_tokens=4)
    quest = run(LLM(show_progress=False, kv_mode="quest", **finer), LONG)
    assert quest != run(LLM(show_progress=False, kv_mode="quest", **dict(finer, summary_tokens=None)), LONG)
    assert run(LLM(show_progress=False, kv_mode="retrieval", **finer), LONG) == quest
    oasis, stats = run_with_perfect_draft(LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, **finer), LONG,
                                          quest)
    assert oasis == quest and stats["kv_prefetched_blocks"] > 0


@pytest.mark.parametrize("kv, message", [
    (KVConfig(mode="dense", select_per="kv-head"), "needs a sparse --kv-mode"),
    (KVConfig(mode="quest", select_per="head"), "--select-per must be one of layer, kv-head"),
    (KVConfig(mode="quest", summary_tokens=3), "--summary-tokens must divide the block size 16"),
    (KVConfig(mode="quest", summary_tokens=0), "--summary-tokens must divide"),
])
def test_impossible_selection_scope_is_a_clear_error(kv, message):
    with pytest.raises(ValueError, match=message):
        kv.validate(16, 30)


def test_a_sweep_over_select_per_names_its_rows():
    variants = expand_variants(["dense", "quest", "oasis", "oracle"], [2048], [0.05], None,
                               select_per=["layer", "kv-head"])
    assert [v.label for v in variants] == [
        "quest budget=2048", "quest+kv-head budget=2048", "oasis@0.05 budget=2048", "oasis+kv-head@0.05 budget=2048",
        "oracle budget=2048", "oracle+kv-head budget=2048"]
    finer = expand_variants(["quest", "oasis"], [2048], [0.05], None, block_scores=["mass"], select_per=["kv-head"],
                            summary_tokens=[None, 4])
    assert [v.label for v in finer] == [
        "quest+mass+kv-head budget=2048", "quest+mass+kv-head+sum4 budget=2048",
        "oasis+mass+kv-head@0.05 budget=2048", "oasis+mass+kv-head+sum4@0.05 budget=2048"]
    dense = KVConfig(mode="quest", select_per="kv-head", summary_tokens=4).for_mode("dense")
    assert dense.select_per == "layer" and dense.summary_tokens is None  # the dense anchor of a sweep
