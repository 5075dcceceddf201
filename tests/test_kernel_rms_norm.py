"""Fused RMSNorm: Triton kernel (TRITON_INTERPRET=1 on the CPU) vs the torch reference vs a float64
computation, including q/k-norm style non-contiguous [T, H, D] views and D not a power of two."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402

from tests.kernel_device import DEV, ON_GPU  # noqa: E402

# Comparisons against the float64 result: the kernel and the reference both round y to x.dtype and
# the product to the output dtype, so each may sit one or two ulps of that dtype off the exact value.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def float64_rms_norm(x, weight, eps):
    """Independent: everything in float64, no intermediate cast (so only the tolerance relates them)."""
    xd = x.double()
    return weight.double() * xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)


def make(shape, dtype, seed, wdtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(wdtype or dtype)
    return x.to(DEV), w.to(DEV)


def check(x, w, eps):
    out = rms_norm(x, w, eps)
    ref = rms_norm_reference(x, w, eps)
    assert out.shape == x.shape and out.dtype == ref.dtype and out.device == x.device
    assert out.is_contiguous()
    tol = max(TOL[out.dtype], TOL[x.dtype], key=lambda t: t["atol"])  # y is rounded to x.dtype first
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(out.double(), float64_rms_norm(x, w, eps), **tol)
    return out


@pytest.mark.parametrize("shape", [(1, 64), (5, 576), (3, 4, 128), (2, 3, 96), (7, 96), (2, 2, 2, 64), (40,),
                                   (37, 3, 64)])  # 111 rows: four programs of 32, the last partly past the end
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_kernel_matches_reference_and_float64(shape, dtype, eps):
    x, w = make(shape, dtype, seed=sum(shape))
    check(x, w, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_norm_view_of_a_wider_projection(dtype):
    """Qwen3's q/k norms run on [T, H, D] views; here the heads are a slice of a fused qkv output, so
    rows are not evenly strided (strides (W, D, 1)) and the launcher must not need a copy."""
    t, hq, hkv, d = 3, 4, 2, 128
    qkv, _ = make((t, (hq + 2 * hkv) * d), dtype, seed=11)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    assert not k.is_contiguous()
    _, w = make((d,), dtype, seed=12)
    out = check(k, w, 1e-6)
    torch.testing.assert_close(out, check(k.contiguous(), w, 1e-6), rtol=0, atol=0)


def test_strided_last_dim_and_weight():
    """Any strides: a transposed x (last-dim stride != 1) and a strided weight."""
    x, _ = make((96, 6), torch.float32, seed=3)
    _, w2 = make((2 * 96,), torch.float32, seed=4)
    out = check(x.t(), w2[::2], 1e-6)
    torch.testing.assert_close(out, rms_norm(x.t().contiguous(), w2[::2].contiguous(), 1e-6), rtol=0, atol=0)


@pytest.mark.parametrize("xdtype,wdtype", [(torch.float16, torch.float32), (torch.float32, torch.float16)])
def test_mixed_dtypes_follow_torch_promotion(xdtype, wdtype):
    """weight * y.to(x.dtype): an fp16 x with an fp32 weight gives fp32 (and the reverse too)."""
    x, w = make((4, 96), xdtype, seed=5, wdtype=wdtype)
    out = check(x, w, 1e-6)
    assert out.dtype == torch.float32


@pytest.mark.skipif(not ON_GPU, reason="bf16 is unreliable under the interpreter")
def test_bf16_on_gpu():
    x, w = make((5, 576), torch.bfloat16, seed=6)
    check(x, w, 1e-5)


def test_empty_rows():
    x, w = make((0, 4, 64), torch.float32, seed=7)
    assert rms_norm(x, w, 1e-6).shape == (0, 4, 64)


def test_rmsnorm_module_uses_reference_on_cpu():
    """RMSNorm.forward on CPU tensors runs the torch ops, bit for bit (the model-equivalence tests
    rely on it), even with the interpreter on."""
    from oasiskv.models.llama import RMSNorm

    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(96))
    x = torch.randn(3, 4, 96)
    with torch.no_grad():
        assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, 1e-6))


def test_bad_inputs_raise():
    x, w = make((3, 64), torch.float32, seed=8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, w.view(8, 8), 1e-6)
    with pytest.raises(ValueError, match="x dtype"):
        rms_norm(x.to(torch.int32), w, 1e-6)
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm(x, w.double(), 1e-6)
    with pytest.raises(ValueError, match="at least one dimension"):
        rms_norm(x[0, 0], w, 1e-6)
    other = torch.device("meta")  # a second device on any machine
    with pytest.raises(ValueError, match="weight is on"):
        rms_norm(x, w.to(other), 1e-6)
