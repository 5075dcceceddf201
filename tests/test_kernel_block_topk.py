import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from oasiskv.kernels import block_topk
from oasiskv.kernels.selection_rule import select_blocks_padded
from oasiskv.kernels.block_topk import (
    blocks_mask,
    plan_prefetch_reference,
    predict_prefetch,
    predict_prefetch_reference,
    select_blocks_fused,
)
from tests.kernel_device import DEV, INTERPRETED


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Each prefetch-plan test runs twice: through the kernel, and through the torch path the launcher
    falls back to (the CPU engine's path) — both must give the same plan."""
    if request.param == "torch":
        monkeypatch.setattr(block_topk, "_fits", lambda *args: False)
    return request.param


@pytest.mark.skipif(not INTERPRETED, reason="checks that the interpreter runs the kernels on the CPU")
def test_kernels_are_interpreted():
    assert block_topk._triton_runs(torch.device("cpu"))


def _scores(rows, max_blocks, seed, ties=True, specials=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    if ties:
        scores = torch.randint(-3, 4, (rows, max_blocks), generator=g).float()
    else:
        scores = torch.randn(rows, max_blocks, generator=g)
    if specials:  # NaN, +-inf and -0.0 sprinkled over the rows
        where = torch.rand(rows, max_blocks, generator=g)
        scores[where < 0.04] = math.nan
        scores[(where >= 0.04) & (where < 0.07)] = math.inf
        scores[(where >= 0.07) & (where < 0.10)] = -math.inf
        scores[(where >= 0.10) & (where < 0.13)] = -0.0
    return scores.to(dtype)


def _lengths(budget, max_blocks):
    """n == 0, 1, around the budget, full rows."""
    nb = torch.tensor([0, 1, 2, budget - 1, budget, budget + 1, max_blocks - 1, max_blocks, max_blocks // 2])
    return nb.clamp(0, max_blocks).to(torch.int32)


SELECT_CASES = [
    # max_blocks, budget, sink, local
    (40, 8, 1, 2),
    (40, 8, 0, 1),
    (40, 6, 2, 4),  # budget == sink + local
    (40, 1, 0, 1),  # the tail only
    (33, 12, 4, 4),
    (20, 32, 1, 2),  # budget above max_blocks: K = max_blocks
    (130, 64, 1, 4),  # several warps' worth, K not a power of two below it
]


@pytest.mark.parametrize("max_blocks,budget,sink,local", SELECT_CASES)
@pytest.mark.parametrize("ties,dtype", [(True, torch.float32), (False, torch.float32), (True, torch.float16)])
def test_select_equals_reference(max_blocks, budget, sink, local, ties, dtype):
    nb = _lengths(budget, max_blocks)
    scores = _scores(len(nb), max_blocks, seed=max_blocks + budget + sink + local, ties=ties, dtype=dtype)
    counts, padded = select_blocks_fused(scores, nb, budget, sink, local)
    ref_counts, ref_padded = select_blocks_padded(scores, nb, budget, sink, local)
    assert counts.dtype == padded.dtype == torch.int32
    assert torch.equal(counts, ref_counts)
    assert torch.equal(padded, ref_padded)


def test_select_largest_supported_row_and_strided_scores():
    """max_blocks 8192 (128K tokens) and budget 1024 in the kernel; scores read through strides."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randint(-50, 50, (2, 8192 + 3), generator=g).float()
    scores = wide[:, 3:]
    nb = torch.tensor([8192, 3000], dtype=torch.int32)
    got = select_blocks_fused(scores, nb, 1024, 1, 4)
    ref = select_blocks_padded(scores, nb, 1024, 1, 4)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_oversized_rows_take_the_torch_path(monkeypatch):
    scores = _scores(3, 50, seed=3)
    nb = torch.tensor([50, 20, 7], dtype=torch.int32)
    monkeypatch.setattr(block_topk, "MAX_BLOCKS", 32)
    monkeypatch.setattr(block_topk, "_launch_select", None)  # the kernel path would fail loudly
    got = select_blocks_fused(scores, nb, 8, 1, 2)
    ref = select_blocks_padded(scores, nb, 8, 1, 2)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_select_bad_arguments_raise():
    scores = torch.zeros(2, 10)
    nb = torch.tensor([10, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="scores must be"):
        select_blocks_fused(scores[0], nb, 4, 1, 1)
    with pytest.raises(ValueError, match="num_blocks_per_seq must be an integer"):
        select_blocks_fused(scores, nb[:1], 4, 1, 1)
    with pytest.raises(ValueError, match="exceeds budget_blocks"):
        select_blocks_fused(scores, nb, 4, 2, 3)
    with pytest.raises(ValueError, match=r"must be in \[0, 10\]"):
        select_blocks_fused(scores, torch.tensor([11, 3], dtype=torch.int32), 4, 1, 1)


# ---------------------------------------------------------------------------------------- prefetch plan
def _brute_force_plan(scores, prediction, resident, cap):
    """Per row: listed, non-resident, score not NaN/-inf; higher score first, then lower id."""
    out = []
    for r in range(len(prediction)):
        ids = [int(i) for i in prediction[r] if i >= 0 and not resident[r, i]]
        ids = [i for i in ids if float(scores[r, i]) > -math.inf]
        out.append(set(sorted(ids, key=lambda i: (-float(scores[r, i]), i))[:cap]))
    return out


def _rows_as_sets(fetch):
    return [set(v for v in row.tolist() if v >= 0) for row in fetch]


def _prefix_then_padding(fetch):
    for row in fetch.tolist():
        count = sum(v >= 0 for v in row)
        assert all(v >= 0 for v in row[:count]) and all(v == -1 for v in row[count:])


def _working_set(rows, max_blocks, seed, layers=3):
    """slot_of as the working set holds it: [layers, rows, max_blocks + 1] viewed without the spare."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(-1, 5, (layers, rows + 2, max_blocks + 1), generator=g, dtype=torch.int32)
    full[full > 2] = -1  # about half resident
    layer_of = torch.randint(0, layers, (rows,), generator=g)
    row_ids = torch.randperm(rows + 2, generator=g)[:rows]
    return full[..., :max_blocks], layer_of, row_ids


@pytest.mark.parametrize("cap", [1, 3, 6, 64])
@pytest.mark.parametrize("ties", [False, True])
def test_prefetch_list_is_the_best_missing_blocks(cap, ties, path):
    max_blocks, budget = 60, 16
    nb = _lengths(budget, max_blocks)
    scores = _scores(len(nb), max_blocks, seed=cap + 10 * ties, ties=ties, specials=ties)
    slot_of, layer_of, rows = _working_set(len(nb), max_blocks, seed=cap)
    resident = slot_of[layer_of, rows] >= 0
    for kwargs in (dict(resident=resident), dict(slot_of=slot_of, layer_of=layer_of, rows=rows)):
        on_device = {name: t.to(DEV) for name, t in kwargs.items()}
        prediction, _, fetch = predict_prefetch(scores.to(DEV), nb.to(DEV), budget, 1, 2, cap, max_blocks,
                                                **on_device)
        prediction, fetch = prediction.cpu(), fetch.cpu()
        expected = _brute_force_plan(scores, prediction, resident, cap)
        assert fetch.dtype == torch.int32 and fetch.shape == (len(nb), min(cap, prediction.shape[1]))
        assert _rows_as_sets(fetch) == expected
        _prefix_then_padding(fetch)
        ref = plan_prefetch_reference(scores, prediction, cap, **kwargs)
        assert _rows_as_sets(ref) == expected
        _prefix_then_padding(ref)
        assert torch.equal(ref, fetch)  # in the kernel's order too: it decides the working set's slots


def test_residency_arguments_are_checked():
    scores, nb = torch.zeros(2, 10), torch.tensor([10, 3], dtype=torch.int32)
    resident = torch.zeros(2, 10, dtype=torch.bool)
    slot_of = torch.zeros(1, 2, 10, dtype=torch.int32)
    rows = torch.arange(2)
    cases = [
        (dict(), "give either"),
        (dict(resident=resident, slot_of=slot_of), "give either"),
        (dict(resident=resident.int()), "resident must be bool"),
        (dict(slot_of=slot_of, layer_of=rows[:1], rows=rows), "layer_of must be"),
        (dict(slot_of=slot_of.long(), layer_of=rows, rows=rows), "slot_of must be int32"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            predict_prefetch(scores, nb, 4, 1, 1, 2, 10, **kwargs)
    with pytest.raises(ValueError, match="prediction must be int32"):
        plan_prefetch_reference(scores, torch.zeros(2, 3, dtype=torch.int64), 2, resident=resident)


# ---------------------------------------------------------------------------------------- both at once
@pytest.mark.parametrize("max_blocks,budget,sink,local,cap", [(60, 16, 1, 2, 3), (37, 8, 0, 1, 8), (300, 64, 1, 4, 6)])
def test_predict_prefetch_in_one_launch(max_blocks, budget, sink, local, cap, path):
    nb = _lengths(budget, max_blocks)
    scores = _scores(len(nb), max_blocks, seed=max_blocks, ties=True)
    slot_of, layer_of, rows = _working_set(len(nb), max_blocks, seed=budget)
    width = max_blocks + 1 + 2 * triton_block(max_blocks)  # the mask's tail past N is written too
    residency = dict(slot_of=slot_of, layer_of=layer_of, rows=rows)
    on_device = {name: t.to(DEV) for name, t in residency.items()}
    got = predict_prefetch(scores.to(DEV), nb.to(DEV), budget, sink, local, cap, width, **on_device)
    prediction, mask, fetch = (t.cpu() for t in got)
    ref_prediction, ref_mask, _ = predict_prefetch_reference(scores, nb, budget, sink, local, cap, width,
                                                             **residency)
    assert torch.equal(prediction, ref_prediction)
    assert torch.equal(mask, ref_mask) and mask.shape == (len(nb), width)
    assert torch.equal(mask, blocks_mask(prediction, width))
    expected = _brute_force_plan(scores, prediction, slot_of[layer_of, rows] >= 0, cap)
    assert _rows_as_sets(fetch) == expected
    _prefix_then_padding(fetch)


def triton_block(max_blocks):
    return 1 << (max_blocks - 1).bit_length()


def test_predict_prefetch_bad_arguments_raise():
    scores = torch.zeros(2, 10)
    nb = torch.tensor([10, 3], dtype=torch.int32)
    resident = torch.zeros(2, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask_width"):
        predict_prefetch(scores, nb, 4, 1, 1, 2, 9, resident=resident)
    with pytest.raises(ValueError, match="cap must be"):
        predict_prefetch(scores, nb, 4, 1, 1, 0, 11, resident=resident)


# the kernels inside the engine, against the torch path: tests/test_kernels_in_engine.py


def _strided(n):
    """n as a column of a wider tensor (stride 2), the other column other lengths: what a contiguous read took."""
    return torch.stack([n, n.flip(0)], 1)[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_select_reads_strided_lengths_as_given(dtype):
    """num_blocks_per_seq as a strided view: the kernel read it as contiguous, so rows were selected by other rows'
    lengths; found by a helper's audit of the kernels."""
    max_blocks, budget = 40, 8
    nb = _lengths(budget, max_blocks)
    scores = _scores(len(nb), max_blocks, seed=17, dtype=dtype)
    got = select_blocks_fused(scores, _strided(nb), budget, 1, 2)
    ref = select_blocks_padded(scores, nb, budget, 1, 2)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_predict_prefetch_reads_strided_lengths_as_given(dtype):
    """The same strided lengths through predict_prefetch's launch (found by a helper's audit of the kernels)."""
    max_blocks, budget, cap = 60, 16, 3
    nb = _lengths(budget, max_blocks)
    scores = _scores(len(nb), max_blocks, seed=19, dtype=dtype)
    slot_of, layer_of, rows = _working_set(len(nb), max_blocks, seed=2)
    residency = dict(slot_of=slot_of, layer_of=layer_of, rows=rows)
    got = predict_prefetch(scores.to(DEV), _strided(nb).to(DEV), budget, 1, 2, cap, max_blocks,
                           **{name: t.to(DEV) for name, t in residency.items()})
    want = predict_prefetch_reference(scores, nb, budget, 1, 2, cap, max_blocks, **residency)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
