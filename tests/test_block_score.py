"""--block-score mass on the embedded SmolLM2: exact where it must be, and really another selection."""
from __future__ import annotations

import pytest

from oasiskv.api import LLM
from oasiskv.config import KVConfig
from oasiskv.lookahead.teacher import TeacherDraft

from tests.test_oasis import GREEDY, SPARSE, run
from tests.test_sparse_modes import PROMPTS

LONG = PROMPTS[:2]  # 70 and 120 tokens: both outgrow the 4-block budget


@pytest.fixture(scope="module")
def quest_mass():
    return run(LLM(show_progress=False, kv_mode="quest", block_score="mass", **SPARSE), LONG)


def selections(block_score: str) -> list:
    """Every selection quest made over the two requests (one per decode step and layer)."""
    llm = LLM(show_progress=False, kv_mode="quest", block_score=block_score, **SPARSE)
    policy, seen = llm.engine.policy, []
    select_by = policy.select_by

    def recording(scores):
        counts, padded = select_by(scores)
        seen.append(padded.tolist())
        return counts, padded

    policy.select_by = recording
    run(llm, LONG)
    return seen


def test_mass_changes_the_selection():
    """The flag reaches the policy: at a 4-block budget the two scores pick other blocks in some steps."""
    bound, mass = selections("bound"), selections("mass")
    assert len(bound) == len(mass) > 0
    differ = sum(a != b for a, b in zip(bound, mass))
    assert 0 < differ < len(bound)


def test_retrieval_equals_quest_with_mass(quest_mass):
    retrieval = run(LLM(show_progress=False, kv_mode="retrieval", block_score="mass", **SPARSE), LONG)
    assert retrieval == quest_mass


def test_perfect_draft_with_full_cap_gives_quest_tokens_with_mass(quest_mass):
    llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, block_score="mass", **SPARSE)
    engine = llm.engine
    prompts = {str(i): engine.tokenizer.encode(p) for i, p in enumerate(LONG)}
    engine.drafter = TeacherDraft({rid: len(p) for rid, p in prompts.items()},
                                  {str(i): t for i, t in enumerate(quest_mass)})
    for rid, ids in prompts.items():
        engine.add_request(ids, GREEDY, request_id=rid)
    while engine.has_unfinished():
        engine.step()
    assert [engine.requests[str(i)].output_token_ids for i in range(len(LONG))] == quest_mass
    assert engine.stats_dict()["kv_prefetched_blocks"] > 0


def test_unknown_block_score_is_a_clear_error():
    with pytest.raises(ValueError, match="--block-score must be one of bound, mass"):
        KVConfig(mode="quest", block_score="max").validate(16, 30)
