"""Residency check with counters: Triton kernel (under TRITON_INTERPRET=1 on the CPU) vs torch twin vs a
plain Python loop."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.residency import COUNTERS, resident_selection, resident_selection_reference  # noqa: E402

# on a GPU machine run with TRITON_INTERPRET=0 to test the compiled kernel
from tests.kernel_device import DEV  # noqa: E402


def make_case(b, k, layers=3, rows=6, blocks=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slot_of = torch.where(torch.rand(layers, rows, blocks, generator=gen) < 0.5,
                          torch.randint(0, 500, (layers, rows, blocks), generator=gen), -1).to(torch.int32)
    predicted = torch.rand(layers, rows, blocks, generator=gen) < 0.6
    row_ids = torch.randperm(rows, generator=gen)[:b]
    fresh = torch.rand(b, generator=gen) < 0.7
    selection = torch.full((b, k), -1, dtype=torch.int32)
    for i in range(b):
        n = int(torch.randint(0, k + 1, (), generator=gen))
        ids = torch.randperm(blocks - 1, generator=gen)[:n].to(torch.int32)  # the last column is the spare
        cols = torch.randperm(k, generator=gen)[:n]
        selection[i, cols] = ids
    columns = torch.randperm(8, generator=gen)[: len(COUNTERS)]
    return selection, slot_of, predicted, row_ids, fresh, columns


def python_loop(selection, slot_of, predicted, rows, fresh, layer):
    out, per_row = selection.clone(), {}
    for i, r in enumerate(rows.tolist()):
        c = dict.fromkeys(COUNTERS, 0)
        for j, blk in enumerate(selection[i].tolist()):
            if blk < 0:
                continue
            resident = int(slot_of[layer, r, blk]) >= 0
            c["selected"] += 1
            c["hits" if resident else "misses"] += 1
            if bool(fresh[i]):
                c["agree_total"] += 1
                c["agree_hits"] += bool(predicted[layer, r, blk])
            if not resident:
                out[i, j] = -1
        per_row[r] = c
    return out, per_row


@pytest.mark.parametrize("b,k", [(1, 1), (4, 7), (6, 16), (5, 33)])
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("with_extra", [False, True], ids=["plain", "extra"])
def test_kernel_and_twin_match_a_python_loop(b, k, layer, with_extra):
    """With `extra`, the output gains a last column holding it (oasis: the block each draft opens, or -1)."""
    selection, slot_of, predicted, rows, fresh, columns = make_case(b, k, seed=b * 10 + k + layer)
    expect, per_row = python_loop(selection, slot_of, predicted, rows, fresh, layer)
    extra = None
    if with_extra:
        extra = torch.randint(-1, 50, (b,), generator=torch.Generator().manual_seed(b), dtype=torch.int32)
        expect = torch.cat([expect, extra[:, None]], 1)
        extra = extra.to(DEV)
    inputs = [t.to(DEV) for t in (selection, slot_of, predicted, rows, fresh)]
    for impl in (resident_selection, resident_selection_reference):
        row_counts = torch.zeros(6, 8, dtype=torch.int64, device=DEV)
        layer_counts = torch.zeros(3, 8, dtype=torch.int64, device=DEV)
        row_counts[:, 7] = 5  # counters accumulate onto what is there
        out = impl(*inputs, row_counts, layer_counts, columns.to(DEV), layer, extra).cpu()
        row_counts, layer_counts = row_counts.cpu(), layer_counts.cpu()
        assert torch.equal(out, expect)
        for r, c in per_row.items():
            got = {name: int(row_counts[r, col]) - (5 if col == 7 else 0) for name, col in zip(COUNTERS, columns)}
            assert got == c
        totals = {name: sum(c[name] for c in per_row.values()) for name in COUNTERS}
        assert {name: int(layer_counts[layer, col]) for name, col in zip(COUNTERS, columns)} == totals
        assert layer_counts[[i for i in range(3) if i != layer]].abs().sum() == 0


def test_bad_inputs_raise():
    selection, slot_of, predicted, rows, fresh, columns = make_case(2, 4)
    counts = (torch.zeros(6, 8, dtype=torch.int64), torch.zeros(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="selection must be int32"):
        resident_selection(selection.long(), slot_of, predicted, rows, fresh, *counts, columns, 0)
    with pytest.raises(ValueError, match="predicted must be bool"):
        resident_selection(selection, slot_of, predicted.int(), rows, fresh, *counts, columns, 0)
    with pytest.raises(ValueError, match="layer 3 out of range"):
        resident_selection(selection, slot_of, predicted, rows, fresh, *counts, columns, 3)
    with pytest.raises(ValueError, match="counter_ids"):
        resident_selection(selection, slot_of, predicted, rows, fresh, *counts, columns[:3], 0)
    with pytest.raises(ValueError, match="extra must be int32"):
        resident_selection(selection, slot_of, predicted, rows, fresh, *counts, columns, 0, rows)
