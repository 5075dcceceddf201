"""The host store's prefill writes and prefix reads against plain indexing of the same data. On a GPU
machine the store is pinned and both run on the device (through its UVA address); elsewhere the CPU
paths run."""
import pytest
import torch

from oasiskv.config import ModelConfig
from oasiskv.kv.host_store import HostStore

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CFG = ModelConfig.from_hf(dict(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_writes_then_prefix_reads(device, dtype):
    bs, blocks, tokens = 4, 7, 14
    store = HostStore(CFG, blocks, bs, dtype, pin=device == "cuda")
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(tokens, 2, 8, generator=gen).to(dtype)
    v = torch.randn(tokens, 2, 8, generator=gen).to(dtype)
    table = torch.tensor([5, 2, 6, 0])  # the request's blocks, in order
    pos = torch.arange(tokens)
    store.write_tokens(1, table[pos // bs].to(device), (pos % bs).to(device), k.to(device), v.to(device))
    for n in (1, 9, tokens):
        pk, pv = store.read_prefix(1, table, n, torch.device(device))
        assert pk.device.type == device
        assert torch.equal(pk.cpu(), k[:n]) and torch.equal(pv.cpu(), v[:n])
    assert not store.kv[0].any()  # the other layer is untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("start, tokens", [(0, 16), (0, 13), (3, 20), (5, 2), (8, 4), (6, 30)])
@pytest.mark.parametrize("staged_in_buffer", [False, True])
def test_span_writes_equal_token_writes(device, start, tokens, staged_in_buffer):
    """Whole blocks by copies (in runs of consecutive ids), partial ones token by token: the store ends up
    as with every token written on its own (the reference)."""
    bs, table = 4, [7, 2, 3, 4, 9, 0, 1, 5, 6, 8]  # runs 2-4, 0-1, 5-6 and single blocks
    stream = torch.cuda.Stream() if device == "cuda" else None
    gen = torch.Generator().manual_seed(start * 100 + tokens)
    k, v = (torch.randn(tokens, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    pos = torch.arange(start, start + tokens)
    blocks, offsets = torch.tensor(table)[pos // bs], pos % bs
    expected = HostStore(CFG, len(table), bs, torch.bfloat16, pin=False)
    expected.write_tokens(1, blocks, offsets, k, v)
    store = HostStore(CFG, len(table), bs, torch.bfloat16, pin=device == "cuda")
    buffer = torch.full((12, 2, bs, 2, 8), 7.0, dtype=torch.bfloat16, device=device) if staged_in_buffer else None
    staged = store.write_span(1, start, table, k.to(device), v.to(device), blocks.to(device), offsets.to(device),
                              stream, buffer)
    assert staged == max(0, (start + tokens) // bs - -(-start // bs))  # whole blocks
    if stream is not None:
        torch.cuda.synchronize()
    assert torch.equal(store.kv, expected.kv)


def test_consecutive_runs():
    from oasiskv.kv.host_store import consecutive_runs
    assert consecutive_runs([4, 5, 6, 1, 2, 9]) == [(0, 3, 4), (3, 5, 1), (5, 6, 9)]
    assert consecutive_runs([3]) == [(0, 1, 3)] and consecutive_runs([]) == []
