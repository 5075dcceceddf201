"""scripts/top1_flips.py: agreement split between dense's near-ties and clear positions, on rows made by hand."""
from __future__ import annotations

import math

import pytest
import torch

from oasiskv.evals.forced import ForcedScores
from scripts.top1_flips import compare, dense_gaps, parse_variant


def logp(*probs: float) -> torch.Tensor:
    return torch.log(torch.tensor(probs))


def test_flips_are_split_by_denses_gap_to_its_runner_up():
    rows = [logp(0.5, 0.4, 0.1),  # near-tie: gap ln(5/4)
            logp(0.9, 0.05, 0.05),  # clear: gap ln 18
            logp(0.1, 0.3, 0.6)]  # near-tie: gap ln 2 - not below ln 2, so clear
    assert dense_gaps(rows) == pytest.approx([math.log(1.25), math.log(18), math.log(2)], rel=1e-5)
    mine = ForcedScores(top1=[1, 0, 1], kl=[0.1, 0.0, 0.2])  # flips at positions 0 and 2
    r = compare("x", [mine], [rows], [[0, 0, 2]], tie_nats=math.log(2) + 1e-6, seconds=1.0)
    assert (r["positions"], r["near_tie_positions"], r["flips"], r["flips_at_near_ties"]) == (3, 2, 2, 2)
    assert r["top1_agree"] == pytest.approx(100 / 3, abs=0.01)
    assert (r["agree_at_near_ties"], r["agree_at_clear"]) == (0.0, 100.0)
    assert r["kl"] == pytest.approx(0.1)
    gaps = sorted(f["dense_gap_to_this_token"] for f in r["flip_list"])
    assert gaps == pytest.approx([math.log(1.25), math.log(2)], abs=1e-4)
    assert [f["this_token_rank_in_dense"] for f in r["flip_list"]] == [1, 1]


def test_variant_specs_name_the_block_score_and_miss_policy():
    v = parse_variant("oasis+mass+fill", 2048, 0.05)
    assert (v.mode, v.budget, v.fetch_cap, v.block_score, v.miss_policy) == ("oasis", 2048, 0.05, "mass", "fill")
    assert parse_variant("quest", 1024, 0.05).fetch_cap is None
    with pytest.raises(SystemExit, match="'mass' and 'fill'"):
        parse_variant("quest+exact", 2048, 0.05)
