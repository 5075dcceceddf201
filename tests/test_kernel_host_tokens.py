"""Prefill's token-by-token writes into the host store: the Triton kernel (interpreter on the CPU; on a
GPU, compiled and writing pinned memory) against the torch reference, bit for bit."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.host_tokens import store_tokens_to_host, store_tokens_to_host_reference  # noqa: E402

from tests.kernel_device import DEV, ON_GPU  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def host_store(layers, blocks, bs, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, blocks, 2, bs, hkv, d, generator=gen).to(dtype)  # old contents must survive
    return kv.pin_memory() if ON_GPU else kv


def tokens(t, hkv, d, dtype, seed, extra_rows=0):
    """k, v [t, hkv, d] as views of a wider projection output (token stride > hkv * d)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, 3 * hkv * d + extra_rows, generator=gen).to(dtype).to(DEV)
    k = wide[:, :hkv * d].view(t, hkv, d)
    v = wide[:, hkv * d:2 * hkv * d].view(t, hkv, d)
    return k, v


def destinations(t, blocks, bs, seed, index_dtype):
    """t distinct (block, offset) pairs, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randperm(blocks * bs, generator=gen)[:t]
    return (flat // bs).to(index_dtype).to(DEV), (flat % bs).to(index_dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [0, 1, 5, 37])
@pytest.mark.parametrize("hkv,d", [(2, 16), (1, 96), (4, 32)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_kernel_equals_reference_bit_for_bit(dtype, t, hkv, d, index_dtype):
    layers, blocks, bs = 3, 6, 8
    host = host_store(layers, blocks, bs, hkv, d, dtype, seed=t + d)
    expected = host.clone()
    k, v = tokens(t, hkv, d, dtype, seed=hkv * d)
    where = destinations(t, blocks, bs, seed=t, index_dtype=index_dtype)
    store_tokens_to_host(k, v, host, 1, *where)
    if ON_GPU:
        torch.cuda.synchronize()
    store_tokens_to_host_reference(k, v, expected, 1, *where)
    assert torch.equal(host.view(torch.uint8), expected.view(torch.uint8))


def test_a_prefill_chunk_fills_blocks_in_order():
    """The engine's case: consecutive tokens from a block boundary, then a partial block; other layers
    and the partial block's later slots keep their contents."""
    bs, hkv, d = 4, 2, 16
    host = host_store(2, 5, bs, hkv, d, torch.float32, seed=1)
    before = host.clone()
    k, v = tokens(6, hkv, d, torch.float32, seed=2)
    blocks = torch.tensor([3, 3, 3, 3, 0, 0], device=DEV)
    offsets = torch.tensor([0, 1, 2, 3, 0, 1], device=DEV)
    store_tokens_to_host(k, v, host, 0, blocks, offsets)
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.equal(host[0, 3, 0], k[:4].cpu()) and torch.equal(host[0, 3, 1], v[:4].cpu())
    assert torch.equal(host[0, 0, 0, :2], k[4:].cpu()) and torch.equal(host[0, 0, 1, :2], v[4:].cpu())
    assert torch.equal(host[0, 0, :, 2:], before[0, 0, :, 2:])
    assert torch.equal(host[1], before[1]) and torch.equal(host[0, [1, 2, 4]], before[0, [1, 2, 4]])


def test_bad_inputs_raise():
    host = host_store(2, 3, 4, 2, 16, torch.float32, seed=0)
    k, v = tokens(3, 2, 16, torch.float32, seed=0)
    blocks, offsets = destinations(3, 3, 4, seed=0, index_dtype=torch.int64)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        store_tokens_to_host(k, v, host, 2, blocks, offsets)
    with pytest.raises(ValueError, match="must be \\[T, 2, 16\\]"):
        store_tokens_to_host(k.reshape(3, 1, 32), v, host, 0, blocks, offsets)
    with pytest.raises(ValueError, match="float16"):
        store_tokens_to_host(k.half(), v.half(), host, 0, blocks, offsets)
    with pytest.raises(ValueError, match="contiguous"):
        store_tokens_to_host(k.transpose(1, 2).contiguous().transpose(1, 2), v, host, 0, blocks, offsets)
    with pytest.raises(ValueError, match="blocks must be"):
        store_tokens_to_host(k, v, host, 0, blocks[:2], offsets)
    with pytest.raises(ValueError, match="host_kv must be"):
        store_tokens_to_host(k, v, host[0], 0, blocks, offsets)


@pytest.mark.parametrize("change, message", [
    (("blocks", 3), r"blocks must be in \[0, 3\)"),
    (("blocks", -1), r"blocks must be in \[0, 3\)"),
    (("offsets", 4), r"offsets must be in \[0, 4\)"),
    (("offsets", -1), r"offsets must be in \[0, 4\)")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_values_out_of_range_are_clear_errors_on_the_cpu(change, message, dtype):
    """The kernel writes where blocks and offsets point: out of range it wrote another layer's block or before the
    store, silently (the twin wrapped -1 to the last block); found by a helper's audit of the kernels."""
    host = torch.randn(2, 3, 2, 4, 2, 16).to(dtype)
    before = host.clone()
    k, v = (torch.randn(3, 2, 16).to(dtype) for _ in range(2))
    where = {"blocks": torch.tensor([0, 1, 2]), "offsets": torch.tensor([3, 0, 1])}
    where[change[0]][1] = change[1]
    with pytest.raises(ValueError, match=message):
        store_tokens_to_host(k, v, host, 0, where["blocks"], where["offsets"])
    assert torch.equal(host, before)


@pytest.mark.parametrize("strided", ["blocks", "offsets"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_strided_destinations_are_read_as_given(strided, dtype, index_dtype):
    """blocks and offsets as strided views (a column of a wider index tensor): the kernel read them as contiguous,
    so tokens went to the wrong places; found by a helper's audit of the kernels."""
    host = host_store(2, 6, 8, 2, 16, dtype, seed=3)
    expected = host.clone()
    k, v = tokens(5, 2, 16, dtype, seed=4)
    where = list(destinations(5, 6, 8, seed=5, index_dtype=index_dtype))
    i = ("blocks", "offsets").index(strided)
    where[i] = torch.stack([where[i], where[i].flip(0)], 1)[:, 0]  # stride 2: the other column is another order
    store_tokens_to_host(k, v, host, 1, *where)
    if ON_GPU:
        torch.cuda.synchronize()
    store_tokens_to_host_reference(k, v, expected, 1, *(w.contiguous() for w in where))
    assert torch.equal(host.view(torch.uint8), expected.view(torch.uint8))
