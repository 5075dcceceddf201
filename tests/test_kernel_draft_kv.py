"""The draft token's K/V placement (kernels/draft_kv.py): Triton kernel (TRITON_INTERPRET=1 on the CPU) and
torch twin against a plain Python loop over the rows."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.draft_kv import write_draft_kv, write_draft_kv_reference  # noqa: E402

from tests.kernel_device import DEV, run_without_interpreter  # noqa: E402

LAYERS, ROWS, BS, HKV, D = 2, 5, 4, 2, 8


def make_case(b, width, max_blocks, k, dtype, seed):
    """Working-set tables as the engine keeps them: each row's slots hold distinct blocks (some empty),
    slot_of and block_of agree, last_used has ties; attended lists some held blocks (and -1s); opened is
    -1, a block without a slot or (rarely) one already resident."""
    gen = torch.Generator().manual_seed(seed)
    slot_of = torch.full((LAYERS, ROWS, max_blocks + 1), -1, dtype=torch.int32)
    block_of = torch.full((LAYERS, ROWS, width + 1), -1, dtype=torch.int32)
    last_used = torch.zeros((LAYERS, ROWS, width + 1), dtype=torch.int64)
    for layer in range(LAYERS):
        for r in range(ROWS):
            blocks = torch.randperm(max_blocks, generator=gen)[:width]
            for j in range(width):
                if torch.rand((), generator=gen) < 0.85:
                    block_of[layer, r, j] = blocks[j]
                    slot_of[layer, r, blocks[j]] = r * width + j
                    last_used[layer, r, j] = torch.randint(0, 4, (), generator=gen)
    rows = torch.randperm(ROWS, generator=gen)[:b]
    layer = 1
    attended = torch.full((b, k), -1, dtype=torch.int32)
    opened = torch.full((b,), -1, dtype=torch.int32)
    for i, r in enumerate(rows.tolist()):
        held = [x for x in block_of[layer, r, :width].tolist() if x >= 0]
        take = torch.randperm(len(held), generator=gen)[:min(k, width - 1, len(held))].tolist()
        for c, t in enumerate(take):
            if torch.rand((), generator=gen) < 0.8:
                attended[i, c] = held[t]
        kind = torch.randint(0, 6, (), generator=gen).item()
        free = [x for x in range(max_blocks) if x not in held]
        if kind >= 2 and free:
            opened[i] = free[torch.randint(0, len(free), (), generator=gen).item()]
        elif kind == 1 and held:
            opened[i] = held[0]
    # a slot of the row's own (as in the engine): no two rows write one place, which would race on a GPU
    tail_slots = rows * width + torch.randint(0, width, (b,), generator=gen)
    offset = torch.where(opened >= 0, 0, torch.randint(1, BS, (b,), generator=gen))
    kv = torch.randn(ROWS * width, 2, BS, HKV, D, generator=gen).to(dtype)
    k_new, v_new = (torch.randn(b, HKV, D, generator=gen).to(dtype) for _ in range(2))
    return kv, slot_of, block_of, last_used, layer, rows, tail_slots, opened, offset, attended, k_new, v_new


def python_loop(kv, slot_of, block_of, last_used, layer, rows, tail_slots, opened, offset, attended, k, v, step):
    kv, slot_of, block_of, last_used = kv.clone(), slot_of.clone(), block_of.clone(), last_used.clone()
    width = block_of.shape[2] - 1
    for i, r in enumerate(rows.tolist()):
        slot = int(tail_slots[i])
        o = int(opened[i])
        if o >= 0:
            if slot_of[layer, r, o] >= 0:
                slot = int(slot_of[layer, r, o])
            else:
                protected = set(attended[i].tolist()) - {-1}
                candidates = []
                for j in range(width):
                    held = int(block_of[layer, r, j])
                    if held >= 0 and held in protected:
                        continue
                    candidates.append((-1 if held < 0 else int(last_used[layer, r, j]), j))
                _, j = min(candidates)
                old = int(block_of[layer, r, j])
                if old >= 0:
                    slot_of[layer, r, old] = -1
                block_of[layer, r, j] = o
                slot = r * width + j
                slot_of[layer, r, o] = slot
            last_used[layer, r, slot - r * width] = step
        kv[slot, 0, int(offset[i])] = k[i]
        kv[slot, 1, int(offset[i])] = v[i]
    return kv, slot_of, block_of, last_used


@pytest.mark.parametrize("b, width, k", [(1, 3, 2), (3, 5, 4), (5, 9, 8), (4, 17, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("compare", [None, 4], ids=["one-pass", "chunks-of-2"])
def test_kernel_and_twin_match_a_python_loop(b, width, k, dtype, seed, compare, monkeypatch):
    if compare:  # the protected list read 2 blocks a pass
        monkeypatch.setattr("oasiskv.kernels.draft_kv._COMPARE_ELEMENTS", compare)
    case = make_case(b, width, max_blocks=3 * width, k=k, dtype=dtype, seed=seed + 10 * b)
    kv, slot_of, block_of, last_used, layer, rows, tail_slots, opened, offset, attended, k_new, v_new = case
    step = 7
    expect = python_loop(*case, step)
    assert (opened >= 0).any()
    for impl in (write_draft_kv, write_draft_kv_reference):
        tables = [t.clone().to(DEV) for t in (kv, slot_of, block_of, last_used)]
        impl(*tables, layer, *(t.to(DEV) for t in (rows, tail_slots, opened, offset, attended, k_new, v_new)),
             torch.tensor(step, device=DEV))
        for got, want in zip(tables, expect):
            assert torch.equal(got.cpu(), want), impl.__name__


def test_compiles_for_the_h200():
    # the interpreter cannot tell whether the kernel lowers for the GPU: compile for sm_90 (no GPU needed) in a
    # process without the interpreter, at the headline width (129 slots) and at a 4x shortlist's working set (513)
    code = ("from oasiskv.kernels.draft_kv import compile_for\n"
            "assert compile_for(90, 129).asm['cubin']\n"
            "assert compile_for(90, 513).asm['cubin']\n")
    run_without_interpreter(code)


def test_bad_inputs_raise():
    case = list(make_case(2, 5, 15, 4, torch.float32, 0))
    step = torch.tensor(1)
    with pytest.raises(ValueError, match="attended must be int32"):
        write_draft_kv(*case[:9], case[9].long(), *case[10:], step)
    with pytest.raises(ValueError, match="step must be a 0-d int64 tensor"):
        write_draft_kv(*case, 1)
    with pytest.raises(ValueError, match="k must be"):
        write_draft_kv(*case[:10], case[10][:, :1], case[11], step)
    with pytest.raises(ValueError, match="layer 5 out of range"):
        write_draft_kv(*case[:4], 5, *case[5:], step)


@pytest.mark.parametrize("change, message", [
    ("rows", r"rows must be in \[0, 5\)"),
    ("tail_slots", r"tail_slots must be in \[0, 25\)"),
    ("offset", r"offset must be in \[0, 4\)"),
    ("opened", r"opened must be in \[-1, 15\)"),  # block 15: the spare column
    ("opened slot", r"the opened blocks' slots \(slot_of\) must be in \[-1, 25\)")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_values_out_of_range_are_clear_errors_on_the_cpu(change, message, dtype):
    """The kernel writes the tables and the pool where rows, tail_slots, offset and opened point: out of range it
    wrote another slot's K/V, past the pool or into the spare column, silently; found by a helper's audit of the
    kernels."""
    case = list(make_case(3, 5, 15, 4, dtype, 0))
    kv, slot_of, block_of, last_used, layer, rows, tail_slots, opened, offset = case[:9]
    if change == "rows":
        rows[0] = 5
    if change == "tail_slots":
        tail_slots[0] = 25
    if change == "offset":
        offset[0] = 4
    if change == "opened":
        opened[0] = 15
    if change == "opened slot":  # a resident block whose slot is past the pool
        opened[0] = 3
        slot_of[layer, rows[0], 3] = 25
    before = [t.clone() for t in (kv, slot_of, block_of, last_used)]
    with pytest.raises(ValueError, match=message):
        write_draft_kv(*case, torch.tensor(7))
    assert all(torch.equal(t, old) for t, old in zip((kv, slot_of, block_of, last_used), before))
