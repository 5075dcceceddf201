"""Dense paged decode attention: Triton kernel vs torch reference vs brute force.

The kernel runs on the CPU under TRITON_INTERPRET=1, which must be set before triton is
imported, hence the environment line above the imports. On a GPU machine, run with
TRITON_INTERPRET=0 to test the compiled kernel. Shapes are small: the
interpreter is slow. bf16 is not tested here (the interpreter gives garbage for it);
the GPU benchmark checks bf16.
"""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from oasiskv.kernels.paged_decode import (  # noqa: E402
    INTERPRETED,
    choose_partition,
    paged_decode_attention,
    paged_decode_reference,
    scratch_bytes,
)

from tests.kernel_device import DEV, ON_GPU  # noqa: E402

# On the CPU the kernels run only if this module set TRITON_INTERPRET before anything imported them.
needs_kernel = pytest.mark.skipif(
    not (ON_GPU or INTERPRETED),
    reason="Triton kernel on CPU needs TRITON_INTERPRET=1 before oasiskv.kernels.paged_decode is imported",
)


def make_case(seq_lens, q_heads, kv_heads, head_dim, dtype, block_size=16, extra_blocks=5, seed=0, layers=1, layer=0,
              device="cpu"):
    """Random q and paged KV with shuffled physical blocks; unused table entries are -1."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_needed) + 1  # at least one unused (garbage) entry per row
    num_blocks = sum(blocks_needed) + extra_blocks
    pool = torch.randn(layers, num_blocks, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    kv_layer = pool.to(device)[layer]  # a view of the pool on the device: the kernel sees its strides
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_needed):
        block_tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(batch, q_heads, head_dim, generator=gen).to(dtype)
    return q.to(device), kv_layer, block_tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def brute_force(q, kv_layer, block_tables, seq_lens, scale):
    """Independent float64 computation: contiguous K/V per sequence, SDPA with GQA expansion."""
    batch, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    group = q_heads // kv_heads
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        blocks = [int(block_tables[b, j]) for j in range(math.ceil(n / block_size))]
        k = torch.cat([kv_layer[p, 0] for p in blocks])[:n].double()  # [n, Hkv, D]
        v = torch.cat([kv_layer[p, 1] for p in blocks])[:n].double()
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, n, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        qb = q[b].double()[:, None, :]  # [Hq, 1, D]
        out[b] = F.scaled_dot_product_attention(qb, k, v, scale=scale)[:, 0]
    return out


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=1e-2)}

# (seq_lens, q_heads, kv_heads, head_dim, partition_size) -- partition None = launcher policy
CASES = [
    pytest.param([1], 4, 4, 16, None, id="g1-d16-len1"),
    pytest.param([16, 1, 37], 8, 8, 64, None, id="g1-d64-blockmult-len1-ragged"),
    pytest.param([33, 64, 7], 6, 2, 32, 32, id="g3-d32-splits"),
    pytest.param([48, 5], 12, 4, 128, None, id="g3-d128-ragged"),
    pytest.param([32, 130], 8, 2, 64, 48, id="g4-d64-unaligned-partition"),
    pytest.param([200, 16, 75], 8, 2, 128, 64, id="g4-d128-several-splits"),
    pytest.param([300], 4, 1, 32, None, id="g4-d32-default-policy-splits"),
]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("seq_lens,q_heads,kv_heads,head_dim,partition_size", CASES)
def test_kernel_matches_reference(seq_lens, q_heads, kv_heads, head_dim, partition_size, dtype):
    q, kv_layer, block_tables, lens = make_case(seq_lens, q_heads, kv_heads, head_dim, dtype, device=DEV)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, kv_layer, block_tables, lens, scale, partition_size=partition_size).cpu()
    ref = paged_decode_reference(q.cpu(), kv_layer.cpu(), block_tables.cpu(), lens.cpu(), scale)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("seq_lens,q_heads,kv_heads,head_dim,partition_size", CASES)
def test_reference_matches_brute_force(seq_lens, q_heads, kv_heads, head_dim, partition_size, dtype):
    q, kv_layer, block_tables, lens = make_case(seq_lens, q_heads, kv_heads, head_dim, dtype, seed=1)
    scale = head_dim**-0.5
    ref = paged_decode_reference(q, kv_layer, block_tables, lens, scale)
    expected = brute_force(q, kv_layer, block_tables, lens, scale)
    # The reference rounds its fp32 result to q's dtype only at the end.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(ref.double(), expected, **tol)


@needs_kernel
def test_kernel_strided_views_and_out():
    """A non-first layer view of a multi-layer pool, a non-contiguous q and a given non-contiguous out."""
    q_full, kv_layer, block_tables, lens = make_case([40, 17], 8, 2, 32, torch.float32, layers=3, layer=1, device=DEV)
    q_big = torch.randn(2, 8, 64).to(DEV)
    q_big[:, :, :32] = q_full
    q = q_big[:, :, :32]
    assert not q.is_contiguous()
    out_big = torch.zeros(2, 8, 48, device=DEV)
    out = out_big[:, :, 8:40]
    scale = 0.2
    res = paged_decode_attention(q, kv_layer, block_tables, lens, scale, out, partition_size=16)
    assert res.data_ptr() == out.data_ptr()
    ref = paged_decode_reference(q.cpu(), kv_layer.cpu(), block_tables.cpu(), lens.cpu(), scale)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=2e-5)
    assert out_big[:, :, :8].abs().max() == 0 and out_big[:, :, 40:].abs().max() == 0


@needs_kernel
def test_kernel_max_seq_len_hint_too_small_is_still_correct():
    q, kv_layer, block_tables, lens = make_case([90, 3], 4, 2, 16, torch.float32, device=DEV)
    out = paged_decode_attention(q, kv_layer, block_tables, lens, 0.25, max_seq_len=20, partition_size=16).cpu()
    ref = paged_decode_reference(q.cpu(), kv_layer.cpu(), block_tables.cpu(), lens.cpu(), 0.25)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_choose_partition_fills_the_gpu():
    # Qwen3-8B, 16K context: every launch gives at least 3 programs per SM on 132 SMs.
    for batch in (1, 8, 32):
        part, splits = choose_partition(batch, 8, 16384, 132)
        assert part % 64 == 0 and splits == math.ceil(16384 / part)
        assert batch * 8 * splits >= 3 * 132
    # Short sequences: one split, no reduce pass, no scratch.
    part, splits = choose_partition(64, 8, 100, 132)
    assert splits == 1 and scratch_bytes(64, 32, 128, splits) == 0
    # Very long context: the split count stays bounded.
    assert choose_partition(1, 8, 1 << 20, 132)[1] <= 256


def _bad(**overrides):
    # CPU is enough on every machine: the argument checks run before any device dispatch
    q, kv_layer, block_tables, lens = make_case([20, 5], 8, 2, 16, torch.float32)
    args = dict(q=q, kv_layer=kv_layer, block_tables=block_tables, seq_lens=lens, scale=0.25)
    args.update(overrides)
    return args


@pytest.mark.parametrize("fn", [paged_decode_attention, paged_decode_reference], ids=["kernel", "reference"])
@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(q=torch.zeros(2, 8, 16, 1)), "q must be a 3-D tensor"),
        (dict(q=torch.zeros(2, 8, 16, dtype=torch.float64)), "q dtype"),
        (dict(q=torch.zeros(2, 8, 16, dtype=torch.float16)), "kv_layer dtype"),
        (dict(q=torch.zeros(2, 8, 32)), "head_dim mismatch"),
        (dict(q=torch.zeros(2, 7, 16)), "multiple of kv_heads"),
        (dict(kv_layer=torch.zeros(4, 3, 16, 2, 16)), "kv_layer must be"),
        (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), "block_tables must be"),
        (dict(block_tables=torch.zeros(2, 4, dtype=torch.int64)), "block_tables must be int32"),
        (dict(seq_lens=torch.tensor([20, 5])), "seq_lens must be int32"),
        (dict(seq_lens=torch.tensor([20], dtype=torch.int32)), "seq_lens must be"),
        (dict(out=torch.zeros(2, 8, 8)), "out must have"),
        (dict(out=torch.zeros(2, 8, 16, dtype=torch.float16)), "out dtype"),
    ],
)
def test_bad_inputs_raise_value_error(fn, overrides, message):
    with pytest.raises(ValueError, match=message):
        fn(**_bad(**overrides))


def test_reference_rejects_seq_len_beyond_table():
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_reference(**_bad(seq_lens=torch.tensor([20, 10_000], dtype=torch.int32)))
