"""Appending decode K/V to resident tail blocks: Triton kernel (TRITON_INTERPRET=1 on the CPU) vs the torch
twin vs a plain Python loop."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.tail_append import append_to_tails, append_to_tails_reference  # noqa: E402

from tests.kernel_device import DEV  # noqa: E402


def make_case(b, bs=8, hkv=2, d=8, layers=2, rows=5, blocks=6, draft=False, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = layers * rows * blocks  # every (layer, row, block) its own slot: rows never share a tail
    kv = torch.randn(slots, 2, bs, hkv, d, generator=gen).to(dtype)
    slot_of = torch.randperm(slots, generator=gen).to(torch.int32).view(layers, rows, blocks)
    row_ids = torch.randperm(rows, generator=gen)[:b]
    tail = torch.randint(0, blocks, (b,), generator=gen)
    high = bs - 1 if draft else bs  # a draft needs room after x_t in the same block
    fill = torch.randint(1, high + 1, (b,), generator=gen)
    k, v = (torch.randn(b, hkv, d, generator=gen).to(dtype) for _ in range(2))
    extra = tuple(torch.randn(b, hkv, d, generator=gen).to(dtype) for _ in range(2)) if draft else (None, None)
    return kv, slot_of, row_ids, tail, fill, k, v, extra


def python_loop(kv, slot_of, layer, rows, tail, fill, k, v, draft_k, draft_v):
    kv, slots = kv.clone(), []
    for b in range(len(rows)):
        s = int(slot_of[layer, rows[b], tail[b]])
        kv[s, 0, fill[b] - 1], kv[s, 1, fill[b] - 1] = k[b], v[b]
        if draft_k is not None:
            kv[s, 0, fill[b]], kv[s, 1, fill[b]] = draft_k[b], draft_v[b]
        slots.append(s)
    return kv, torch.tensor(slots, dtype=torch.int32)


@pytest.mark.parametrize("b", [1, 3, 5])
@pytest.mark.parametrize("draft", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_and_twin_match_a_python_loop(b, draft, dtype):
    kv, slot_of, rows, tail, fill, k, v, (dk, dv) = make_case(b, draft=draft, dtype=dtype, seed=b + 7 * draft)
    layer = 1
    expect_kv, expect_slots = python_loop(kv, slot_of, layer, rows, tail, fill, k, v, dk, dv)
    for impl in (append_to_tails, append_to_tails_reference):
        pool = kv.clone().to(DEV)
        moved = [t.to(DEV) if t is not None else None for t in (k, v, dk, dv)]
        slots = impl(pool, slot_of.to(DEV), layer, rows.to(DEV), tail.to(DEV), fill.to(DEV), *moved)
        assert torch.equal(slots.cpu(), expect_slots)
        assert torch.equal(pool.cpu(), expect_kv)


def test_bad_inputs_raise():
    kv, slot_of, rows, tail, fill, k, v, _ = make_case(2)
    with pytest.raises(ValueError, match="k must be"):
        append_to_tails(kv, slot_of, 0, rows, tail, fill, k[:, :1], v)
    with pytest.raises(ValueError, match="slot_of must be int32"):
        append_to_tails(kv, slot_of.long(), 0, rows, tail, fill, k, v)
    with pytest.raises(ValueError, match="both draft_k and draft_v"):
        append_to_tails(kv, slot_of, 0, rows, tail, fill, k, v, draft_k=k)


@pytest.mark.parametrize("change, draft, message", [
    (dict(fill=8), True, r"fill must be in \[1, 8\)"),  # no room after x_t for the draft: it overwrote V[0]
    (dict(fill=0), False, r"fill must be in \[1, 9\)"),  # x_t at offset -1: the slot before's V
    (dict(slot=-1), False, r"the tails' slots \(slot_of\) must be in \[0, 60\)"),  # a tail not resident
    (dict(row=5), False, r"rows must be in \[0, 5\)"),
    (dict(tail=6), False, r"tail must be in \[0, 6\)")])
def test_values_out_of_range_are_clear_errors_on_the_cpu(change, draft, message):
    """The kernel writes where rows, tail, fill and slot_of point: out of range it wrote another slot's K/V or before
    the pool, silently (the twin raised IndexError or wrapped to offset -1); found by a helper's audit of the kernels."""
    kv, slot_of, rows, tail, fill, k, v, (dk, dv) = make_case(2, draft=draft)
    if "fill" in change:
        fill[0] = change["fill"]
    if "slot" in change:
        slot_of[1, rows[0], tail[0]] = change["slot"]
    if "row" in change:
        rows[0] = change["row"]
    if "tail" in change:
        tail[0] = change["tail"]
    before = kv.clone()
    with pytest.raises(ValueError, match=message):
        append_to_tails(kv, slot_of, 1, rows, tail, fill, k, v, dk, dv)
    assert torch.equal(kv, before)
