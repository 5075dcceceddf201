"""The thin-product path of models.linear against F.linear (the same product, other summation order)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oasiskv.models.linear import FUSED_MAX_ROWS, THIN_ROWS, FusedLinears, Linear, linear


@pytest.mark.parametrize("rows", [1, 2, 3, THIN_ROWS, THIN_ROWS + 1, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    with torch.no_grad():  # inference: the thin path
        out = linear(x, w, b)
    assert out.shape == (rows, 200) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # training keeps F.linear, bit for bit


@pytest.mark.parametrize("x", [torch.randn(3, 4, 96), torch.randn(96), torch.randn(4, 96, dtype=torch.float64)])
def test_other_shapes_and_dtypes_take_f_linear(x):
    w = torch.randn(50, 96, dtype=x.dtype)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_linear_module_keeps_nn_linear_names_and_gradients():
    layer = Linear(96, 50)
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(4, 96, requires_grad=True)
    layer(x).square().sum().backward()
    ref = torch.nn.Linear(96, 50)
    ref.load_state_dict(layer.state_dict())
    x_ref = x.detach().clone().requires_grad_(True)
    ref(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)


def test_fused_linears_equal_the_separate_ones_and_hold_no_second_copy():
    gen = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(64, n) for n in (96, 32, 32)]
    x = torch.randn(5, 64, generator=gen)
    expected = [layer(x) for layer in layers]
    fused = FusedLinears(layers)
    for got, want in zip(fused.outputs(x, layers), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    storage = fused.weight.untyped_storage().data_ptr()
    assert all(layer.weight.untyped_storage().data_ptr() == storage for layer in layers)
    assert fused.backs(layers)
    assert fused.outputs(torch.randn(FUSED_MAX_ROWS + 1, 64), layers) is None  # prefill-sized: the caller's
    layers[1] = torch.nn.Linear(64, 32)  # a module replaced (e.g. sharded) after the fusion
    assert not fused.backs(layers) and fused.outputs(x, layers) is None


def test_fused_linears_stop_backing_moved_weights_and_refuse_mixed_biases():
    layers = [torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)]
    fused = FusedLinears(layers)
    for layer in layers:
        layer.double()
    assert not fused.backs(layers)
    with pytest.raises(ValueError, match="bias"):
        FusedLinears([torch.nn.Linear(16, 8), torch.nn.Linear(16, 8, bias=False)])


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [6, FUSED_MAX_ROWS + 4])  # decode-sized (fused) and prefill-sized (apart)
def test_fused_model_gives_the_unfused_logits(bias, device, tokens):
    from oasiskv.config import ModelConfig
    from oasiskv.models.llama import CausalLM
    cfg = ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=not bias,
                      attention_bias=bias, qk_norm=not bias, eos_token_ids=(0,), bos_token_id=None)
    torch.manual_seed(0)
    model = CausalLM(cfg).eval().to(device)  # on the GPU, the norm and rotary kernels read q and k as views
    ids, positions = torch.randint(0, 97, (tokens,), device=device), torch.arange(tokens, device=device)

    class Causal:  # plain causal attention over the step's own tokens: enough to compare two forwards
        def attend(self, layer, q, k, v):
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                  is_causal=True).transpose(0, 1)

    with torch.no_grad():
        before = model.logits(model(ids, positions, Causal())[0])
        model.fuse_projections()
        model.fuse_projections()  # a second call changes nothing
        after = model.logits(model(ids, positions, Causal())[0])
    assert all(layer.self_attn.qkv is not None and layer.mlp.gate_up is not None for layer in model.model.layers)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
