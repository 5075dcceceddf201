"""--block-score mass on the embedded SmolLM2: exact where it must be, and really another selection."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oasiskv.api import LLM
from oasiskv.config import KVConfig

from tests.test_oasis import SPARSE, run, run_with_perfect_draft
from tests.test_sparse_modes import PROMPTS

ROOT = Path(__file__).resolve().parents[1]
LONG = PROMPTS[:2]  # 70 and 120 tokens: both outgrow the 4-block budget


@pytest.fixture(scope="module")
def quest_mass():
    return run(LLM(show_progress=False, kv_mode="quest", block_score="mass", **SPARSE), LONG)


def selections(block_score: str) -> list:
    """Every selection quest made over the two requests (one per decode step and layer)."""
    llm = LLM(show_progress=False, kv_mode="quest", block_score=block_score, **SPARSE)
    policy, seen = llm.engine.policy, []
    select_by = policy.select_by

    def recording(scores, budget_blocks=None):
        counts, padded = select_by(scores, budget_blocks)
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
    oasis, stats = run_with_perfect_draft(llm, LONG, quest_mass)
    assert oasis == quest_mass
    assert stats["kv_prefetched_blocks"] > 0


def test_unknown_block_score_is_a_clear_error():
    with pytest.raises(ValueError, match="--block-score must be one of bound, mass"):
        KVConfig(mode="quest", block_score="max").validate(16, 30)


def test_selection_recall_script_measures_every_rule(tmp_path):
    """scripts/selection_recall.py (docs/ACCURACY.md, "Block scores"): a small run on the shipped sample text
    reports, for every rule, a share of each head's attention in [0, 1], the worst head's no larger than the
    mean head's."""
    out = tmp_path / "recall.json"
    proc = subprocess.run([sys.executable, "scripts/selection_recall.py", "--json", str(out), "--", "--corpus",
                           "sample", "--context", "1024", "--kv-budget", "256", "--tasks", "ppl", "--windows", "1",
                           "--scored", "4", "--batch", "1"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept = json.loads(out.read_text())["kept_mass"]
    rules = ["bound", *(f"mass r={w:g}" for w in (1, 0.75, 0.5, 0.25, 0)), "mean key r=0.5", "oracle",
             "oracle per KV head"]
    assert kept["selections"] > 0
    for rule in rules:
        assert 0 < kept[rule + " worst head"] <= kept[rule + " mean"] <= 1, rule
