import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from oasiskv.kernels import block_select
from oasiskv.kernels.block_select import (
    block_scores,
    block_scores_multi,
    block_scores_multi_reference,
    block_scores_reference,
)
from oasiskv.kernels.selection_rule import select_blocks
from oasiskv.kernels.block_summary import update_block_summaries

from tests.kernel_device import DEV, INTERPRETED, ON_GPU, run_without_interpreter  # noqa: E402


def _case(bsz, hq, hkv, d, max_blocks, num_blocks_per_seq, dtype, seed=0, strided_q=False, device="cpu", parts=1):
    """parts: summaries per block (rows block x parts ..)."""
    g = torch.Generator().manual_seed(seed)
    phys_blocks = bsz * max_blocks + 5
    q = torch.randn(bsz, hq, d + (8 if strided_q else 0), generator=g).to(dtype)
    q = q.to(device)  # before slicing, so that the strided view reaches the kernel
    q = q[:, :, :d] if strided_q else q
    lo = torch.randn(phys_blocks * parts, hkv, d, generator=g)
    hi = lo + torch.rand(phys_blocks * parts, hkv, d, generator=g) * 2
    summaries = torch.stack([lo, hi], dim=1).to(dtype)
    # each sequence's blocks live at scattered physical ids; unused entries are garbage (-1)
    perm = torch.randperm(phys_blocks, generator=g)[: bsz * max_blocks].view(bsz, max_blocks)
    nb = torch.tensor(num_blocks_per_seq, dtype=torch.int32)
    j = torch.arange(max_blocks)
    tables = torch.where(j[None] < nb[:, None].long(), perm, -1).to(torch.int32)
    return q, summaries.to(device), tables.to(device), nb.to(device)


def _brute_force_scores(q, summaries, tables, nb, parts=1):
    """Straight from the definition: float64 loops over sequences, blocks, heads (and a block's parts)."""
    bsz, hq, d = q.shape
    hkv = summaries.shape[2]
    group = hq // hkv
    out = torch.full(tables.shape, -math.inf, dtype=torch.float64)
    for b in range(bsz):
        for j in range(int(nb[b])):
            total = 0.0
            for gi in range(hkv):
                best = -math.inf
                for p in range(int(tables[b, j]) * parts, (int(tables[b, j]) + 1) * parts):
                    mn, mx = summaries[p, 0, gi].double(), summaries[p, 1, gi].double()
                    for h in range(gi * group, (gi + 1) * group):
                        qh = q[b, h].double()
                        best = max(best, float(torch.maximum(qh * mn, qh * mx).sum()))
                total += best
            out[b, j] = total
    return out


SHAPES = [
    # bsz, hq, hkv, d, max_blocks, num_blocks_per_seq
    (3, 8, 2, 64, 70, [70, 1, 0]),  # several tiles, an empty and a 1-block sequence
    (2, 9, 3, 64, 20, [20, 13]),  # SmolLM2 heads: group of 3
    (2, 4, 4, 40, 33, [5, 33]),  # group of 1, non-power-of-2 head_dim
]


@pytest.mark.skipif(not INTERPRETED, reason="checks that the interpreter runs the kernel on the CPU")
def test_kernel_is_interpreted():
    assert block_select._triton_runs(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided_q", [False, True])
def test_triton_matches_reference(dtype, shape, strided_q):
    q, s, tables, nb = _case(*shape, dtype=dtype, strided_q=strided_q, device=DEV)
    got = block_scores(q, s, tables, nb).cpu()
    ref = block_scores_reference(q.cpu(), s.cpu(), tables.cpu(), nb.cpu())
    assert got.dtype == torch.float32 and got.shape == tables.shape
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_brute_force(dtype, shape):
    q, s, tables, nb = _case(*shape, dtype=dtype, seed=1)
    ref = block_scores_reference(q, s, tables, nb)
    bf = _brute_force_scores(q, s, tables, nb)
    j = torch.arange(tables.shape[1])
    assert torch.all(ref[j[None] >= nb[:, None].long()] == -math.inf)
    torch.testing.assert_close(ref.double(), bf, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_sub_block_scores_match_reference_and_brute_force(shape, parts):
    """Sub-block summaries: per KV head the best head over the block's parts, summed over KV heads."""
    q, s, tables, nb = _case(*shape, dtype=torch.float32, seed=2, parts=parts)
    ref = block_scores_reference(q, s, tables, nb, parts)
    torch.testing.assert_close(ref.double(), _brute_force_scores(q, s, tables, nb, parts), rtol=1e-5, atol=1e-4)
    counts = torch.stack([(nb - 1).clamp(min=0), nb]).contiguous()
    got = block_scores_multi(torch.stack([q, q.flip(0)]).to(DEV), s.to(DEV), tables.to(DEV), counts.to(DEV),
                             parts).cpu()
    expected = torch.stack([block_scores_reference(q, s, tables, counts[0], parts),
                            block_scores_reference(q.flip(0), s, tables, counts[1], parts)])
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_score_is_an_upper_bound_end_to_end():
    """summaries from real keys -> block_scores >= sum_g max_h max_k q_h . k."""
    torch.manual_seed(2)
    bsz, hq, hkv, d, block_size, max_blocks = 2, 4, 2, 16, 16, 6
    kv = torch.randn(bsz * max_blocks, 2, block_size, hkv, d)
    summaries = torch.zeros(bsz * max_blocks, 2, hkv, d, device=DEV)
    nb = torch.tensor([6, 4], dtype=torch.int32)
    tables = torch.arange(bsz * max_blocks, dtype=torch.int32).view(bsz, max_blocks)
    fill = torch.full((bsz * max_blocks,), block_size, dtype=torch.int32)
    fill[tables[0, 5]] = 9  # partial tail blocks
    fill[tables[1, 3]] = 1
    update_block_summaries(summaries, kv.to(DEV), tables.flatten().to(DEV), fill.to(DEV))
    q = torch.randn(bsz, hq, d)
    scores = block_scores(q.to(DEV), summaries, tables.to(DEV), nb.to(DEV)).cpu()
    for b in range(bsz):
        for j in range(int(nb[b])):
            p = int(tables[b, j])
            keys = kv[p, 0, : int(fill[p])]  # [n, Hkv, D]
            exact = sum(
                max(float((keys[:, h // (hq // hkv)] @ q[b, h]).max()) for h in range(g * 2, g * 2 + 2))
                for g in range(hkv)
            )
            assert float(scores[b, j]) >= exact - 1e-4


@pytest.mark.parametrize("fn", [block_scores, block_scores_reference])
def test_block_scores_bad_arguments_raise(fn):
    # CPU on purpose: value checks run by default on CPU tensors only (a sync on CUDA)
    q, s, tables, nb = _case(2, 4, 2, 16, 5, [5, 3], torch.float32)
    cases = [
        (q[:, :, :8], s, tables, nb, "head_dim"),
        (q[:, :3], s, tables, nb, "multiple of Hkv"),
        (q[0], s, tables, nb, "q must be"),
        (q, s[:, :1], tables, nb, "summaries must be"),
        (q, s, tables.long(), nb, "block_tables must be"),
        (q, s, tables[:1], nb, "block_tables must be"),
        (q, s, tables, nb[:1], "num_blocks_per_seq must be int32"),
        (q, s, tables, torch.tensor([6, 3], dtype=torch.int32), r"num_blocks_per_seq must be in \[0, 5\]"),
        (q, s, tables, torch.tensor([5, 4], dtype=torch.int32), "block_tables entries"),  # reads a -1
    ]
    for args in cases:
        with pytest.raises(ValueError, match=args[-1]):
            fn(*args[:-1])


# ---------------------------------------------------------------- block_scores_multi

# per query, the logical blocks of each of 4 sequences it scores: different counts, zeros included
# (sequence 3: no query scores anything); the block tables are valid up to the first row's counts
MULTI_COUNTS = [[70, 33, 5, 0], [69, 0, 5, 0], [0, 33, 1, 0]]


def _multi_case(nq, group, d, dtype, strided, seed=4):
    """q [NQ, B, Hq, D]; strided: the rows of one [T, Hq, D + 8] tensor, NQ row ranges `real` apart
    (how oasis passes x_t's queries and its drafts')."""
    bsz, hkv, max_blocks = 4, 2, 70
    hq = hkv * group
    _, s, tables, _ = _case(bsz, hq, hkv, d, max_blocks, MULTI_COUNTS[0], dtype, seed=seed, device=DEV)
    g = torch.Generator().manual_seed(seed + 1)
    if strided:
        real = bsz + 3  # rows in between, like prefill rows between x_t's and the drafts'
        rows = torch.randn((nq - 1) * real + bsz, hq, d + 8, generator=g).to(dtype).to(DEV)
        q = rows[:, :, :d].unfold(0, bsz, real).movedim(-1, 1)
        assert not q.is_contiguous() and q.shape == (nq, bsz, hq, d)
    else:
        q = torch.randn(nq, bsz, hq, d, generator=g).to(dtype).to(DEV)
    counts = torch.tensor(MULTI_COUNTS[:nq], dtype=torch.int32, device=DEV)
    return q, s, tables, counts


@pytest.mark.parametrize("nq", [1, 2, 3])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_multi_is_bit_identical_to_separate_calls(nq, group, d, strided, dtype):
    q, s, tables, counts = _multi_case(nq, group, d, dtype, strided)
    got = block_scores_multi(q, s, tables, counts)
    assert got.dtype == torch.float32 and got.shape == (nq, *tables.shape)
    for n in range(nq):
        assert torch.equal(got[n], block_scores(q[n], s, tables, counts[n]))
    ref = block_scores_multi_reference(q.cpu(), s.cpu(), tables.cpu(), counts.cpu())
    assert torch.equal(torch.isinf(got.cpu()), torch.isinf(ref))
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-4)


def test_multi_reference_is_the_single_reference_per_query():
    q, s, tables, counts = _multi_case(3, 4, 64, torch.float32, strided=True)
    q, s, tables, counts = q.cpu(), s.cpu(), tables.cpu(), counts.cpu()
    ref = block_scores_multi_reference(q, s, tables, counts)
    j = torch.arange(tables.shape[1])
    assert torch.all(ref[j[None, None] >= counts[:, :, None].long()] == -math.inf)
    for n in range(3):
        assert torch.equal(ref[n], block_scores_reference(q[n], s, tables, counts[n]))


@pytest.mark.parametrize("fn", [block_scores_multi, block_scores_multi_reference])
def test_block_scores_multi_bad_arguments_raise(fn):
    q1, s, tables, nb = _case(2, 4, 2, 16, 5, [5, 3], torch.float32)
    q, counts = torch.stack([q1, q1]), torch.stack([nb, nb])
    cases = [
        (q[0], s, tables, counts, "q must be"),
        (q[:0], s, tables, counts[:0], "q must be"),
        (q, s, tables, nb, "num_blocks must be int32"),
        (q, s, tables, counts[:1], "num_blocks must be int32"),
        (q, s, tables, counts.long(), "num_blocks must be int32"),
        (q[..., :8], s, tables, counts, "head_dim"),
        (q, s[:, :1], tables, counts, "summaries must be"),
        (q, s, tables[:1], counts, "block_tables must be"),
        (q, s, tables, counts + 1, r"num_blocks must be in \[0, 5\]"),
        (q, s, tables, torch.tensor([[5, 3], [5, 4]], dtype=torch.int32), "block_tables entries"),  # reads a -1
    ]
    for args in cases:
        with pytest.raises(ValueError, match=args[-1]):
            fn(*args[:-1])


def test_select_blocks_pipeline_and_ignores_invalid_scores():
    q, s, tables, nb = _case(3, 8, 2, 32, 40, [40, 7, 0], torch.float32, seed=3, device=DEV)
    scores = block_scores(q, s, tables, nb)
    indptr, indices = select_blocks(scores, nb, budget_blocks=10, sink_blocks=1, local_blocks=3)
    assert indptr.tolist() == [0, 10, 17, 17]
    assert indices[10:].tolist() == list(range(7))
    first = indices[:10].tolist()
    assert first[0] == 0 and first[-3:] == [37, 38, 39]
    top = scores[0, 1:37].topk(6).indices + 1
    assert sorted(first[1:7]) == sorted(top.tolist())


@pytest.mark.parametrize("parts", [1, 4])
def test_score_kernel_compiles_for_the_h200(parts):
    """The GPU lowering of the sub-block fold (a reshape and a max), which the interpreter does not check."""
    run_without_interpreter("from oasiskv.kernels.block_select import compile_for\n"
                            f"assert compile_for(90, {parts}).asm['cubin']\n")
