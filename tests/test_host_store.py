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
