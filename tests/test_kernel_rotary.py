"""Fused rotary of q and k: the Triton kernel (TRITON_INTERPRET=1 on the CPU) EQUALS the torch reference
bit for bit (the engine compares modes token for token), for fp32 and fp16, D not a power of two, and
the non-contiguous q/k views the model passes; and the kernel compiled for the GPU has no FMA."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.backends  # noqa: E402

from oasiskv.config import ModelConfig  # noqa: E402
from oasiskv.kernels.rotary import apply_rotary_qk, apply_rotary_reference  # noqa: E402
from oasiskv.models.llama import Rotary  # noqa: E402

from tests.kernel_device import DEV, ON_GPU  # noqa: E402


def cos_sin(t, d, dtype, seed):
    """The model's own cos, sin [T, 1, D] of a tiny config, at scattered positions."""
    cfg = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": d, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": d})
    positions = torch.randint(0, 4000, (t,), generator=torch.Generator().manual_seed(seed))
    cos, sin = Rotary(cfg).cos_sin(positions, dtype)
    return cos.to(DEV), sin.to(DEV)


def randn(shape, dtype, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype).to(DEV)


def float64_rotary(x, cos, sin):
    """Independent of the reference's ops: the pairs (x[i], x[i + D/2]) rotated in float64."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]), -1)


def check(q, k, cos, sin):
    q_out, k_out = apply_rotary_qk(q, k, cos, sin)
    cos, sin = cos.view(q.shape[0], 1, -1), sin.view(q.shape[0], 1, -1)  # the [T, D] form too
    for x, out in ((q, q_out), (k, k_out)):
        assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
        assert out.is_contiguous()
        assert torch.equal(out, apply_rotary_reference(x, cos, sin))
        tol = 1e-5 if x.dtype == torch.float32 else 2e-2  # a few ulps of |x| <= ~15
        torch.testing.assert_close(out.double(), float64_rotary(x, cos, sin), atol=tol, rtol=tol)
    return q_out, k_out


@pytest.mark.parametrize("d", [64, 128, 96])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 1)])
@pytest.mark.parametrize("t", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference(d, hq, hkv, t, dtype):
    cos, sin = cos_sin(t, d, dtype, seed=t)
    check(randn((t, hq, d), dtype, seed=d + t), randn((t, hkv, d), dtype, seed=d - t), cos, sin)


@pytest.mark.parametrize("t", [37, 64])
def test_many_programs_and_a_partial_last_one(t):
    """More head rows than one program takes (16 at D = 128, 32 at D = 64), the last program partly masked."""
    for d, hq, hkv in ((128, 4, 2), (64, 9, 3)):
        cos, sin = cos_sin(t, d, torch.float16, seed=d)
        check(randn((t, hq, d), torch.float16, seed=t), randn((t, hkv, d), torch.float16, seed=-t), cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_views_of_a_wider_projection(dtype):
    """q and k are [T, H, D] views of slices of one fused qkv output: strides (W, D, 1), not contiguous."""
    t, hq, hkv, d = 5, 4, 2, 96
    qkv = randn((t, (hq + 2 * hkv) * d), dtype, seed=1)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = cos_sin(t, d, dtype, seed=2)
    q_out, k_out = check(q, k, cos, sin)
    q_dense, k_dense = apply_rotary_qk(q.contiguous(), k.contiguous(), cos, sin)
    assert torch.equal(q_out, q_dense) and torch.equal(k_out, k_dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_transposed_inputs_and_2d_cos_sin(dtype):
    """Transposes: q with head stride 1 and k with last-dim stride != 1; cos, sin given as [T, D]."""
    t, hq, hkv, d = 3, 3, 2, 64
    q = randn((hq, t, d), dtype, seed=3).transpose(0, 1)
    k = randn((t, d, hkv), dtype, seed=4).transpose(1, 2)
    assert k.stride(2) != 1
    cos, sin = cos_sin(t, d, dtype, seed=5)
    check(q, k, cos[:, 0], sin[:, 0])


def test_rounding_of_each_op_like_torch():
    """fp16 with large x and random cos, sin: a single rounding of x*cos + r*sin (an FMA, or no
    intermediate cast) would differ from torch's three roundings somewhere in these rows."""
    t, d = 7, 128
    q, k = randn((t, 4, d), torch.float16, seed=6) * 100, randn((t, 2, d), torch.float16, seed=7) * 100
    cos, sin = randn((t, 1, d), torch.float16, seed=8), randn((t, 1, d), torch.float16, seed=9)
    q_out, _ = apply_rotary_qk(q, k, cos, sin)
    assert torch.equal(q_out, apply_rotary_reference(q, cos, sin))
    half = d // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), -1).float()
    once = (q.float() * cos.float() + rotated * sin.float()).half()
    assert not torch.equal(q_out, once)


PTX = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from oasiskv.kernels import rotary
    kernel, names = rotary._rotary_qk_kernel, rotary._rotary_qk_kernel.arg_names
    sig = {n: "*" + sys.argv[1] if n.endswith("_ptr") else "constexpr" if n.startswith("BLOCK_") else "i32"
           for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index("BLOCK_H"),): 64, (names.index("BLOCK_R"),): 16})
    print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=rotary._COMPILE_OPTIONS).asm["ptx"])
''')


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="no NVIDIA backend to compile with")
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_compiled_kernel_has_no_fma(dtype):
    """What the interpreter cannot show: with Triton's default fp fusion the compiler fuses x * cos into
    the add (fma.rn.f16 even in fp16), one rounding fewer than torch. Compiled for sm_90 on the CPU."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", PTX, dtype], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mul.rn." in done.stdout and "fma" not in done.stdout


@pytest.mark.skipif(not ON_GPU, reason="bf16 is unreliable under the interpreter")
def test_bf16_on_gpu():
    cos, sin = cos_sin(7, 128, torch.bfloat16, seed=10)
    check(randn((7, 4, 128), torch.bfloat16, seed=11), randn((7, 2, 128), torch.bfloat16, seed=12), cos, sin)


def test_no_tokens():
    q_out, k_out = apply_rotary_qk(torch.empty(0, 4, 64, device=DEV), torch.empty(0, 2, 64, device=DEV),
                                   torch.empty(0, 1, 64, device=DEV), torch.empty(0, 1, 64, device=DEV))
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)


def test_attention_uses_reference_on_cpu():
    """Attention.forward on CPU tensors runs the torch ops, bit for bit, even with the interpreter on."""
    from oasiskv.models.llama import Attention

    cfg = ModelConfig.from_hf({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 16})
    attn = Attention(cfg, layer=0)
    seen = {}

    class Record:
        def attend(self, layer, q, k, v):
            seen.update(q=q, k=k)
            return q

    x = torch.randn(3, 64)
    cos, sin = Rotary(cfg).cos_sin(torch.tensor([0, 5, 9]), torch.float32)
    with torch.no_grad():
        attn(x, cos, sin, Record())
        q = attn.q_norm(attn.q_proj(x).view(3, 4, 16))
        k = attn.k_norm(attn.k_proj(x).view(3, 2, 16))
        assert torch.equal(seen["q"], apply_rotary_reference(q, cos, sin))
        assert torch.equal(seen["k"], apply_rotary_reference(k, cos, sin))


def test_bad_inputs_raise():
    q, k = randn((3, 4, 64), torch.float32, seed=13), randn((3, 2, 64), torch.float32, seed=14)
    cos, sin = cos_sin(3, 64, torch.float32, seed=15)
    with pytest.raises(ValueError, match=r"must be \[T, H, D\]"):
        apply_rotary_qk(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="same T and D"):
        apply_rotary_qk(q, k[:2], cos, sin)
    with pytest.raises(ValueError, match="same T and D"):
        apply_rotary_qk(q, k[..., :32], cos, sin)
    with pytest.raises(ValueError, match="must be even"):
        apply_rotary_qk(q[..., :63], k[..., :63], cos[..., :63], sin[..., :63])
    with pytest.raises(ValueError, match=r"cos must be \[T, 1, D\]"):
        apply_rotary_qk(q, k, cos[:2], sin)
    with pytest.raises(ValueError, match=r"sin must be \[T, 1, D\]"):
        apply_rotary_qk(q, k, cos, sin.expand(3, 4, 64))
    with pytest.raises(ValueError, match="q dtype"):
        apply_rotary_qk(q.double(), k.double(), cos.double(), sin.double())
    with pytest.raises(ValueError, match="share one dtype"):
        apply_rotary_qk(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="share one dtype"):
        apply_rotary_qk(q.half(), k.half(), cos, sin)
    with pytest.raises(ValueError, match="one device"):
        apply_rotary_qk(q, k.to("meta"), cos, sin)  # a second device on any machine


@pytest.mark.parametrize("cos_2d", [True, False], ids=["cos [T, D], sin [T, 1, D]", "cos [T, 1, D], sin [T, D]"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cos_and_sin_of_different_accepted_shapes(cos_2d, dtype):
    """cos and sin may each be [T, 1, D] or [T, D]: the launcher unsqueezed both only when cos was 2-D, so a 2-D cos
    with a 3-D sin read sin along the wrong stride (wrong values) and the other mix failed with an IndexError; found
    by a helper's audit of the kernels."""
    t, hq, hkv, d = 3, 2, 1, 64
    q, k = randn((t, hq, d), dtype, seed=6), randn((t, hkv, d), dtype, seed=7)
    cos, sin = cos_sin(t, d, dtype, seed=8)
    check(q, k, *((cos[:, 0], sin) if cos_2d else (cos, sin[:, 0])))
