"""What CUDA-graph mode changes on the host side, checked on the CPU: decode steps that may be captured
are prepared with block tables at one fixed width (the longest request's blocks) instead of the
batch's longest. Tokens and KV counters must not change. A replay reloads its captured inputs with one copy per
packed buffer, which must refresh every one of them. (The replay itself is checked on the GPU:
scripts/gpu_graph_check.py.)"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from oasiskv.api import LLM
from oasiskv.engine.cuda_graph import META_TENSORS, CapturedStep, views_of
from oasiskv.engine.runner import ModelRunner
from oasiskv.engine.scheduler import ScheduledChunk
from oasiskv.engine.upload import StepUpload

from tests.test_oasis import GREEDY, SPARSE, run
from tests.test_sparse_modes import PROMPTS

COUNTERS = ("kv_selected_blocks", "kv_hits", "kv_misses", "kv_prefetched_blocks", "kv_agree_hits")


class NeverReplay:
    """Stands where DecodeGraphs would: the runner prepares graph-shaped inputs, then runs eagerly."""

    counts: dict = {}

    def __init__(self):
        self.calls = 0

    def run(self, ids, positions, meta, capture_layers, guesses=False, fill_inputs=None):
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


class TwoStepTensors:
    """A policy's step tensors as the tiered policies make them: views of one uploaded buffer, and one that is not."""

    STEP_TENSORS = ("rows", "flags", "tables_plus")

    def __init__(self, upload, seed: int):
        rng = np.random.default_rng(seed)
        self.step_buffer, (self.rows, self.flags) = upload([rng.integers(0, 9, 3),
                                                            rng.integers(0, 2, (2, 3)).astype(bool)])
        self.tables_plus = torch.tensor(rng.integers(0, 99, (3, 4)), dtype=torch.int32)


def test_one_copy_refreshes_every_captured_input():
    """A replay's load copies the step's packed buffers whole: each captured input must then hold the new step's
    values, which holds only if both steps lay their tensors out alike (the same graph key, the same shapes)."""
    runner = ModelRunner(None, NoDrafts(), 4, torch.device("cpu"))
    steps = []
    for seed in (0, 1):
        rng = random.Random(seed)
        chunks = [ScheduledChunk(str(i), [rng.randrange(100)], 4 * n - 2, [rng.randrange(50) for _ in range(n)], True,
                                 table_epoch=seed * 10 + i) for i, n in enumerate((3, 5, 2))]
        ids, positions, meta = runner.prepare(chunks, table_width=6)
        steps.append((ids, positions, meta, TwoStepTensors(StepUpload(torch.device("cpu")), seed)))
    (ids, positions, meta, policy), fresh = steps
    inputs = {"ids": ids, "positions": positions, **{n: getattr(meta, n) for n in META_TENSORS}}
    captured = CapturedStep(None, inputs, {n: getattr(policy, n) for n in policy.STEP_TENSORS}, None, [],
                            packed=meta.packed, step_buffer=policy.step_buffer,
                            in_step_buffer=frozenset({"rows", "flags"}))
    assert all(views_of(t, meta.packed) for t in inputs.values())
    ids2, positions2, meta2, policy2 = fresh
    captured.load(ids2, positions2, meta2, policy2)
    want = {"ids": ids2, "positions": positions2, **{n: getattr(meta2, n) for n in META_TENSORS}}
    for name, t in inputs.items():
        assert torch.equal(t, want[name]), name
    for name in policy.STEP_TENSORS:
        assert torch.equal(getattr(policy, name), getattr(policy2, name)), name


class NoDrafts:
    wants_drafts = False
