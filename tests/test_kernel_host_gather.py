"""Host <-> GPU block copies: the Triton copy kernel against the torch reference.

On a CPU machine the kernel runs under TRITON_INTERPRET=1 on CPU tensors. On a GPU machine, run with
TRITON_INTERPRET=0 to exercise the real zero-copy path (pinned host store, CUDA pool)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.host_gather import (  # noqa: E402
    gather_host_blocks,
    gather_host_blocks_reference,
    store_blocks_to_host,
    store_blocks_to_host_reference,
)

from tests.kernel_device import DEV, ON_GPU  # noqa: E402
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _host(shape, dtype, gen):
    t = torch.randn(shape, generator=gen).to(dtype)
    return t.pin_memory() if ON_GPU else t


def _lists(gen, n, layers, src_n, dst_n):
    """n distinct (layer, dst) pairs, distinct (layer, src) pairs, random order."""
    pairs_dst = torch.randperm(layers * dst_n, generator=gen)[:n]
    layer = pairs_dst // dst_n
    dst = pairs_dst % dst_n
    src = torch.empty_like(dst)
    for l in range(layers):  # distinct sources within a layer too
        m = layer == l
        src[m] = torch.randperm(src_n, generator=gen)[: int(m.sum())]
    return [x.to(torch.int32) for x in (layer, src, dst)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers,block_size,hkv,d,n", [
    (3, 16, 2, 32, 10),   # chunk 4096 elements, one tile per chunk
    (2, 4, 3, 20, 7),     # odd chunk (480 elements): masked tail tile
    (4, 16, 1, 8, 1),     # a single chunk
])
def test_gather_matches_reference(dtype, layers, block_size, hkv, d, n):
    gen = torch.Generator().manual_seed(layers * 1000 + n)
    host_blocks, slots = 13, 9
    host = _host((layers, host_blocks, 2, block_size, hkv, d), dtype, gen)
    poison = torch.full((layers, slots, 2, block_size, hkv, d), -7.0, dtype=dtype)
    layer_ids, src, dst = _lists(gen, n, layers, host_blocks, slots)

    want = gather_host_blocks_reference(host.cpu(), poison.clone(), layer_ids, src, dst)
    got = gather_host_blocks(host, poison.clone().to(DEV), layer_ids.to(DEV), src.to(DEV), dst.to(DEV))
    if ON_GPU:
        torch.cuda.synchronize()
    got = got.cpu()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # untouched slots stay poisoned, touched ones hold exactly the source chunk
    touched = torch.zeros(layers, slots, dtype=torch.bool)
    touched[layer_ids.long(), dst.long()] = True
    assert (got[~touched] == -7.0).all()
    for i in range(n):
        assert torch.equal(got[layer_ids[i], dst[i]], host.cpu()[layer_ids[i], src[i]])


def test_gather_splits_and_tiles_agree():
    """The same copy with several programs per chunk and smaller tiles."""
    gen = torch.Generator().manual_seed(5)
    host = _host((2, 8, 2, 8, 2, 16), torch.float32, gen)  # chunk 512 words
    layer_ids, src, dst = _lists(gen, 6, 2, 8, 6)
    want = gather_host_blocks_reference(host.cpu(), torch.zeros(2, 6, 2, 8, 2, 16), layer_ids, src, dst)
    for tile, splits, programs in ((128, 1, None), (128, 3, None), (256, 2, None), (512, 1, None), (128, 1, 1),
                                   (256, 2, 4), (512, None, 5), (512, None, 64)):
        got = torch.zeros((2, 6, 2, 8, 2, 16), device=DEV)
        gather_host_blocks(host, got, layer_ids.to(DEV), src.to(DEV), dst.to(DEV),
                           tile=tile, splits=splits, programs=programs)  # programs: fewer programs, looping
        assert torch.equal(got.cpu(), want), (tile, splits, programs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_matches_reference(dtype):
    gen = torch.Generator().manual_seed(11)
    layers, slots, host_blocks = 3, 6, 10
    shape = (2, 16, 2, 16)
    gpu = torch.randn((layers, slots, *shape), generator=gen).to(dtype).to(DEV)
    host = _host((layers, host_blocks, *shape), dtype, gen)
    host.fill_(3.0)
    layer_ids, src, dst = _lists(gen, 8, layers, slots, host_blocks)

    want = store_blocks_to_host_reference(gpu.cpu(), host.cpu().clone(), layer_ids, src, dst)
    store_blocks_to_host(gpu, host, layer_ids.to(DEV), src.to(DEV), dst.to(DEV))
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.equal(host.cpu(), want)
    touched = torch.zeros(layers, host_blocks, dtype=torch.bool)
    touched[layer_ids.long(), dst.long()] = True
    assert (host.cpu()[~touched] == 3.0).all()


def test_round_trip():
    """store then gather returns the same bytes into other slots."""
    gen = torch.Generator().manual_seed(3)
    gpu = torch.randn((2, 5, 2, 4, 2, 8), generator=gen).to(torch.float16).to(DEV)
    host = _host((2, 7, 2, 4, 2, 8), torch.float16, gen)
    layer_ids = torch.tensor([0, 1, 1], dtype=torch.int32)
    store_blocks_to_host(gpu, host, layer_ids.to(DEV), torch.tensor([0, 1, 2], dtype=torch.int32).to(DEV),
                         torch.tensor([6, 0, 3], dtype=torch.int32).to(DEV))
    gather_host_blocks(host, gpu, layer_ids.to(DEV), torch.tensor([6, 0, 3], dtype=torch.int32).to(DEV),
                       torch.tensor([4, 3, 4], dtype=torch.int32).to(DEV))
    g = gpu.cpu()
    assert torch.equal(g[0, 4], g[0, 0]) and torch.equal(g[1, 3], g[1, 1]) and torch.equal(g[1, 4], g[1, 2])


def test_empty_list_is_noop():
    host = torch.ones(1, 2, 2, 4, 1, 4)
    gpu = torch.zeros(1, 2, 2, 4, 1, 4, device=DEV)
    e = torch.empty(0, dtype=torch.int32, device=DEV)
    gather_host_blocks(host, gpu, e, e, e)
    assert (gpu == 0).all()


def test_reference_without_interpreter(monkeypatch):
    """The plain CPU path (no interpreter) uses the torch reference and agrees with it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(9)
    host = torch.randn((2, 4, 2, 4, 2, 8), generator=gen)
    gpu = torch.zeros((2, 3, 2, 4, 2, 8))
    layer_ids, src, dst = _lists(gen, 4, 2, 4, 3)
    gather_host_blocks(host, gpu, layer_ids, src, dst)
    for i in range(4):
        assert torch.equal(gpu[layer_ids[i], dst[i]], host[layer_ids[i], src[i]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_entries_marked_minus_one_are_skipped(dtype):
    gen = torch.Generator().manual_seed(5)
    host = _host((2, 6, 2, 16, 2, 8), dtype, gen)
    layer_ids = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    src = torch.tensor([3, -1, 5, 2], dtype=torch.int32)
    dst = torch.tensor([1, 0, -1, 2], dtype=torch.int32)
    poison = torch.full((2, 4, 2, 16, 2, 8), -7.0, dtype=dtype)
    got = gather_host_blocks(host, poison.clone().to(DEV), layer_ids.to(DEV), src.to(DEV), dst.to(DEV)).cpu()
    want = poison.clone()  # brute force: only entries 0 and 3 copy
    want[0, 1], want[0, 2] = host.cpu()[0, 3], host.cpu()[0, 2]
    assert torch.equal(got, want)
    assert torch.equal(gather_host_blocks_reference(host.cpu(), poison.clone(), layer_ids, src, dst), want)


def test_mismatches_raise():
    host = torch.zeros(2, 4, 2, 16, 2, 8)
    gpu = torch.zeros(2, 3, 2, 16, 2, 8)
    i1 = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype"):
        gather_host_blocks(host, gpu.half(), i1, i1, i1)
    with pytest.raises(ValueError, match="shape"):
        gather_host_blocks(host, torch.zeros(2, 3, 2, 16, 4, 8), i1, i1, i1)
    with pytest.raises(ValueError, match="shape"):
        gather_host_blocks(host, torch.zeros(3, 3, 2, 16, 2, 8), i1, i1, i1)
    with pytest.raises(ValueError, match="layers, blocks"):
        gather_host_blocks(host[0], gpu, i1, i1, i1)
    with pytest.raises(ValueError, match="int32"):
        gather_host_blocks(host, gpu, i1.long(), i1, i1)
    with pytest.raises(ValueError, match="length"):
        gather_host_blocks(host, gpu, i1, i1, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="out of range"):
        gather_host_blocks(host, gpu, i1, i1, torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        gather_host_blocks(host.transpose(4, 5), gpu.transpose(4, 5), i1, i1, i1)
    with pytest.raises(ValueError, match="dtype"):
        store_blocks_to_host(gpu, host.double(), i1, i1, i1)


@pytest.mark.parametrize("direction", ["gather", "store"])
@pytest.mark.parametrize("strided", [0, 1, 2], ids=["layer_ids", "src", "dst"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_index_lists_are_read_as_given(direction, strided, dtype):
    """An index list as a strided view (a column of a wider tensor): the kernel read it as contiguous, so chunks
    came from or went to the wrong blocks; found by a helper's audit of the kernels."""
    gen = torch.Generator().manual_seed(21 + strided)
    layers, host_blocks, slots = 2, 7, 5
    host = _host((layers, host_blocks, 2, 4, 2, 8), dtype, gen)
    gpu = torch.randn((layers, slots, 2, 4, 2, 8), generator=gen).to(dtype)
    src_n, dst_n = (host_blocks, slots) if direction == "gather" else (slots, host_blocks)
    lists = _lists(gen, 4, layers, src_n, dst_n)
    sizes = (layers, src_n, dst_n)
    other = (lists[strided] + 1) % sizes[strided]  # in range, in the other column: what a contiguous read took
    views = list(lists)
    views[strided] = torch.stack([lists[strided], other], 1)[:, 0]
    if direction == "gather":
        want = gather_host_blocks_reference(host.cpu(), gpu.clone(), *lists)
        got = gather_host_blocks(host, gpu.clone().to(DEV), *(t.to(DEV) for t in views))
    else:
        want = store_blocks_to_host_reference(gpu.clone(), host.cpu().clone(), *lists)
        got = store_blocks_to_host(gpu.to(DEV), host.clone(), *(t.to(DEV) for t in views))
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
