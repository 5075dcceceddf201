"""kernels/shortlist_mass.py: the Triton kernel and its torch twin against a float64 brute force."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.shortlist_mass import (fp8_key_copy, listed_mass, shortlist_block_lse,  # noqa: E402
                                            shortlist_block_lse_reference)

from tests.kernel_device import DEV, run_without_interpreter  # noqa: E402

BLOCK = 16


def random_case(batch, hq, hkv, d, width, seed, dtype=torch.float32):
    """A paged pool with shuffled physical blocks, some not on the GPU (-1), sequences of random lengths (partial
    tails), and per row a list of `width` distinct logical blocks below the row's end, some columns -1."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(BLOCK + 1, 12 * BLOCK, (batch,), generator=gen).int()
    max_blocks = 12
    pool = torch.randn(batch * max_blocks + 3, 2, BLOCK, hkv, d, generator=gen).to(dtype)
    tables = torch.randperm(batch * max_blocks + 3, generator=gen)[:batch * max_blocks].view(batch, max_blocks).int()
    listed = torch.full((batch, width), -1, dtype=torch.int32)
    for b in range(batch):
        nblocks = -(-int(lens[b]) // BLOCK)
        n = min(width, int(torch.randint(1, nblocks + 1, (), generator=gen)))
        listed[b, :n] = torch.randperm(nblocks, generator=gen)[:n].int()
        listed[b] = listed[b, torch.randperm(width, generator=gen)]  # -1 columns anywhere
    q = (torch.randn(batch, hq, d, generator=gen) * 2).to(dtype)
    tables[torch.rand(tables.shape, generator=gen) < 0.15] = -1  # not on the GPU (a working set's table)
    return [t.to(DEV) for t in (q, pool, tables, listed, lens)]


def brute_force(q, pool, tables, listed, lens, scale):
    """Straight from the definition, in float64: per row, head and column, log sum exp over the block's keys."""
    batch, hq, d = q.shape
    hkv = pool.shape[3]
    out = torch.full((batch, hq, listed.shape[1]), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for w, logical in enumerate(listed[b].tolist()):
            if logical < 0 or tables[b, logical] < 0:
                continue
            keys = pool[int(tables[b, logical]), 0].double()  # [BLOCK, Hkv, D]
            count = min(BLOCK, int(lens[b]) - logical * BLOCK)
            for h in range(hq):
                logits = keys[:count, h // (hq // hkv)] @ q[b, h].double() * scale
                out[b, h, w] = torch.logsumexp(logits, 0)
    return out


SHAPES = [(3, 4, 2, 8, 5), (2, 6, 3, 8, 7), (4, 2, 2, 16, 3), (1, 8, 1, 12, 4), (2, 4, 2, 8, 12)]  # batch, Hq,
# Hkv, D, width (12: two chunks of 8 columns, the second partly past the list's end)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lse", [shortlist_block_lse, shortlist_block_lse_reference])
def test_block_lse_equals_brute_force(lse, shape):
    q, pool, tables, listed, lens = random_case(*shape, seed=sum(shape))
    got = lse(q, pool, tables, listed, lens, 0.3)
    expect = brute_force(*(t.cpu() for t in (q, pool, tables, listed, lens)), 0.3)
    assert torch.equal(torch.isinf(got.cpu()), torch.isinf(expect))
    finite = torch.isfinite(expect)
    torch.testing.assert_close(got.cpu()[finite].double(), expect[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cols", [1, 2, 4])
def test_block_lse_is_the_same_for_any_chunk_of_columns(cols):
    """Each program scores `cols` listed blocks in one key tile; the split must not change a column's value."""
    case = random_case(2, 6, 3, 8, 7, seed=3)
    expect = shortlist_block_lse_reference(*case, 0.3)
    got = shortlist_block_lse(*case, 0.3, cols=cols)
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    finite = torch.isfinite(expect)
    torch.testing.assert_close(got[finite], expect[finite], atol=1e-4, rtol=1e-5)


def test_block_lse_in_fp16_follows_fp32():
    case = random_case(3, 4, 2, 8, 5, seed=9)
    half = [t.half() if t.is_floating_point() else t for t in case]
    got = shortlist_block_lse(*half, 0.3)
    expect = shortlist_block_lse_reference(*half, 0.3)
    finite = torch.isfinite(expect)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], expect[finite], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("lse", [shortlist_block_lse, shortlist_block_lse_reference])
def test_block_lse_over_fp8_keys_equals_brute_force_on_those_keys(lse, shape):
    """With fp8_keys the keys read are the e4m3 copy times its per-token scales: the brute force over a pool whose
    keys are those values gives the same sums."""
    q, pool, tables, listed, lens = random_case(*shape, seed=sum(shape) + 1)
    keys, scales = fp8_key_copy(pool)
    dequantized = pool.clone()
    dequantized[:, 0] = keys.float() * scales[..., None]
    got = lse(q, pool, tables, listed, lens, 0.3, fp8_keys=(keys, scales))
    expect = brute_force(*(t.cpu() for t in (q, dequantized, tables, listed, lens)), 0.3)
    assert torch.equal(torch.isinf(got.cpu()), torch.isinf(expect))
    finite = torch.isfinite(expect)
    torch.testing.assert_close(got.cpu()[finite].double(), expect[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_block_lse_over_fp8_keys_in_fp16_equals_brute_force_on_fp16_queries(shape):
    """widen_f16: the e4m3 keys (exact in fp16) times the query rounded to fp16, summed in fp32."""
    q, pool, tables, listed, lens = random_case(*shape, seed=sum(shape) + 2)
    keys, scales = fp8_key_copy(pool)
    dequantized = pool.clone()
    dequantized[:, 0] = keys.float() * scales[..., None]
    got = shortlist_block_lse(q, pool, tables, listed, lens, 0.3, fp8_keys=(keys, scales), widen_f16=True)
    expect = brute_force(q.cpu().half().float(), *(t.cpu() for t in (dequantized, tables, listed, lens)), 0.3)
    assert torch.equal(torch.isinf(got.cpu()), torch.isinf(expect))
    finite = torch.isfinite(expect)
    torch.testing.assert_close(got.cpu()[finite].double(), expect[finite], atol=1e-4, rtol=1e-5)


def test_fp8_key_copy_rounds_each_key_within_e4m3():
    pool = random_case(3, 4, 2, 8, 5, seed=2)[1].cpu()
    keys, scales = fp8_key_copy(pool)
    exact = pool[:, 0]
    assert keys.dtype == torch.float8_e4m3fn and keys.shape == exact.shape and scales.shape == exact.shape[:3]
    torch.testing.assert_close(scales, exact.abs().amax(-1) / 448)  # each token's largest |k| maps to 448
    err = (keys.float() * scales[..., None] - exact).abs()
    # half a unit of e4m3's 3 mantissa bits (2^-4 relative), or half its subnormal step (2^-10) x the scale
    assert (err <= exact.abs() * 2.0 ** -4 + scales[..., None] * 2.0 ** -10 + 1e-7).all() and err.max() > 1e-3


def test_listed_mass_is_each_blocks_share_of_a_softmax_over_the_listed_keys():
    q, pool, tables, listed, lens = (t.cpu() for t in random_case(2, 4, 2, 8, 6, seed=5))
    scores = listed_mass(shortlist_block_lse_reference(q, pool, tables, listed, lens, 0.5), kv_heads=2)
    for b in range(2):
        keys, owner = [], []
        for w, logical in enumerate(listed[b].tolist()):
            if logical >= 0 and tables[b, logical] >= 0:
                count = min(BLOCK, int(lens[b]) - logical * BLOCK)
                keys.append(pool[int(tables[b, logical]), 0, :count])
                owner += [w] * count
        keys, owner = torch.cat(keys).double(), torch.tensor(owner)  # [T, Hkv, D]
        for w in range(listed.shape[1]):
            expect = 0.0
            for group in range(2):
                best = 0.0
                for h in (2 * group, 2 * group + 1):
                    probs = (keys[:, group] @ q[b, h].double() * 0.5).softmax(0)
                    best = max(best, float(probs[owner == w].sum()))
                expect += best
            assert float(scores[b, w]) == pytest.approx(expect, abs=1e-5)


def test_rejects_bad_arguments():
    q, pool, tables, listed, lens = random_case(2, 4, 2, 8, 3, seed=1)
    with pytest.raises(ValueError, match="does not fit"):
        shortlist_block_lse(q[:, :3], pool, tables, listed, lens, 1.0)
    with pytest.raises(ValueError, match="listed must be int32"):
        shortlist_block_lse(q, pool, tables, listed.long(), lens, 1.0)
    with pytest.raises(ValueError, match="cols must be a power of two"):
        shortlist_block_lse(q, pool, tables, listed, lens, 1.0, cols=3)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        shortlist_block_lse_reference(q, pool, tables, listed, lens[:1], 1.0)
    keys, scales = fp8_key_copy(pool)
    with pytest.raises(ValueError, match="fp8 keys must be float8_e4m3fn"):
        shortlist_block_lse(q, pool, tables, listed, lens, 1.0, fp8_keys=(keys.float(), scales))
    with pytest.raises(ValueError, match="fp8 key scales must be float32"):
        shortlist_block_lse_reference(q, pool, tables, listed, lens, 1.0, fp8_keys=(keys, scales[:, :1]))


def test_block_lse_kernel_compiles_for_the_h200():
    """The interpreter does not lower the kernel: compile it for sm_90 (Qwen3-8B's group of 4 and head_dim 128,
    SmolLM2's 3 and 64)."""
    run_without_interpreter("from oasiskv.kernels.shortlist_mass import compile_for\n"
                            "assert compile_for(90, 4, 128).asm['cubin']\n"
                            "assert compile_for(90, 3, 64).asm['cubin']\n"
                            "assert compile_for(90, 4, 128, fp8=True).asm['cubin']\n"
                            "assert compile_for(90, 4, 128, fp8=True, widen_f16=True).asm['cubin']\n")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_seq_lens_are_read_as_given(dtype):
    """seq_lens as a strided view (a column of a wider tensor): the kernel read it as contiguous, so a row's keys
    were masked by another row's length; found by a helper's audit of the kernels."""
    q, pool, tables, listed, lens = random_case(3, 4, 2, 8, 5, seed=4, dtype=dtype)
    strided = torch.stack([lens, torch.full_like(lens, BLOCK)], 1)[:, 0]  # the other column: one block of keys
    assert torch.equal(shortlist_block_lse(q, pool, tables, listed, strided, 0.3),
                       shortlist_block_lse(q, pool, tables, listed, lens, 0.3))
