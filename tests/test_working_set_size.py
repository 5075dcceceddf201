"""--working-set: GPU residency beyond the budget for the host modes. Room beyond the budget keeps
blocks resident that a later step selects again, so they are not fetched twice; outputs do not change
(retrieval fetches every miss, so it always equals quest)."""
from __future__ import annotations

import pytest
import torch

from oasiskv.config import KVConfig, SamplingParams
from oasiskv.engine.engine import LLMEngine

from tests.test_oasis import tiny_engine as engine  # a 3-layer random model, budget 64 (4 blocks)

PROMPT_LENS = (150, 190, 230)
MAX_TOKENS = 60



def run(e: LLMEngine) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    for i, n in enumerate(PROMPT_LENS):
        e.add_request(torch.randint(0, 256, (n,), generator=gen).tolist(),
                      SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), request_id=str(i))
    done = {}
    while e.has_unfinished():
        done.update({r.request_id: r.output_token_ids for r in e.step()})
    return done


def test_retrieval_with_the_whole_context_resident_fetches_each_block_once(tmp_path):
    quest = run(engine(tmp_path, "quest"))
    tight = engine(tmp_path, "retrieval")
    assert run(tight) == quest
    roomy = engine(tmp_path, "retrieval", working_set=320)  # 20 blocks >= the 19 of the longest request
    assert run(roomy) == quest
    layers = roomy.model_config.num_layers
    # the brute-force bound: a block of a request and layer is fetched at most once (prefill leaves
    # nothing resident; full tail blocks were resident when they filled and are not fetched at all)
    blocks = sum(-(-(n + MAX_TOKENS) // roomy.block_size) for n in PROMPT_LENS) * layers
    fetched_roomy = roomy.stats_dict()["kv_fetched_blocks"]
    fetched_tight = tight.stats_dict()["kv_fetched_blocks"]
    assert 0 < fetched_roomy <= blocks, (fetched_roomy, blocks)
    assert fetched_tight > fetched_roomy  # the budget-sized working set re-fetches what it evicted


def test_oasis_with_a_larger_working_set_misses_less(tmp_path):
    tight = engine(tmp_path, "oasis", fetch_cap=0.25, draft="repeat")
    roomy = engine(tmp_path, "oasis", fetch_cap=0.25, draft="repeat", working_set=128)
    run(tight), run(roomy)
    t, r = tight.stats_dict(), roomy.stats_dict()
    assert t["kv_selected_blocks"] == r["kv_selected_blocks"] > 0
    assert r["kv_misses"] < t["kv_misses"], (r["kv_misses"], t["kv_misses"])
    assert r["kv_max_prefetched_blocks"] <= 1  # the cap still holds (0.25 x 64 tokens = 1 block)


@pytest.mark.parametrize("mode, working_set, message", [
    ("quest", 4096, "applies to the retrieval and oasis modes"),
    ("oasis", 1000, "multiple of the block size"),
    ("retrieval", 256, "at least --kv-budget"),
])
def test_impossible_working_set_is_a_clear_error(mode, working_set, message):
    with pytest.raises(ValueError, match=message):
        KVConfig(mode=mode, budget=512, working_set=working_set).validate(16, 30)
