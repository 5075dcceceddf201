"""Residency check with counters: Triton kernel (under TRITON_INTERPRET=1 on the CPU) vs torch twin vs a
plain Python loop; with the draft's K/V write fused in, vs the two torch twins one after the other."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.draft_kv import write_draft_kv_reference  # noqa: E402
from oasiskv.kernels.residency import (COUNTERS, DraftWrite, resident_selection,  # noqa: E402
                                       resident_selection_reference)

# on a GPU machine run with TRITON_INTERPRET=0 to test the compiled kernel
from tests.kernel_device import DEV, run_without_interpreter  # noqa: E402
from tests.test_kernel_draft_kv import make_case as draft_case  # noqa: E402


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


def fused_case(b, width, k, dtype, seed):
    """kernels/draft_kv.py's case (consistent working-set tables, layer 1) as a residency check's input: x_t
    selects its attended blocks (resident) and some without a slot. Row 0 is full, opens a block without a
    slot and selects its least recently used block, so the victim must skip it; row 1 opens a resident block,
    row 2 nothing (its K/V go to its tail slot)."""
    case = list(draft_case(b, width, 3 * width, k, dtype, seed))
    kv, slot_of, block_of, last_used, layer, rows, tail_slots, opened, offset, selection, k_new, v_new = case
    gen = torch.Generator().manual_seed(seed)
    tail_slots.copy_(rows * width)  # each row's own slot, so no two programs write one place on a GPU either
    r = int(rows[0])
    unheld = [x for x in range(3 * width) if x not in block_of[layer, r].tolist()]
    for j in (block_of[layer, r, :width] < 0).nonzero().flatten().tolist():
        block_of[layer, r, j] = blk = unheld.pop()
        slot_of[layer, r, blk] = r * width + j
    opened[0], offset[0] = unheld.pop(), 0
    lru = block_of[layer, r, int(last_used[layer, r, :width].argmin())]
    if lru not in selection[0]:
        selection[0, 0] = lru
    if b > 2:
        opened[1], offset[1] = block_of[layer, int(rows[1]), 0], 0
        opened[2], offset[2] = -1, 1
    for i, r in enumerate(rows.tolist()):
        held = block_of[layer, r].tolist() + selection[i].tolist() + [int(opened[i])]
        missing = [x for x in torch.randperm(3 * width, generator=gen).tolist() if x not in held]
        for c in (selection[i] < 0).nonzero().flatten().tolist()[: len(missing)]:
            if torch.rand((), generator=gen) < 0.6:
                selection[i, c] = missing.pop()
    predicted = torch.rand(slot_of.shape, generator=gen) < 0.5
    fresh = torch.rand(b, generator=gen) < 0.7
    columns = torch.randperm(8, generator=gen)[: len(COUNTERS)]
    residency = (selection, slot_of, predicted, rows, fresh, columns, layer, opened)
    return residency, DraftWrite(kv, block_of, last_used, tail_slots, offset, k_new, v_new, torch.tensor(7))


@pytest.mark.parametrize("b, width, k", [(1, 3, 1), (3, 5, 4), (4, 6, 9), (5, 9, 8), (4, 17, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("compare", [None, 4], ids=["one-pass", "chunks-of-2"])
def test_fused_draft_write_equals_the_two_references(b, width, k, dtype, seed, compare, monkeypatch):
    """One launch does the residency check and write_draft_kv with its output: the same output, counters,
    tables and K/V pool as resident_selection_reference then write_draft_kv_reference."""
    if compare:  # the placement reads the protected list 2 blocks a pass
        monkeypatch.setattr("oasiskv.kernels.draft_kv._COMPARE_ELEMENTS", compare)
    residency, draft = fused_case(b, width, k, dtype, seed + 10 * b)
    results = []
    for fused in (True, False):
        selection, slot_of, predicted, rows, fresh, columns, layer, opened = (
            t.clone().to(DEV) if isinstance(t, torch.Tensor) else t for t in residency)
        d = DraftWrite(*(t.clone().to(DEV) for t in draft))
        counts = (torch.zeros(6, 8, dtype=torch.int64, device=DEV), torch.zeros(3, 8, dtype=torch.int64, device=DEV))
        args = (selection, slot_of, predicted, rows, fresh, *counts, columns, layer, opened)
        if fused:
            out = resident_selection(*args, draft=d)
        else:
            out = resident_selection_reference(*args)
            write_draft_kv_reference(*d.arguments(slot_of, layer, rows, opened, out))
        results.append([t.cpu() for t in (out, *counts, slot_of, d.block_of, d.last_used, d.kv_layer)])
    assert (residency[-1] >= 0).any()
    for name, got, want in zip(("attended", "row_counts", "layer_counts", "slot_of", "block_of", "last_used", "kv"),
                               *results):
        assert torch.equal(got, want), name


def test_fused_draft_write_bad_inputs_raise():
    (selection, slot_of, predicted, rows, fresh, columns, layer, opened), draft = fused_case(3, 5, 4,
                                                                                          torch.float32, 0)
    counts = (torch.zeros(6, 8, dtype=torch.int64), torch.zeros(3, 8, dtype=torch.int64))
    args = (selection, slot_of, predicted, rows, fresh, *counts, columns, layer)
    with pytest.raises(ValueError, match="draft needs extra"):
        resident_selection(*args, draft=draft)
    with pytest.raises(ValueError, match="k must be"):
        resident_selection(*args, opened, draft=draft._replace(k=draft.k[:, :1]))


def test_fused_kernel_compiles_for_the_h200():
    # as tests/test_kernel_draft_kv.py's: the GPU lowering of the residency check with the draft's placement,
    # compiled for sm_90 without the interpreter, at the headline width (129 slots) and selection (128 blocks)
    code = ("from oasiskv.kernels.residency import compile_for\n"
            "assert compile_for(90, 129, 128).asm['cubin']\n"
            "assert compile_for(90, 513, 128).asm['cubin']\n")
    run_without_interpreter(code)


@pytest.mark.parametrize("change, message", [
    ("selection", r"selection must be in \[-1, 40\)"),
    ("rows", r"rows \(of slot_of and row_counts\) must be in \[0, 6\)"),
    ("row_counts", r"rows \(of slot_of and row_counts\) must be in \[0, 2\)"),
    ("counter_ids", r"counter_ids \(columns of row_counts and layer_counts\) must be in \[0, 8\)"),
    ("layer_counts", r"layer 2 out of layer_counts' rows \[0, 2\)"),
    ("rows dtype", "rows must be int32 or int64, got torch.float32"),
    ("counter_ids dtype", "counter_ids must be int32 or int64, got torch.float32")])
def test_values_out_of_range_are_clear_errors_on_the_cpu(change, message):
    """The kernel reads slot_of and predicted at each selected block of each row and adds to the counter tables at
    each row, layer and counter column: out of range it read past slot_of or added past the tables, silently; float
    ids failed inside the kernel. Found by a helper's audit of the kernels."""
    selection, slot_of, predicted, rows, fresh, columns = make_case(3, 4)
    rows = torch.tensor([1, 3, 0])
    row_counts, layer_counts = torch.zeros(6, 8, dtype=torch.int64), torch.zeros(3, 8, dtype=torch.int64)
    if change == "selection":
        selection[1, 0] = 40
    if change == "rows":
        rows[1] = 6
    if change == "row_counts":  # fewer rows than slot_of
        row_counts = row_counts[:2]
    if change == "counter_ids":
        columns[2] = 8
    if change == "layer_counts":
        layer_counts = layer_counts[:2]
    if change == "rows dtype":
        rows = rows.float()
    if change == "counter_ids dtype":
        columns = columns.float()
    before = (row_counts.clone(), layer_counts.clone())
    with pytest.raises(ValueError, match=message):
        resident_selection(selection, slot_of, predicted, rows, fresh, row_counts, layer_counts, columns, 2)
    assert torch.equal(row_counts, before[0]) and torch.equal(layer_counts, before[1])


@pytest.mark.parametrize("change, message", [
    ("offset", r"offset must be in \[0, 4\)"),
    ("tail_slots", r"tail_slots must be in \[0, 25\)"),
    ("opened", r"opened must be in \[-1, 15\)")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_draft_values_out_of_range_are_clear_errors_on_the_cpu(change, message, dtype):
    """The fused kernel writes the draft's K/V where write_draft_kv's does: its values are checked as there (out of
    range it wrote past the pool or into the spare column, silently); found by a helper's audit of the kernels."""
    (selection, slot_of, predicted, rows, fresh, columns, layer, opened), draft = fused_case(3, 5, 4, dtype, 0)
    if change == "offset":
        draft.offset[2] = 4
    if change == "tail_slots":
        draft.tail_slots[2] = 25
    if change == "opened":
        opened[0] = 15
    counts = (torch.zeros(6, 8, dtype=torch.int64), torch.zeros(3, 8, dtype=torch.int64))
    before = [t.clone() for t in (slot_of, draft.kv_layer, draft.block_of, draft.last_used)]
    with pytest.raises(ValueError, match=message):
        resident_selection(selection, slot_of, predicted, rows, fresh, *counts, columns, layer, opened, draft=draft)
    assert all(torch.equal(t, old) for t, old in zip((slot_of, draft.kv_layer, draft.block_of, draft.last_used),
                                                       before))
