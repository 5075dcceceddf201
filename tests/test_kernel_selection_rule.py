"""The selection rule (kernels/selection_rule.py) against a brute-force selection, on the kernel tests' device: on the
GPU, CUDA's topk must select what the CPU's does. (Named test_kernel_* so that the compiled GPU run takes it.)"""
import math

import pytest
import torch

from oasiskv.kernels.selection_rule import select_blocks, select_blocks_padded

from tests.kernel_device import DEV


# ---------------------------------------------------------------- select_blocks


def _brute_force_select(scores, nb, budget, sink, local):
    indptr, indices = [0], []
    for b in range(scores.shape[0]):
        n = int(nb[b])
        if n <= budget:
            chosen = set(range(n))
        else:
            chosen = set(range(sink)) | set(range(n - local, n))
            rest = [j for j in range(n) if j not in chosen]

            def rank(j):
                v = float(scores[b, j])
                return -(-math.inf if math.isnan(v) else v), j  # higher score first, then lower id

            chosen |= set(sorted(rest, key=rank)[: budget - len(chosen)])
        indices += sorted(chosen)
        indptr.append(len(indices))
    return indptr, indices


SELECT_CASES = [
    # budget, sink, local
    (8, 1, 2),
    (8, 0, 1),
    (6, 2, 4),  # budget == sink + local: no top-scored blocks
    (5, 3, 2),
    (1, 0, 1),  # tail only
    (12, 4, 4),
]


@pytest.mark.parametrize("budget,sink,local", SELECT_CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_select_blocks_matches_brute_force(budget, sink, local, ties):
    # on DEV: the selection must not depend on the device (torch.topk on CUDA included)
    g = torch.Generator().manual_seed(budget * 100 + sink * 10 + local + ties)
    max_blocks = 24
    # lengths around the budget: shorter (sink/local overlap), equal, one more, full
    nb = torch.tensor([0, 1, 2, 3, budget - 1, budget, budget + 1, budget + 2, 17, max_blocks])
    nb = nb.clamp(0, max_blocks).to(torch.int32)
    if ties:
        scores = torch.randint(-2, 3, (len(nb), max_blocks), generator=g).float()
    else:
        scores = torch.randn(len(nb), max_blocks, generator=g)
    indptr, indices = select_blocks(scores.to(DEV), nb.to(DEV), budget, sink, local)
    exp_indptr, exp_indices = _brute_force_select(scores, nb, budget, sink, local)
    assert indptr.dtype == torch.int32 and indices.dtype == torch.int32
    assert indptr.tolist() == exp_indptr
    assert indices.tolist() == exp_indices
    counts, padded = select_blocks_padded(scores.to(DEV), nb.to(DEV), budget, sink, local)
    assert counts.dtype == torch.int32 and padded.dtype == torch.int32
    assert padded.shape == (len(nb), min(budget, max_blocks))
    for b in range(len(nb)):
        row = exp_indices[exp_indptr[b] : exp_indptr[b + 1]]
        assert int(counts[b]) == len(row)
        assert padded[b].tolist() == row + [-1] * (padded.shape[1] - len(row))


def test_select_blocks_ties_prefer_lower_ids_and_forced_beat_infinity():
    scores = torch.zeros(1, 10)
    scores[0, 3] = math.inf  # a genuine +inf must not push out the forced tail block
    scores[0, 5] = math.inf
    scores[0, 7] = math.nan
    scores = scores.to(DEV)
    nb = torch.tensor([10], dtype=torch.int32, device=DEV)
    indptr, indices = select_blocks(scores, nb, budget_blocks=4, sink_blocks=1, local_blocks=1)
    assert indices.tolist() == [0, 3, 5, 9]
    indptr, indices = select_blocks(scores, nb, budget_blocks=6, sink_blocks=1, local_blocks=1)
    assert indices.tolist() == [0, 1, 2, 3, 5, 9]  # zeros tie: ids 1, 2 before 4, 6, 8; NaN last


def test_select_blocks_bad_arguments_raise():
    scores = torch.zeros(2, 8, device=DEV)
    nb = torch.tensor([8, 3], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="exceeds budget_blocks"):
        select_blocks(scores, nb, 4, 2, 3)
    with pytest.raises(ValueError, match="local_blocks >= 1"):
        select_blocks(scores, nb, 4, 1, 0)
    with pytest.raises(ValueError, match=r"in \[0, 8\]"):
        select_blocks(scores, torch.tensor([9, 3], dtype=torch.int32, device=DEV), 4, 1, 1)
    with pytest.raises(ValueError, match="num_blocks_per_seq must be"):
        select_blocks(scores, nb[:1], 4, 1, 1)
    with pytest.raises(ValueError, match="scores must be"):
        select_blocks(scores[0], nb, 4, 1, 1)


def test_select_blocks_empty_shapes():
    empty = torch.zeros(0, dtype=torch.int32, device=DEV)
    indptr, indices = select_blocks(torch.zeros(0, 5, device=DEV), empty, 4, 1, 1)
    assert indptr.tolist() == [0] and indices.numel() == 0
    nb = torch.zeros(2, dtype=torch.int32, device=DEV)
    indptr, indices = select_blocks(torch.zeros(2, 0, device=DEV), nb, 4, 1, 1)
    assert indptr.tolist() == [0, 0, 0] and indices.numel() == 0
    counts, padded = select_blocks_padded(torch.zeros(2, 0, device=DEV), nb, 4, 1, 1)
    assert counts.tolist() == [0, 0] and padded.shape == (2, 0)
