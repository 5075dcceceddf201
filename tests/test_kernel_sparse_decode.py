"""Sparse decode attention: Triton kernel vs torch reference vs float64 brute force / dense attention.

On a CPU machine the Triton kernels run under TRITON_INTERPRET=1 (fp32 and fp16 only: bf16 is
garbage under the interpreter). On a GPU machine, run with TRITON_INTERPRET=0 to test the compiled
kernels, bf16 included."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.sparse_decode import (sparse_decode_attention, sparse_decode_attention_padded,  # noqa: E402
                                           sparse_decode_padded_reference, sparse_decode_reference)

from tests.kernel_device import DEV, ON_GPU  # noqa: E402
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# ||out - ref|| / ||ref|| bounds for outputs stored in each dtype
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_case(seq_lens, hq, hkv, d, bs, dtype, select="random", seed=0, drop_unselected=True):
    """Random sequences scattered over shuffled physical slots; unused slots hold NaN so that any
    read outside the selection shows up. Returns the kernel inputs and each sequence's logical
    [seq_len, Hkv, D] keys/values (fp32) for the dense check."""
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    nblocks = [math.ceil(s / bs) for s in seq_lens]
    max_blocks = max(max(nblocks), 1) + 1
    num_slots = sum(nblocks) + 5
    kv = torch.full((num_slots, 2, bs, hkv, d), float("nan"))
    perm = torch.randperm(num_slots, generator=gen)
    block_tables = torch.full((B, max_blocks), -1, dtype=torch.int32)
    logical_k, logical_v, sel, indptr = [], [], [], [0]
    used = 0
    for b, (s, nb) in enumerate(zip(seq_lens, nblocks)):
        k = torch.randn(nb * bs, hkv, d, generator=gen)
        v = torch.randn(nb * bs, hkv, d, generator=gen)
        if select == "all":
            chosen = list(range(nb))
        elif select == "random":
            m = torch.rand(nb, generator=gen) < 0.5
            if nb:
                m[nb - 1] = True  # the tail block is always selected
            chosen = torch.nonzero(m).flatten().tolist()
        else:
            chosen = list(select[b])
        for j in range(nb):
            if drop_unselected and j not in chosen:
                continue  # not resident: block table stays -1
            slot = int(perm[used])
            used += 1
            block_tables[b, j] = slot
            kv[slot, 0] = k[j * bs:(j + 1) * bs]
            kv[slot, 1] = v[j * bs:(j + 1) * bs]
            # tokens past seq_len in the tail block are garbage the kernel must not use
            if (j + 1) * bs > s:
                kv[slot, :, s - j * bs:] = 1e4
        logical_k.append(k[:s])
        logical_v.append(v[:s])
        sel += chosen
        indptr.append(len(sel))
    q = torch.randn(B, hq, d, generator=gen)
    args = (
        q.to(dtype).to(DEV),
        kv.to(dtype).to(DEV),
        block_tables.to(DEV),
        torch.tensor(indptr, dtype=torch.int32, device=DEV),
        torch.tensor(sel, dtype=torch.int32, device=DEV),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        d ** -0.5,
    )
    return args, logical_k, logical_v


def bruteforce_f64(q, kv, block_tables, indptr, indices, seq_lens, scale):
    """Float64 attention over explicitly gathered tokens, one token at a time."""
    q, kv = q.double().cpu(), kv.double().cpu()
    bt, indptr, indices, seq_lens = (t.cpu().tolist() for t in (block_tables, indptr, indices, seq_lens))
    B, hq, d = q.shape
    bs, hkv = kv.shape[2], kv.shape[3]
    group = hq // hkv
    out = torch.zeros(B, hq, d, dtype=torch.float64)
    for b in range(B):
        ks, vs = [], []
        for j in indices[indptr[b]:indptr[b + 1]]:
            slot = bt[b][j]
            for t in range(min(bs, seq_lens[b] - j * bs)):
                ks.append(kv[slot, 0, t])
                vs.append(kv[slot, 1, t])
        if not ks:
            continue
        k, v = torch.stack(ks), torch.stack(vs)  # [n, hkv, d]
        for h in range(hq):
            p = torch.softmax((k[:, h // group] @ q[b, h]) * scale, dim=0)
            out[b, h] = p @ v[:, h // group]
    return out


def dense_f64(q, logical_k, logical_v, scale):
    q = q.double().cpu()
    B, hq, d = q.shape
    out = torch.empty(B, hq, d, dtype=torch.float64)
    for b in range(B):
        k, v = logical_k[b].double(), logical_v[b].double()
        group = hq // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [s, hq, d]
        v = v.repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[b], k) * scale, dim=-1)
        out[b] = torch.einsum("hs,shd->hd", p, v)
    return out


SHAPES = [  # seq_lens, hq, hkv, d, block_size
    ([37, 130, 16, 1], 4, 4, 32, 16),   # GQA group 1, partial tails, a 1-token sequence
    ([100, 61, 200], 6, 2, 32, 16),     # group 3
    ([90, 33], 8, 2, 64, 8),            # group 4, block size 8
    ([45, 77, 12], 4, 1, 16, 4),        # group 4, block size 4 (several blocks per dot)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"g{s[1] // s[2]}_bs{s[4]}_d{s[3]}")
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_triton_matches_reference(dtype, shape, num_splits):
    seq_lens, hq, hkv, d, bs = shape
    args, _, _ = make_case(seq_lens, hq, hkv, d, bs, dtype, seed=hq * 7 + d)
    ref = sparse_decode_reference(*args)
    out = sparse_decode_attention(*args, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"g{s[1] // s[2]}_bs{s[4]}_d{s[3]}")
def test_reference_matches_bruteforce(shape):
    seq_lens, hq, hkv, d, bs = shape
    args, _, _ = make_case(seq_lens, hq, hkv, d, bs, torch.float32, seed=3)
    assert rel_err(sparse_decode_reference(*args), bruteforce_f64(*args)) < 1e-5


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"g{s[1] // s[2]}_bs{s[4]}_d{s[3]}")
def test_all_blocks_equals_dense(impl, dtype, shape):
    """Selecting every block of every sequence is exactly dense attention over the sequence."""
    seq_lens, hq, hkv, d, bs = shape
    args, lk, lv = make_case(seq_lens, hq, hkv, d, bs, dtype, select="all", seed=11)
    fn = sparse_decode_attention if impl == "triton" else sparse_decode_reference
    out = fn(*args)
    # the dense check uses the dtype-rounded K/V/q that the kernel saw
    lk = [k.to(dtype).float() for k in lk]
    lv = [v.to(dtype).float() for v in lv]
    want = dense_f64(args[0], lk, lv, args[-1])
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["first", "tail", "middle"])
def test_single_block_selection(dtype, which):
    seq_lens = [70, 33, 50]  # 5, 3, 4 blocks of 16; tails of 6, 1, 2 tokens
    nb = [math.ceil(s / 16) for s in seq_lens]
    pick = {"first": [[0] for _ in nb], "tail": [[n - 1] for n in nb], "middle": [[n // 2] for n in nb]}
    args, _, _ = make_case(seq_lens, 8, 2, 32, 16, dtype, select=pick[which], seed=5)
    ref = sparse_decode_reference(*args)
    assert rel_err(ref, bruteforce_f64(*args)) < TOL[dtype]
    for ns in (None, 2):
        assert rel_err(sparse_decode_attention(*args, num_splits=ns), ref) < TOL[dtype]


def test_empty_selection_gives_zeros():
    args, _, _ = make_case([40, 20], 4, 2, 16, 16, torch.float32, select=[[], [0, 1]], seed=2)
    ref = sparse_decode_reference(*args)
    assert (ref[0] == 0).all()
    for ns in (None, 1, 2):
        out = sparse_decode_attention(*args, num_splits=ns)
        assert (out[0] == 0).all() and rel_err(out, ref) < 1e-5


def test_out_param_and_strided_q():
    args, _, _ = make_case([50, 90], 8, 2, 32, 16, torch.float32, seed=8)
    q = args[0]
    wide = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2], device=DEV)
    wide[..., ::2] = q  # non-contiguous q with the same values
    out = torch.full_like(q, float("nan"))
    got = sparse_decode_attention(wide[..., ::2], *args[1:], out=out)
    assert got is out
    assert rel_err(out, sparse_decode_reference(*args)) < 1e-5


def test_order_of_selection_does_not_matter():
    args, _, _ = make_case([160], 4, 2, 32, 16, torch.float32, select=[[0, 3, 5, 9]], seed=4)
    shuffled = list(args)
    shuffled[4] = args[4].flip(0)
    ref = sparse_decode_reference(*args)
    assert rel_err(sparse_decode_attention(*shuffled, num_splits=2), ref) < 1e-5


def test_bad_inputs_raise():
    args, _, _ = make_case([40], 4, 2, 16, 16, torch.float32, seed=1)
    q, kv, bt, ip, ix, sl, sc = args
    with pytest.raises(ValueError, match="Hq"):
        sparse_decode_attention(q[:, :3], kv, bt, ip, ix, sl, sc)
    with pytest.raises(ValueError, match="head_dim"):
        sparse_decode_attention(q[..., :8], kv, bt, ip, ix, sl, sc)
    with pytest.raises(ValueError, match="dtype"):
        sparse_decode_attention(q.half(), kv, bt, ip, ix, sl, sc)
    with pytest.raises(ValueError, match="int32"):
        sparse_decode_attention(q, kv, bt.long(), ip, ix, sl, sc)
    with pytest.raises(ValueError, match="sel_indptr"):
        sparse_decode_attention(q, kv, bt, ip[:1], ix, sl, sc)
    with pytest.raises(ValueError, match="kv_layer"):
        sparse_decode_attention(q, kv[:, :1], bt, ip, ix, sl, sc)
    with pytest.raises(ValueError, match="out"):
        sparse_decode_attention(q, kv, bt, ip, ix, sl, sc, out=torch.empty(1, 4, 8, device=DEV))


def test_indices_capacity_beyond_indptr():
    """sel_indices may be a fixed-capacity buffer longer than indptr[-1] (CUDA-graph friendly)."""
    args, _, _ = make_case([70, 40], 8, 2, 32, 16, torch.float32, seed=12)
    padded = list(args)
    padded[4] = torch.cat([args[4], torch.full((9,), 10_000, dtype=torch.int32, device=DEV)])
    ref = sparse_decode_reference(*args)
    assert rel_err(sparse_decode_attention(*padded), ref) < 1e-5
    assert rel_err(sparse_decode_reference(*padded), ref) < 1e-5


def test_non_contiguous_slot_layout_raises():
    args, _, _ = make_case([40], 4, 2, 16, 16, torch.float32, seed=1)
    kv = args[1]
    kv_t = kv.transpose(3, 4).contiguous().transpose(3, 4)  # same shape, heads innermost-but-one
    with pytest.raises(ValueError, match="contiguous within a slot"):
        sparse_decode_attention(args[0], kv_t, *args[2:])


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args, _, _ = make_case([40, 70], 4, 2, 16, 16, torch.float32, seed=6)
    args = tuple(a.cpu() if torch.is_tensor(a) else a for a in args)
    assert rel_err(sparse_decode_attention(*args), bruteforce_f64(*args)) < 1e-5


def as_padded(indptr, indices, width, seed):
    """The CSR selection as a [B, width] table: each row's ids shuffled among -1 holes."""
    gen = torch.Generator().manual_seed(seed)
    ptr, ids = indptr.cpu().tolist(), indices.cpu()
    table = torch.full((len(ptr) - 1, width), -1, dtype=torch.int32)
    for b in range(len(ptr) - 1):
        row = ids[ptr[b]:ptr[b + 1]]
        cols = torch.randperm(width, generator=gen)[: len(row)]
        table[b, cols] = row
    return table.to(indices.device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"g{s[1] // s[2]}_bs{s[4]}_d{s[3]}")
@pytest.mark.parametrize("num_splits", [None, 2])
def test_padded_selection_matches_bruteforce(dtype, shape, num_splits):
    """The padded form (ids anywhere in a row, -1 holes) equals the float64 brute force of its CSR form."""
    seq_lens, hq, hkv, d, bs = shape
    args, _, _ = make_case(seq_lens, hq, hkv, d, bs, dtype, seed=hq + d)
    q, kv, tables, indptr, indices, lens, scale = args
    width = max(int((indptr[1:] - indptr[:-1]).max()), 1) + 3
    padded = as_padded(indptr, indices, width, seed=d)
    out = sparse_decode_attention_padded(q, kv, tables, padded, lens, scale, num_splits=num_splits)
    assert rel_err(out, bruteforce_f64(*args)) < TOL[dtype] * 2
    assert rel_err(sparse_decode_attention_padded(q.cpu(), kv.cpu(), tables.cpu(), padded.cpu(), lens.cpu(), scale),
                   bruteforce_f64(*args)) < TOL[dtype] * 2


def test_csr_entries_of_minus_one_are_skipped():
    args, _, _ = make_case([70, 50], 4, 2, 32, 16, torch.float32, seed=3)
    q, kv, tables, indptr, indices, lens, scale = args
    holes = torch.full((len(indices) + 2,), -1, dtype=torch.int32, device=indices.device)
    holes[1:-1] = indices
    shifted = indptr.clone()
    shifted[1:] += 1
    shifted[-1] += 1  # row 0 starts with a hole, row 1 ends with one
    ref = sparse_decode_reference(*args)
    for impl in (sparse_decode_attention, sparse_decode_reference):
        assert rel_err(impl(q, kv, tables, shifted, holes, lens, scale), ref) < TOL[torch.float32]


def test_padded_all_holes_gives_zeros():
    args, _, _ = make_case([40], 4, 2, 32, 16, torch.float32, seed=4)
    q, kv, tables, _, _, lens, scale = args
    padded = torch.full((1, 3), -1, dtype=torch.int32, device=q.device)
    assert (sparse_decode_attention_padded(q, kv, tables, padded, lens, scale) == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [([32, 70, 16], 8, 2, 32, 16), ([47, 16], 4, 4, 16, 16), ([64, 9], 6, 2, 32, 8)],
                         ids=lambda s: f"g{s[1] // s[2]}_bs{s[4]}_d{s[3]}")
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_two_queries_per_sequence(dtype, shape, num_splits):
    """Oasis's x_t (seq_len tokens) and its draft (one more) in one launch: each row equals the float64
    brute force at its own length, and the kernel's x_t rows equal a launch of x_t alone. Lengths with
    seq_len % block_size == 0 put the draft's token in a block x_t must not see at all."""
    lens, hq, hkv, d, bs = shape
    args, _, _ = make_case([n + 1 for n in lens], hq, hkv, d, bs, dtype, seed=hq * d)  # the draft's token too
    _, kv, tables, indptr, indices, _, scale = args
    gen = torch.Generator().manual_seed(d)
    q = torch.randn(2 * len(lens), hq, d, generator=gen).to(dtype).to(DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    width = max(int((indptr[1:] - indptr[:-1]).max()), 1) + 2
    selection = as_padded(indptr, indices, width, seed=hq)
    b = len(lens)
    for impl in (sparse_decode_attention_padded, sparse_decode_padded_reference):
        tuning = {"num_splits": num_splits} if impl is sparse_decode_attention_padded else {}
        out = impl(q, kv, tables, selection, seq_lens, scale, num_queries=2, **tuning)
        assert out.shape == q.shape
        for i in range(2):
            ref = bruteforce_f64(q[i * b:(i + 1) * b], kv, tables, indptr, indices, seq_lens + i, scale)
            assert rel_err(out[i * b:(i + 1) * b], ref) < TOL[dtype] * 2, (impl.__name__, i)
    alone = sparse_decode_attention_padded(q[:b], kv, tables, selection, seq_lens, scale, num_splits=num_splits)
    fused = sparse_decode_attention_padded(q, kv, tables, selection, seq_lens, scale, num_queries=2,
                                           num_splits=num_splits)
    assert torch.equal(fused[:b], alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_table_rows_read_a_larger_table_in_place(dtype, num_splits):
    """With table_rows, sequence b reads row table_rows[b] of a larger table (a working set's slot table):
    the same result as the gathered table, and equal to the float64 brute force."""
    lens = [40, 70, 17]
    args, _, _ = make_case([n + 1 for n in lens], 4, 2, 32, 16, dtype, seed=11)
    _, kv, tables, indptr, indices, _, scale = args
    b, width = len(lens), tables.shape[1]
    rows = torch.tensor([4, 0, 2], dtype=torch.int64, device=DEV)
    big = torch.full((6, width), -1, dtype=torch.int32, device=DEV)  # rows no sequence names stay -1
    big[rows] = tables
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2 * b, 4, 32, generator=gen).to(dtype).to(DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    selection = as_padded(indptr, indices, max(int((indptr[1:] - indptr[:-1]).max()), 1) + 1, seed=3)
    gathered = sparse_decode_attention_padded(q, kv, tables, selection, seq_lens, scale, num_queries=2,
                                              num_splits=num_splits)
    for impl in (sparse_decode_attention_padded, sparse_decode_padded_reference):
        tuning = {"num_splits": num_splits} if impl is sparse_decode_attention_padded else {}
        out = impl(q, kv, big, selection, seq_lens, scale, num_queries=2, table_rows=rows, **tuning)
        for i in range(2):
            ref = bruteforce_f64(q[i * b:(i + 1) * b], kv, tables, indptr, indices, seq_lens + i, scale)
            assert rel_err(out[i * b:(i + 1) * b], ref) < TOL[dtype] * 2, (impl.__name__, i)
    assert torch.equal(sparse_decode_attention_padded(q, kv, big, selection, seq_lens, scale, num_queries=2,
                                                      num_splits=num_splits, table_rows=rows), gathered)
    with pytest.raises(ValueError, match="table_rows"):
        sparse_decode_attention_padded(q, kv, big, selection, seq_lens, scale, num_queries=2, table_rows=rows[:2])


def test_num_queries_must_divide_the_rows():
    args, _, _ = make_case([40], 4, 2, 32, 16, torch.float32, seed=4)
    q, kv, tables, _, _, lens, scale = args
    selection = torch.zeros((1, 2), dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match="num_queries"):
        sparse_decode_attention_padded(torch.cat([q, q, q]), kv, tables, selection, lens, scale, num_queries=2)
    with pytest.raises(ValueError, match="num_queries must be >= 1"):
        sparse_decode_attention_padded(q, kv, tables, selection, lens, scale, num_queries=0)
