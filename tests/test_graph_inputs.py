"""What CUDA-graph mode changes on the host side, checked on the CPU: decode steps that may be captured
are prepared with block tables at one fixed width (the longest request's blocks) instead of the
batch's longest. Tokens and KV counters must not change. (The replay itself is checked on the GPU:
scripts/gpu_graph_check.py.)"""
from __future__ import annotations

import pytest

from oasiskv.api import LLM

from tests.test_oasis import GREEDY, SPARSE, run
from tests.test_sparse_modes import PROMPTS

COUNTERS = ("kv_selected_blocks", "kv_hits", "kv_misses", "kv_prefetched_blocks", "kv_agree_hits")


class NeverReplay:
    """Stands where DecodeGraphs would: the runner prepares graph-shaped inputs, then runs eagerly."""

    counts: dict = {}

    def __init__(self):
        self.calls = 0

    def run(self, ids, positions, meta, capture_layers, guesses=False):
        self.calls += 1
        assert meta.decode_block_tables.shape[1] == self.width
        return None


@pytest.mark.parametrize("mode", ["quest", "oasis"])
def test_fixed_width_tables_change_nothing(mode):
    prompts = PROMPTS[:2]
    flags = {**SPARSE, **({"fetch_cap": 0.25} if mode == "oasis" else {})}  # one block per step and layer
    plain = LLM(show_progress=False, kv_mode=mode, **flags)
    expected, expected_stats = run(plain, prompts), plain.engine.stats_dict()
    llm = LLM(show_progress=False, kv_mode=mode, **flags)
    runner = llm.engine.runner
    runner.graphs = NeverReplay()
    runner.graphs.width = runner.max_blocks
    assert runner.max_blocks == -(-llm.engine.max_model_len // llm.engine.block_size)
    assert run(llm, prompts) == expected
    assert runner.graphs.calls >= GREEDY.max_tokens - 1  # every decode-only step went the graph way
    stats = llm.engine.stats_dict()
    assert {k: stats.get(k) for k in COUNTERS} == {k: expected_stats.get(k) for k in COUNTERS}
