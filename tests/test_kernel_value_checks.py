"""Launchers refuse ids and lengths that would make their Triton kernel read or write outside its tensors (under
the interpreter a segfault, on the GPU garbage), on CPU tensors where the check costs no sync; the sparse decode
reference ignores whatever a selected block holds past seq_len, as the kernel does; silu_mul and write_kv_slots run
their torch twin on a CPU without the interpreter. Found by a helper's audit of the kernels (2026-12-05)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.block_topk import plan_prefetch_reference, predict_prefetch  # noqa: E402
from oasiskv.kernels.kv_write import write_kv_slots  # noqa: E402
from oasiskv.kernels.paged_decode import paged_decode_attention  # noqa: E402
from oasiskv.kernels.shortlist_mass import shortlist_block_lse  # noqa: E402
from oasiskv.kernels.sparse_decode import (sparse_decode_attention, sparse_decode_attention_padded,  # noqa: E402
                                           sparse_decode_padded_reference)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the checks run on CPU tensors")

BS, HQ, HKV, D = 16, 4, 2, 32


def pool(slots=6, dtype=torch.float32, seed=0):
    return torch.randn(slots, 2, BS, HKV, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def query(batch=1, dtype=torch.float32):
    return torch.randn(batch, HQ, D, generator=torch.Generator().manual_seed(1)).to(dtype)


def i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("attend", ["reference", "kernel"])
@pytest.mark.parametrize("junk", [float("nan"), float("inf")])
def test_sparse_decode_ignores_what_a_block_holds_past_seq_len(attend, junk):
    kv, q = pool(), query()
    tables, selection, lens = i32([[3, 1, 4]]), i32([[0, 2]]), i32([40])  # block 2 holds tokens 32..39 of 48
    clean = sparse_decode_padded_reference(q, kv, tables, selection, lens, 0.2)
    kv[4, :, 8:] = junk  # the rows past seq_len of the tail's slot
    fn = sparse_decode_padded_reference if attend == "reference" else sparse_decode_attention_padded
    got = fn(q, kv, tables, selection, lens, 0.2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, clean, rtol=1e-5, atol=1e-6)
    # against a brute force over the 24 valid keys
    keys = torch.cat([kv[3, 0], kv[4, 0, :8]]).double()
    vals = torch.cat([kv[3, 1], kv[4, 1, :8]]).double()
    qh = q[0].double().view(HKV, HQ // HKV, D)
    p = torch.softmax(torch.einsum("hgd,thd->hgt", qh, keys) * 0.2, -1)
    torch.testing.assert_close(got[0].double(), torch.einsum("hgt,thd->hgd", p, vals).reshape(HQ, D),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tables, lens, message", [
    ([[0, 1, 2]], [10_000], "seq_lens must be in \\[1, 49\\)"),
    ([[0, 1, 2]], [0], "seq_lens must be in \\[1, 49\\)"),
    ([[0, 10**6, 2]], [20], "block_tables entries of the blocks read must be in \\[0, 6\\)"),
    ([[0, -1, 2]], [20], "block_tables entries of the blocks read must be in \\[0, 6\\)"),
])
def test_paged_decode_refuses_lengths_and_tables_outside_the_pool(tables, lens, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(query(), pool(), i32(tables), i32(lens), 0.2)


def test_paged_decode_reads_no_table_entry_past_its_blocks():
    kv, q = pool(), query()
    out = paged_decode_attention(q, kv, i32([[0, 1, -1]]), i32([20]), 0.2)  # the -1 is never read
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("selection, tables, lens, rows, message", [
    ([[0, 7]], [[0, 1, 2]], [40], None, "selected block ids must be in \\[0, 3\\)"),
    ([[0, 1]], [[0, 99, 2]], [40], None, "block_tables entries of selected blocks must be in \\[0, 6\\)"),
    ([[0, 1]], [[0, 1, 2]], [40], [5], "table_rows must be in \\[0, 1\\)"),
])
def test_sparse_decode_refuses_ids_outside_the_table_or_pool(selection, tables, lens, rows, message):
    table_rows = None if rows is None else torch.tensor(rows)
    with pytest.raises(ValueError, match=message):
        sparse_decode_attention_padded(query(), pool(), i32(tables), i32(selection), i32(lens), 0.2,
                                       table_rows=table_rows)


def test_sparse_decode_reads_no_table_entry_of_a_block_past_the_query():
    """A selected block past what the query sees (a draft's block, say) may have no slot yet."""
    kv, q = pool(), query()
    got = sparse_decode_attention_padded(q, kv, i32([[0, 1, -1]]), i32([[0, 1, 2]]), i32([20]), 0.2)
    want = sparse_decode_padded_reference(q, kv, i32([[0, 1, -1]]), i32([[0, 1]]), i32([20]), 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sparse_decode_refuses_a_bad_csr_list_and_non_float_queries():
    kv, tables, lens = pool(), i32([[0, 1, 2]]), i32([40])
    with pytest.raises(ValueError, match="sel_indptr must rise from 0 to at most sel_indices' 2 entries"):
        sparse_decode_attention(query(), kv, tables, i32([0, 5]), i32([0, 1]), lens, 0.2)
    with pytest.raises(ValueError, match="q must be float16, bfloat16 or float32"):
        sparse_decode_attention_padded(query().to(torch.float64), kv.double(), tables, i32([[0]]), lens, 0.2)


@pytest.mark.parametrize("listed, tables, message", [
    ([[0, 5]], [[0, 1, 2]], "listed block ids must be in \\[0, 3\\)"),
    ([[0, 1]], [[0, 50, 2]], "tables entries of listed blocks must be in \\[-1, 6\\)"),
])
def test_shortlist_refuses_ids_outside_the_table_or_pool(listed, tables, message):
    with pytest.raises(ValueError, match=message):
        shortlist_block_lse(query(), pool(), i32(tables), i32(listed), i32([40]), 0.2)


def test_shortlist_refuses_other_dtypes_and_block_sizes():
    tables, listed, lens = i32([[0, 1, 2]]), i32([[0, 1]]), i32([40])
    with pytest.raises(ValueError, match="must share one of float16, bfloat16, float32"):
        shortlist_block_lse(query().to(torch.int32), pool(), tables, listed, lens, 0.2)
    odd = torch.randn(6, 2, 12, HKV, D)
    with pytest.raises(ValueError, match="block size must be a power of two, got 12"):
        shortlist_block_lse(query(), odd, tables, listed, lens, 0.2)


@pytest.mark.parametrize("plan", [predict_prefetch, plan_prefetch_reference])
def test_prefetch_refuses_residency_narrower_than_the_scores(plan):
    scores = torch.arange(10, dtype=torch.float32).repeat(2, 1)
    narrow = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="resident must be bool \\[R=2, N>=10\\]"):
        if plan is predict_prefetch:
            plan(scores, i32([10, 10]), 6, 1, 1, 4, 10, resident=narrow)
        else:
            plan(scores, i32([[0, 6, 7, 8, 9, -1]] * 2), 4, resident=narrow)
    slot_of = torch.full((1, 2, 4), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="slot_of must be int32 \\[layers, rows, blocks>=10\\]"):
        predict_prefetch(scores, i32([10, 10]), 6, 1, 1, 4, 10, slot_of=slot_of,
                         layer_of=torch.tensor([0, 0]), rows=torch.tensor([0, 1]))


@pytest.mark.parametrize("blocks, offsets, message", [
    ([1], [16], "slot_offsets must be in \\[0, 16\\)"),
    ([6], [0], "slot_blocks must be in \\[0, 6\\)"),
    ([-1], [0], "slot_blocks must be in \\[0, 6\\)"),
])
def test_kv_write_refuses_slots_outside_the_pool(blocks, offsets, message):
    kv = pool()
    before = kv.clone()
    k = v = torch.ones(1, HKV, D)
    with pytest.raises(ValueError, match=message):
        write_kv_slots(kv, torch.tensor(blocks), torch.tensor(offsets), k, v)
    assert torch.equal(kv, before)  # nothing written


def test_cpu_without_the_interpreter_runs_the_torch_twins():
    code = """
import torch
from oasiskv.kernels.kv_write import write_kv_slots, write_kv_reference
from oasiskv.kernels.silu_mul import silu_mul
g, u = torch.randn(3, 40), torch.randn(3, 40)
assert torch.equal(silu_mul(g, u), torch.nn.functional.silu(g) * u)
a, b = torch.zeros(4, 2, 16, 2, 8), torch.zeros(4, 2, 16, 2, 8)
k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
slots, offs = torch.tensor([3, 0]), torch.tensor([5, 15])
write_kv_slots(a, slots, offs, k, v)
write_kv_reference(b, slots, offs, k, v)
assert torch.equal(a, b) and a.abs().sum() > 0
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
