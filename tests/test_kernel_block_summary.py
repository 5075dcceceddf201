import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from oasiskv.kernels import block_summary
from oasiskv.kernels.block_summary import update_block_summaries, update_block_summaries_reference

from tests.kernel_device import DEV, INTERPRETED, ON_GPU  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])  # bf16: garbage when interpreted


def _kv_layer(num_blocks, block_size, hkv, d, dtype, strided, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if strided:
        # heads before tokens in memory, and a layer view out of a 2-layer pool: exercises strides.
        pool = torch.randn(2, num_blocks, 2, hkv, block_size, d, generator=g).to(dtype).to(device)
        return pool[1].permute(0, 1, 3, 2, 4)
    return torch.randn(num_blocks, 2, block_size, hkv, d, generator=g).to(dtype).to(device)


def _brute_force(kv_layer, block_ids, num_tokens):
    """Independent per-block loop in float64: {block_id: (min [Hkv, D], max [Hkv, D])}."""
    out = {}
    for blk, n in zip(block_ids.tolist(), num_tokens.tolist()):
        keys = kv_layer[blk, 0, :n].double()  # [n, Hkv, D]
        out[blk] = (keys.min(dim=0).values, keys.max(dim=0).values)
    return out


@pytest.mark.skipif(not INTERPRETED, reason="checks that the interpreter runs the kernel on the CPU")
def test_kernel_is_interpreted():
    # Guard: otherwise the launcher silently falls back to the reference and tests nothing.
    assert block_summary._triton_runs(torch.device("cpu"))


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("sum_dtype", [torch.float32, "same"])
@pytest.mark.parametrize(
    "block_size,hkv,d,strided",
    [(16, 2, 64, False), (16, 3, 40, True), (8, 1, 128, True)],
)
def test_prefill_matches_reference_and_brute_force(kv_dtype, sum_dtype, block_size, hkv, d, strided):
    sum_dtype = kv_dtype if sum_dtype == "same" else sum_dtype
    num_blocks = 12
    kv = _kv_layer(num_blocks, block_size, hkv, d, kv_dtype, strided, device=DEV)
    # a prefill: 5 full blocks and a partial tail, physical ids scattered
    block_ids = torch.tensor([7, 2, 9, 0, 11, 4], dtype=torch.int32)
    num_tokens = torch.tensor([block_size] * 5 + [3], dtype=torch.int32)
    init = torch.full((num_blocks, 2, hkv, d), 123.0).to(sum_dtype)

    got = update_block_summaries(init.clone().to(DEV), kv, block_ids.to(DEV), num_tokens.to(DEV)).cpu()
    kv = kv.cpu()
    ref = update_block_summaries_reference(init.clone(), kv, block_ids, num_tokens)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)

    for blk, (mn, mx) in _brute_force(kv, block_ids, num_tokens).items():
        assert torch.equal(got[blk, 0].double(), mn.to(sum_dtype).double())
        assert torch.equal(got[blk, 1].double(), mx.to(sum_dtype).double())
    untouched = [i for i in range(num_blocks) if i not in block_ids.tolist()]
    assert torch.equal(got[untouched], init[untouched])


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_decode_append_recomputes_tail(kv_dtype):
    block_size, hkv, d = 16, 2, 32
    kv = torch.zeros(4, 2, block_size, hkv, d, dtype=kv_dtype, device=DEV)
    # reused block: stale large keys beyond the fill must not leak into the summary
    kv[3, 0] = 100.0
    summaries = torch.zeros(4, 2, hkv, d, dtype=torch.float32, device=DEV)
    g = torch.Generator().manual_seed(1)
    tail = torch.tensor([3], dtype=torch.int32, device=DEV)
    for t in range(block_size):
        kv[3, :, t] = torch.randn(2, hkv, d, generator=g).to(kv_dtype).to(DEV)
        n = torch.tensor([t + 1], dtype=torch.int32, device=DEV)
        update_block_summaries(summaries, kv, tail, n)
        keys = kv[3, 0, : t + 1].float()
        assert torch.equal(summaries[3, 0], keys.amin(dim=0))
        assert torch.equal(summaries[3, 1], keys.amax(dim=0))


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True])
def test_first_token_summarises_a_blocks_last_part(kv_dtype, strided):
    """Sub-block summaries: keys first_token .. num_tokens-1 of each block, against a brute force."""
    block_size, hkv, d = 16, 3, 24
    kv = _kv_layer(6, block_size, hkv, d, kv_dtype, strided, seed=2, device=DEV)
    blocks = torch.tensor([4, 1, 5, 0], dtype=torch.int32)
    first = torch.tensor([0, 4, 12, 8], dtype=torch.int32)
    n = torch.tensor([3, 8, 16, 9], dtype=torch.int32)
    rows = torch.tensor([2, 7, 0, 5], dtype=torch.int32)
    init = torch.full((8, 2, hkv, d), 7.0)
    args = (kv, blocks.to(DEV), n.to(DEV))
    got = update_block_summaries(init.clone().to(DEV), *args, summary_ids=rows.to(DEV), first_token=first.to(DEV)).cpu()
    ref = update_block_summaries_reference(init.clone(), kv.cpu(), blocks, n, summary_ids=rows, first_token=first)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for blk, f, m, row in zip(blocks.tolist(), first.tolist(), n.tolist(), rows.tolist()):
        keys = kv.cpu()[blk, 0, f:m].float()
        assert torch.equal(got[row, 0], keys.amin(0)) and torch.equal(got[row, 1], keys.amax(0))
    untouched = [i for i in range(8) if i not in rows.tolist()]
    assert torch.equal(got[untouched], init[untouched])


def test_summary_ids_and_layer_view():
    block_size, hkv, d = 16, 2, 16
    kv = _kv_layer(6, block_size, hkv, d, torch.float32, strided=False, device=DEV)
    all_layers = torch.zeros(3, 10, 2, hkv, d, device=DEV)
    summaries = all_layers[1]  # per-layer view of the [layers, blocks, 2, Hkv, D] tensor
    slots = torch.tensor([5, 0], dtype=torch.int32, device=DEV)
    rows = torch.tensor([8, 3], dtype=torch.int32, device=DEV)
    n = torch.tensor([16, 7], dtype=torch.int32, device=DEV)
    update_block_summaries(summaries, kv, slots, n, summary_ids=rows)
    assert torch.equal(all_layers[1, 8, 0], kv[5, 0].amin(dim=0))
    assert torch.equal(all_layers[1, 3, 1], kv[0, 0, :7].amax(dim=0))
    assert all_layers[0].abs().sum() == 0 and all_layers[2].abs().sum() == 0
    assert all_layers[1, [0, 1, 2, 4, 5, 6, 7, 9]].abs().sum() == 0


def test_empty_list_is_noop():
    kv = _kv_layer(2, 16, 1, 8, torch.float32, strided=False, device=DEV)
    s = torch.zeros(2, 2, 1, 8, device=DEV)
    empty = torch.zeros(0, dtype=torch.int32, device=DEV)
    update_block_summaries(s, kv, empty, empty)
    assert s.abs().sum() == 0


@pytest.mark.parametrize("fn", [update_block_summaries, update_block_summaries_reference])
def test_bad_arguments_raise(fn):
    # CPU on purpose: value checks run by default on CPU tensors only (a sync on CUDA)
    kv = _kv_layer(4, 16, 2, 8, torch.float32, strided=False)
    s = torch.zeros(4, 2, 2, 8)
    ids = torch.tensor([1], dtype=torch.int32)
    n = torch.tensor([16], dtype=torch.int32)
    cases = [
        (torch.zeros(4, 2, 2, 9), kv, ids, n, "does not match"),
        (torch.zeros(4, 3, 2, 8), kv, ids, n, "summaries must be"),
        (s, kv[:, 0], ids, n, "kv_layer must be"),
        (s.int(), kv, ids, n, "dtype"),
        (s, kv, ids.long(), n, "int32"),
        (s, kv, ids, torch.tensor([16, 16], dtype=torch.int32), "same length"),
        (s, kv, ids, torch.tensor([0], dtype=torch.int32), "num_tokens must be in"),
        (s, kv, ids, torch.tensor([17], dtype=torch.int32), "num_tokens must be in"),
        (s, kv, torch.tensor([4], dtype=torch.int32), n, "block_ids must be in"),
    ]
    for summaries, kv_layer, block_ids, num_tokens, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn(summaries, kv_layer, block_ids, num_tokens)
    with pytest.raises(ValueError, match="first_token must be in"):
        fn(s, kv, ids, n, first_token=torch.tensor([16], dtype=torch.int32))
    with pytest.raises(ValueError, match="same length"):
        fn(s, kv, ids, n, first_token=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="summary_ids must be in"):
        fn(s, kv, ids, n, summary_ids=torch.tensor([-1], dtype=torch.int32))
