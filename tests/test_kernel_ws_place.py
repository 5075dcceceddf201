"""The fused working-set placement kernel (interpreted on the CPU; compiled on a GPU machine run with
TRITON_INTERPRET=0) against the torch reference placement: from
identical copies of realistic states (built by random reference placements: partly full rows, ties in
last_used, protected blocks), all three tables and all outputs must be exactly equal."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.ws_place import fused_place_runs, place_fused  # noqa: E402
from oasiskv.kv.working_set import WorkingSet  # noqa: E402

CPU = torch.device("cpu")
from tests.kernel_device import DEV, run_without_interpreter  # noqa: E402  (the fused side runs where the kernel runs)


def on_dev(*args):
    return [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]


def on_cpu(values):
    return [v.cpu() for v in values]
TABLES = ("_slot_of", "_block_of", "_last_used")


def resident(ws, layer, row) -> list[int]:
    return [b for b in ws.block_of[layer, row].tolist() if b >= 0]


def request(ws, g, layer, rows, k, kind):
    """(wanted int32 [R, k], protect bool [R, max_blocks]) within the contract: distinct wanted blocks,
    at most `width` protected blocks per row counting the slots the misses need."""
    layers = layer.tolist() if isinstance(layer, torch.Tensor) else [layer] * len(rows)
    wanted = torch.full((len(rows), k), -1, dtype=torch.int32)
    protect = torch.zeros(len(rows), ws.max_blocks, dtype=torch.bool)
    for i, (lay, r) in enumerate(zip(layers, rows.tolist())):
        held = resident(ws, lay, r)
        absent = [b for b in range(ws.max_blocks) if b not in held]
        if kind == "hits":
            pool = held
        elif kind == "misses":
            pool = absent
        else:
            pool = list(range(ws.max_blocks))
        pick = [pool[j] for j in torch.randperm(len(pool), generator=g)[:k].tolist()]
        if kind == "mixed":  # some columns want nothing
            pick = [b if torch.rand((), generator=g) < 0.8 else -1 for b in pick]
        cols = torch.randperm(k, generator=g)[:len(pick)]
        wanted[i, cols] = torch.tensor(pick, dtype=torch.int32)
        chosen = [b for b in pick if b >= 0]
        spare = ws.width - len(chosen)  # resident blocks that may be protected besides the wanted ones
        others = [b for b in held if b not in chosen]
        keep = int(torch.randint(spare + 1, (), generator=g))
        extra = [others[j] for j in torch.randperm(len(others), generator=g)[:keep]]
        protect[i, chosen + extra] = True
        protect[i, absent[:2]] = True  # protecting an absent block changes nothing
    return wanted, protect


def random_state(layers, rows, width, max_blocks, seed, placements=12, fill=None) -> WorkingSet:
    """A working set after `placements` random reference placements (several per step: ties in last_used)."""
    g = torch.Generator().manual_seed(seed)
    ws = WorkingSet(layers, rows, width, max_blocks, CPU, fused=False)
    for p in range(placements):
        layer = int(torch.randint(layers, (), generator=g))
        chosen = torch.randperm(rows, generator=g)[:max(1, rows - 1)].sort().values
        k = fill or int(torch.randint(1, width + 1, (), generator=g))
        wanted, protect = request(ws, g, layer, chosen, k, "mixed")
        ws.place(layer, chosen, wanted, protect, 1 + p // 3)
    return ws


def twin(ws: WorkingSet) -> WorkingSet:
    fused = WorkingSet(*ws._slot_of.shape[:2], ws.width, ws.max_blocks, DEV, fused=True)
    for name in TABLES:
        getattr(fused, name).copy_(getattr(ws, name))
    return fused


def assert_same_placement(ws, layer, rows, wanted, protect, step):
    fused = twin(ws)
    want = ws.place(layer, rows, wanted.clone(), protect.clone(), step)
    got = on_cpu(fused.place(*on_dev(layer, rows, wanted, protect, step)))
    for name, a, b in zip(("miss", "slots"), want, got):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs:\n{a}\n{b}"
    for name in TABLES:
        assert torch.equal(getattr(ws, name), getattr(fused, name).cpu()), f"{name} differs"
    return want


def test_kernel_runs_here():
    assert fused_place_runs(DEV)  # otherwise the fused path cannot run here and nothing is tested


@pytest.mark.parametrize("kind", ["mixed", "hits", "misses"])
@pytest.mark.parametrize("step_as_tensor", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_placement_matches_reference(kind, step_as_tensor, seed):
    ws = random_state(layers=3, rows=4, width=9, max_blocks=40, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    rows = torch.tensor([3, 0, 2])
    k = 9 if kind == "misses" else 6
    wanted, protect = request(ws, g, 1, rows, k, kind)
    step = torch.tensor(7) if step_as_tensor else 7
    miss, _ = assert_same_placement(ws, 1, rows, wanted, protect, step)
    if kind == "hits":
        assert not miss.any()
    if kind == "misses":
        assert miss.all()  # all miss: k == width, so every unprotected slot is evicted


def test_more_misses_than_empty_slots_evicts_least_recently_used():
    ws = random_state(layers=1, rows=3, width=8, max_blocks=30, seed=3, placements=15, fill=8)
    assert all(len(resident(ws, 0, r)) == 8 for r in range(3))  # full rows: every miss evicts
    g = torch.Generator().manual_seed(5)
    rows = torch.tensor([0, 1, 2])
    wanted, protect = request(ws, g, 0, rows, 5, "misses")
    miss, _ = assert_same_placement(ws, 0, rows, wanted, protect, 20)
    assert miss.sum() == 15


@pytest.mark.parametrize("step_as_tensor", [False, True])
def test_per_row_layer_tensor(step_as_tensor):
    # oasis's prediction: rows of several layers at once (the same request rows repeated per layer)
    ws = random_state(layers=4, rows=3, width=7, max_blocks=25, seed=4, placements=16)
    g = torch.Generator().manual_seed(9)
    layer = torch.tensor([1, 1, 1, 3, 3, 3, 0, 0])
    rows = torch.tensor([0, 1, 2, 0, 1, 2, 2, 0])
    wanted, protect = request(ws, g, layer, rows, 3, "mixed")
    wanted = torch.cat([wanted, wanted], 1)[:, :3]  # a strided view, as a slice of a wider selection
    assert_same_placement(ws, layer, rows, wanted, protect, torch.tensor(30) if step_as_tensor else 30)


def test_wide_rows():
    # the headline shape's width: 128 blocks of budget plus one (a draft's opened block)
    ws = random_state(layers=2, rows=2, width=129, max_blocks=300, seed=6, placements=6)
    g = torch.Generator().manual_seed(11)
    rows = torch.tensor([1, 0])
    for kind, k in (("misses", 6), ("mixed", 128)):
        wanted, protect = request(ws, g, 0, rows, k, kind)
        assert_same_placement(ws, 0, rows, wanted, protect, torch.tensor(50))


def test_long_sequence_stays_identical():
    g = torch.Generator().manual_seed(12)
    ref = WorkingSet(2, 3, 6, 20, CPU, fused=False)
    fused = WorkingSet(2, 3, 6, 20, DEV, fused=True)
    for step in range(40):
        layer, rows = step % 2, torch.tensor([2, 0, 1])
        wanted, protect = request(ref, g, layer, rows, int(torch.randint(1, 7, (), generator=g)), "mixed")
        want = ref.place(layer, rows, wanted, protect, step // 2)
        got = on_cpu(fused.place(*on_dev(layer, rows, wanted, protect, torch.tensor(step // 2))))
        assert all(torch.equal(a, b) for a, b in zip(want, got)), step
        assert all(torch.equal(getattr(ref, n), getattr(fused, n).cpu()) for n in TABLES), step


@pytest.mark.parametrize("only_shape", ["none", "column", "full"])
def test_copy_lists(only_shape):
    ws = random_state(layers=2, rows=3, width=8, max_blocks=30, seed=7)
    g = torch.Generator().manual_seed(13)
    rows = torch.tensor([2, 1])
    wanted, protect = request(ws, g, 1, rows, 5, "mixed")
    host_tables = torch.randperm(200, generator=g)[:2 * 30].view(2, 30).to(torch.int32)
    only = {"none": None, "column": torch.tensor([[True], [False]]),
            "full": torch.rand(2, 5, generator=g) < 0.5}[only_shape]
    fused = twin(ws)
    want = ws.place_with_copies(1, rows, wanted, protect, 3, host_tables, only)
    got = on_cpu(fused.place_with_copies(*on_dev(1, rows, wanted, protect, 3, host_tables, only)))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(getattr(ws, n), getattr(fused, n).cpu()) for n in TABLES)
    miss, slots, src, dst = got
    allowed = torch.ones_like(miss) if only is None else only.expand_as(miss)
    for i, j in np.ndindex(*miss.shape):  # brute force: a copy per allowed miss, from its host block
        copied = bool(miss[i, j] and allowed[i, j])
        assert (src[i, j].item(), dst[i, j].item()) == (
            (host_tables[i, wanted[i, j]].item(), slots[i, j].item()) if copied else (-1, -1))


def test_compiles_for_the_h200():
    # the interpreter cannot tell whether sort, gather and cumsum lower for the GPU: compile for sm_90 (no GPU
    # needed) in a process without the interpreter, at the headline width and at a width of 1024 (+1)
    code = ("from oasiskv.kernels.ws_place import compile_for\n"
            "for width, k in ((129, 128), (1025, 6)):\n"
            "    assert compile_for(90, width, k).asm['cubin']\n")
    run_without_interpreter(code)


def test_bad_input_is_refused():
    ws = WorkingSet(2, 2, 4, 10, DEV, fused=True)
    rows, wanted = on_dev(torch.tensor([0, 1]), torch.tensor([[1, 2], [3, -1]], dtype=torch.int32))
    protect = torch.zeros(2, 10, dtype=torch.bool, device=DEV)
    with pytest.raises(ValueError, match="wanted must be"):
        ws.place(0, rows, wanted.long(), protect, 1)
    with pytest.raises(ValueError, match="rows must be"):
        ws.place(0, rows[:1], wanted, protect, 1)
    with pytest.raises(ValueError, match="protect must be"):
        ws.place(0, rows, wanted, protect.int(), 1)
    with pytest.raises(ValueError, match="layer must be"):
        ws.place(torch.tensor([0, 1], dtype=torch.int32, device=DEV), rows, wanted, protect, 1)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        ws.place(2, rows, wanted, protect, 1)
    with pytest.raises(ValueError, match="step must be"):
        ws.place(0, rows, wanted, protect, torch.tensor([1], device=DEV))
    with pytest.raises(ValueError, match="only must be"):
        place_fused(ws._slot_of, ws._block_of, ws._last_used, 0, rows, wanted, protect, 1,
                    host_tables=torch.zeros(2, 10, dtype=torch.int32, device=DEV),
                    only=torch.ones(2, 3, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="host_tables must be"):
        place_fused(ws._slot_of, ws._block_of, ws._last_used, 0, rows, wanted, protect, 1,
                    host_tables=torch.zeros(2, 10, dtype=torch.int64, device=DEV))


def small_set():
    """A fused working set (2 layers, 2 rows of 3 slots, 6 blocks) where the kernel runs: row 0 of layer 0 holds
    blocks 4 and 5 in its slots 0 and 1, its slot 2 is empty. The tests below ask for the value checks
    (check_values=True), which run by default on CPU tensors only."""
    ws = WorkingSet(2, 2, 3, 6, DEV, fused=True)
    ws.place(0, torch.tensor([0], device=DEV), torch.tensor([[4, 5]], dtype=torch.int32, device=DEV),
             torch.ones(1, 6, dtype=torch.bool, device=DEV), 1)
    return ws


@pytest.mark.parametrize("change, message", [
    ("rows", r"rows must be in \[0, 2\)"),
    ("wanted", r"wanted must be in \[-1, 6\)"),  # block 6: the spare column
    ("layer", r"layer must be in \[0, 2\)"),
    ("host_tables", r"wanted blocks \(host_tables columns\) must be in \[0, 3\)")])
def test_values_out_of_range_are_clear_errors_on_the_cpu(change, message):
    """The kernel reads and writes the tables where rows, a per-row layer and wanted point, and host_tables at the
    wanted blocks: out of range it wrote past slot_of (a heap corruption, an abort), into the spare column, or
    listed a copy from a garbage host block, silently; found by a helper's audit of the kernels."""
    ws = small_set()
    layer, rows = 0, torch.tensor([0, 1], device=DEV)
    wanted = torch.tensor([[1, 2], [0, -1]], dtype=torch.int32, device=DEV)
    protect = torch.zeros(2, 6, dtype=torch.bool, device=DEV)
    host_tables = torch.arange(12, dtype=torch.int32, device=DEV).view(2, 6)
    if change == "rows":
        rows[1] = 2
    if change == "wanted":
        wanted[1, 1] = 6
    if change == "layer":
        layer = torch.tensor([0, 2], device=DEV)
    if change == "host_tables":
        host_tables, wanted[0, 1] = host_tables[:, :3], 3
    before = [getattr(ws, name).clone() for name in TABLES]
    with pytest.raises(ValueError, match=message):
        place_fused(ws._slot_of, ws._block_of, ws._last_used, layer, rows, wanted, protect, 2,
                    host_tables=host_tables, check_values=True)
    assert all(torch.equal(getattr(ws, name), old) for name, old in zip(TABLES, before))


@pytest.mark.parametrize("wanted, protected, room", [
    ([0, 1], [4, 5], 1),  # two misses, one slot not protected
    ([0, 1, 2, 3], [], 3)])  # more misses than the row has slots: the last took a slot past the row
def test_more_misses_than_slots_not_protected_is_refused_on_the_cpu(wanted, protected, room):
    """WorkingSet.place needs the protected blocks and the misses to fit in a row's slots: with more misses than
    slots not protected, the kernel gave two blocks one slot (or one past the row's width), silently; found by a
    helper's audit of the kernels. One miss fewer fits, and is placed."""
    ws = small_set()
    protect = torch.zeros(1, 6, dtype=torch.bool, device=DEV)
    protect[0, wanted + protected] = True
    row = torch.tensor([0], device=DEV)

    def place(blocks):
        return place_fused(ws._slot_of, ws._block_of, ws._last_used, 0, row,
                           torch.tensor([blocks], dtype=torch.int32, device=DEV), protect, 2, check_values=True)

    before = [getattr(ws, name).clone() for name in TABLES]
    with pytest.raises(ValueError, match=f"row 0 wants {len(wanted)} blocks without a slot but has only {room} "):
        place(wanted)
    assert all(torch.equal(getattr(ws, name), old) for name, old in zip(TABLES, before))
    miss, slots = place(wanted[:room])
    assert miss.all() and len(set(slots[0].tolist())) == room
