"""kernels/miss_fill.py: the Triton kernel and its torch twin against a row-by-row brute force."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.miss_fill import FillCounters, fill_misses, fill_misses_reference  # noqa: E402

from tests.kernel_device import DEV, run_without_interpreter  # noqa: E402


def brute_force(attended, selection, scores, block_of, rows, nblocks):
    """Straight from the definition: per row, the candidates sorted by score (the lower block on a tie), handed
    to the misses in column order."""
    out, counts = attended.clone(), torch.zeros(len(selection), dtype=torch.int32)
    k = selection.shape[1]
    for b in range(len(selection)):
        attended_now = {int(x) for x in attended[b, :k] if x >= 0}
        held = {int(x) for x in block_of[int(rows[b])] if x >= 0}
        pool = sorted((j for j in held if j < int(nblocks[b]) and j not in attended_now
                       and float(scores[b, j]) > float("-inf")), key=lambda j: (-float(scores[b, j]), j))
        for i in range(k):
            if selection[b, i] >= 0 and attended[b, i] < 0 and pool:
                out[b, i] = pool.pop(0)
                counts[b] += 1
    return out, counts


def random_case(batch, k, width, slots, extra, seed, ties=False):
    """A working set of `slots` per request row (rows shuffled, some empty slots), selections of up to k blocks
    below nblocks, attended = the selection's resident part, x_t's scores (integers when `ties`)."""
    gen = torch.Generator().manual_seed(seed)
    nrows = batch + 3
    block_of = torch.full((nrows, slots), -1, dtype=torch.int32)
    for r in range(nrows):
        held = torch.randperm(width + 1, generator=gen)[:slots]  # may hold block W (a draft's opened block)
        keep = torch.rand(slots, generator=gen) < 0.85
        block_of[r] = torch.where(keep, held, -1).int()
    rows = torch.randperm(nrows, generator=gen)[:batch]
    nblocks = torch.randint(1, width + 1, (batch,), generator=gen).int()
    selection = torch.full((batch, k), -1, dtype=torch.int32)
    attended = torch.full((batch, k + extra), -1, dtype=torch.int32)
    for b in range(batch):
        n = int(torch.randint(0, min(k, int(nblocks[b])) + 1, (), generator=gen))
        chosen = torch.randperm(int(nblocks[b]), generator=gen)[:n].int()
        selection[b, :n] = chosen
        held = set(block_of[int(rows[b])].tolist())
        attended[b, :n] = torch.tensor([int(c) if int(c) in held else -1 for c in chosen], dtype=torch.int32)
        attended[b, k:] = torch.randint(-1, width, (extra,), generator=gen).int()
    if ties:
        scores = torch.randint(0, 3, (batch, width), generator=gen).float()
    else:
        scores = torch.randn(batch, width, generator=gen)
    if width > 3:
        scores[:, -1] = float("-inf")  # a block scored -inf is never taken
    return attended, selection, scores, block_of, rows, nblocks


SHAPES = [(1, 4, 8, 5, 1), (5, 8, 40, 9, 1), (7, 16, 12, 12, 0), (3, 32, 300, 33, 1), (9, 6, 6, 7, 2),
          (4, 128, 1025, 129, 1)]  # the last: budget 2048 at 16K, qwen3-8b's shape


@pytest.mark.parametrize("fill", [fill_misses, fill_misses_reference], ids=["kernel", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seed, ties", [(0, False), (1, False), (2, True)])
def test_fill_misses_equals_brute_force(fill, shape, seed, ties):
    case = random_case(*shape, seed=seed, ties=ties)
    want, want_counts = brute_force(*case)
    got, counts = fill(*(t.to(DEV) for t in case))
    assert torch.equal(got.cpu(), want) and torch.equal(counts.cpu(), want_counts)
    k = case[1].shape[1]
    assert torch.equal(got[:, k:].cpu(), case[0][:, k:])  # the opened block's column is kept
    if shape == SHAPES[3] and seed == 0:
        assert want_counts.sum() > 0  # the cases fill something


@pytest.mark.parametrize("fill", [fill_misses, fill_misses_reference], ids=["kernel", "torch"])
def test_fill_misses_changes_nothing_without_misses(fill):
    attended, selection, scores, block_of, rows, nblocks = random_case(6, 8, 50, 9, 1, seed=4)
    attended[:, :8] = selection
    got, counts = fill(*(t.to(DEV) for t in (attended, selection, scores, block_of, rows, nblocks)))
    assert torch.equal(got.cpu(), attended) and not counts.any()


def test_fill_misses_rejects_bad_arguments():
    attended, selection, scores, block_of, rows, nblocks = random_case(2, 4, 10, 5, 1, seed=0)
    with pytest.raises(ValueError, match="scores must be fp32"):
        fill_misses(attended, selection, scores.double(), block_of, rows, nblocks)
    with pytest.raises(ValueError, match="attended must be int32"):
        fill_misses(attended[:, :2], selection, scores, block_of, rows, nblocks)
    with pytest.raises(ValueError, match="rows and nblocks"):
        fill_misses(attended, selection, scores, block_of, rows[:1], nblocks)
    with pytest.raises(ValueError, match="block_of must be int32"):
        fill_misses(attended, selection, scores, block_of.long(), rows, nblocks)


@pytest.mark.parametrize("fill", [fill_misses, fill_misses_reference], ids=["kernel", "torch"])
def test_fill_misses_adds_its_counts_to_the_counter_tables(fill):
    case = random_case(*SHAPES[3], seed=0)
    _, want_counts = brute_force(*case)
    gen = torch.Generator().manual_seed(5)
    nrows = int(case[4].max()) + 2
    row_counts = torch.randint(0, 100, (nrows, 6), generator=gen)
    layer_counts = torch.randint(0, 100, (4, 6), generator=gen)
    row_before, layer_before = row_counts.clone(), layer_counts.clone()
    counters = FillCounters(row_counts.to(DEV), layer_counts.to(DEV), column=3, layer=2)
    _, counts = fill(*(t.to(DEV) for t in case), counters)
    assert torch.equal(counts.cpu(), want_counts) and want_counts.sum() > 0
    row_before[case[4].long(), 3] += want_counts.long()  # rows are distinct
    layer_before[2, 3] += want_counts.sum()
    assert torch.equal(counters.row_counts.cpu(), row_before) and torch.equal(counters.layer_counts.cpu(), layer_before)


def test_fill_misses_rejects_bad_counters():
    case = random_case(2, 4, 10, 5, 1, seed=0)
    good = torch.zeros(8, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match="counters.row_counts must be int64"):
        fill_misses(*case, FillCounters(good.int(), good, 0, 0))
    with pytest.raises(ValueError, match="column 6 or layer 0 is outside"):
        fill_misses(*case, FillCounters(good, good, 6, 0))
    with pytest.raises(ValueError, match="column 0 or layer 8 is outside"):
        fill_misses(*case, FillCounters(good, good, 0, 8))


def test_fill_kernel_compiles_for_the_h200():
    """The GPU lowering (the atomics, the loop's reductions), which the interpreter does not check."""
    run_without_interpreter("from oasiskv.kernels.miss_fill import compile_for\n"
                            "assert compile_for(90, 129, 128).asm['cubin']\n"
                            "assert compile_for(90, 513, 128).asm['cubin']\n")  # a 4x list at 8K: was minutes


@pytest.mark.parametrize("change, message", [
    ("rows", r"rows must be in \[0, 5\)"),
    ("row_counts", r"rows must be in \[0, 2\)"),  # counters with fewer rows than block_of
    ("held", r"blocks held below nblocks \(block_of\) must be in \[0, 4\)"),
    ("rows dtype", "rows must be int32 or int64, got torch.float32"),
    ("nblocks dtype", "nblocks must be int32 or int64, got torch.float32")])
def test_values_out_of_range_are_clear_errors_on_the_cpu(change, message):
    """The kernel reads block_of's row of each rows[b] (and adds to its row of the counters) and the score of each
    block held there below nblocks[b]: out of range it read another row's slots, added past row_counts, or took a
    score from past the row of scores, silently; float ids ran (nblocks) or failed inside the kernel (rows). Found
    by a helper's audit of the kernels."""
    attended, selection, scores, block_of, rows, nblocks = random_case(2, 4, 10, 5, 1, seed=0)
    rows = torch.tensor([1, 3])
    row_counts, layer_counts = torch.zeros(5, 6, dtype=torch.int64), torch.zeros(2, 6, dtype=torch.int64)
    if change == "rows":
        rows[1] = 5
    if change == "row_counts":
        row_counts = row_counts[:2]
    if change == "held":  # x_t's scores cover 4 blocks, but row 1 holds block 7 below its 10 blocks
        scores, nblocks[0], block_of[1, 0] = scores[:, :4], 10, 7
    if change == "rows dtype":
        rows = rows.float()
    if change == "nblocks dtype":
        nblocks = nblocks.float()
    counters = FillCounters(row_counts, layer_counts, column=1, layer=0)
    with pytest.raises(ValueError, match=message):
        fill_misses(attended, selection, scores, block_of, rows, nblocks, counters)
    assert not row_counts.any() and not layer_counts.any()
