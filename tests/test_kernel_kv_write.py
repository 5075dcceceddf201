"""kernels/kv_write.py: the Triton kernel (interpreted on the CPU) writes a step's K and V where torch's two index_put
writes do, into one layer of a pool shaped as the engine's, leaving every other slot as it was."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.kv_write import write_kv_reference, write_kv_slots  # noqa: E402

from tests.kernel_device import DEV  # noqa: E402


def make(tokens, blocks, block_size, heads, head_dim, dtype, seed):
    """A 3-layer pool (its layer 1 is a view, as KVPool.layer gives), distinct random slots, and K/V."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(3, blocks, 2, block_size, heads, head_dim, generator=gen).to(dtype).to(DEV)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    k = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(DEV)
    v = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(DEV)
    return pool, (slots // block_size).to(DEV), (slots % block_size).to(DEV), k, v


@pytest.mark.parametrize("tokens, blocks, block_size, heads, head_dim", [
    (1, 4, 16, 1, 64), (37, 8, 16, 3, 64), (100, 10, 16, 8, 128), (5, 2, 4, 2, 96)])  # 96: rows not a power of 2
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_writes_what_index_put_writes(tokens, blocks, block_size, heads, head_dim, dtype):
    pool, sb, so, k, v = make(tokens, blocks, block_size, heads, head_dim, dtype, seed=tokens + heads)
    expected = pool.clone()
    write_kv_reference(expected[1], sb, so, k, v)
    write_kv_slots(pool[1], sb, so, k, v)
    assert torch.equal(pool, expected)
    assert torch.equal(pool[1][sb, 0, so], k) and torch.equal(pool[1][sb, 1, so], v)


def test_k_v_as_views_of_wider_rows():
    """k and v with a token stride wider than their rows (slices of a larger tensor)."""
    pool, sb, so, k, v = make(9, 4, 16, 2, 64, torch.float32, seed=3)
    wide = torch.randn(9, 3, 2, 64, device=DEV)
    expected = pool.clone()
    write_kv_reference(expected[0], sb, so, wide[:, 0], wide[:, 2])
    write_kv_slots(pool[0], sb, so, wide[:, 0], wide[:, 2])
    assert torch.equal(pool, expected)


def test_no_tokens():
    pool, sb, so, k, v = make(0, 2, 16, 2, 64, torch.float32, seed=4)
    before = pool.clone()
    write_kv_slots(pool[0], sb, so, k, v)
    assert torch.equal(pool, before)


def test_bad_inputs_raise():
    pool, sb, so, k, v = make(4, 2, 16, 2, 64, torch.float32, seed=5)
    with pytest.raises(ValueError, match="kv_layer must be"):
        write_kv_slots(pool, sb, so, k, v)
    with pytest.raises(ValueError, match="k and v must be"):
        write_kv_slots(pool[0], sb, so, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="one per token"):
        write_kv_slots(pool[0], sb[:3], so, k, v)
    with pytest.raises(ValueError, match="int64"):
        write_kv_slots(pool[0], sb.int(), so.int(), k, v)
    with pytest.raises(ValueError, match="pool's"):
        write_kv_slots(pool[0], sb, so, k.half(), v.half())
    with pytest.raises(ValueError, match="contiguous over"):
        write_kv_slots(pool[0], sb, so, k.transpose(1, 2).contiguous().transpose(1, 2), v)


@pytest.mark.parametrize("strided", ["slot_blocks", "slot_offsets"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_slots_are_read_as_given(strided, dtype):
    """slot_blocks or slot_offsets as a strided view (a column of a wider tensor): the kernel read them as contiguous,
    so tokens went to the wrong slots; found by a helper's audit of the kernels."""
    pool, sb, so, k, v = make(6, 4, 8, 2, 16, dtype, seed=7)
    expected = pool.clone()
    write_kv_reference(expected[1], sb, so, k, v)
    slots = {"slot_blocks": sb, "slot_offsets": so}
    slots[strided] = torch.stack([slots[strided], slots[strided].flip(0)], 1)[:, 0]
    write_kv_slots(pool[1], slots["slot_blocks"], slots["slot_offsets"], k, v)
    assert torch.equal(pool, expected)
