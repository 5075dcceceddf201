"""The residual add fused into RMSNorm (kernels/rms_norm.py add_rms_norm): the Triton kernel (interpreted on the CPU)
against torch's add, the unfused rms_norm kernel and a float64 computation."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm  # noqa: E402

from tests.kernel_device import DEV, ON_GPU  # noqa: E402
from tests.test_kernel_rms_norm import TOL, float64_rms_norm  # noqa: E402


def make(rows, dim, dtype, seed, wdtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    delta = (torch.randn(rows, dim, generator=gen) * 2).to(dtype)
    w = (1 + 0.5 * torch.randn(dim, generator=gen)).to(wdtype or dtype)
    return x.to(DEV), delta.to(DEV), w.to(DEV)


def check(x, delta, w, eps):
    total, out = add_rms_norm(x, delta, w, eps)
    assert total.dtype == x.dtype and total.is_contiguous() and out.is_contiguous()
    assert torch.equal(total, x + delta)  # the sum torch's add rounds, to the bit
    # the norm of that sum is the unfused kernel's, to the bit: the same reduction over the same rounded values
    assert torch.equal(out, rms_norm(x + delta, w, eps))
    ref_total, ref = add_rms_norm_reference(x, delta, w, eps)
    assert torch.equal(ref_total, total) and ref.dtype == out.dtype
    tol = max(TOL[out.dtype], TOL[x.dtype], key=lambda t: t["atol"])
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(out.double(), float64_rms_norm(total, w, eps), **tol)


@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 576), (3, 4096), (7, 96), (37, 128), (40, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_add_then_norm(rows, dim, dtype):
    x, delta, w = make(rows, dim, dtype, seed=rows * dim)
    check(x, delta, w, 1e-6)


def test_fp16_stream_with_fp32_weight_follows_torch_promotion():
    x, delta, w = make(4, 96, torch.float16, seed=5, wdtype=torch.float32)
    check(x, delta, w, 1e-5)
    assert add_rms_norm(x, delta, w, 1e-5)[1].dtype == torch.float32


@pytest.mark.skipif(not ON_GPU, reason="bf16 is unreliable under the interpreter")
def test_bf16_on_gpu():
    x, delta, w = make(86, 4096, torch.bfloat16, seed=6)
    check(x, delta, w, 1e-6)


def test_empty_rows():
    x, delta, w = make(0, 64, torch.float32, seed=7)
    total, out = add_rms_norm(x, delta, w, 1e-6)
    assert total.shape == out.shape == (0, 64)


def test_module_adds_and_norms_with_torch_ops_on_cpu():
    """RMSNorm.add_and_norm on CPU tensors is torch's add and then RMSNorm.forward, bit for bit (the model's
    equivalence tests rely on it); with no delta it is the norm of x alone."""
    from oasiskv.models.llama import RMSNorm

    norm = RMSNorm(96, 1e-6)
    x, delta = torch.randn(3, 96), torch.randn(3, 96)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(96))
        total, out = norm.add_and_norm(x, delta)
        assert torch.equal(total, x + delta) and torch.equal(out, norm(x + delta))
        same, alone = norm.add_and_norm(x, None)
        assert same is x and torch.equal(alone, norm(x))


def test_bad_inputs_raise():
    x, delta, w = make(3, 64, torch.float32, seed=8)
    with pytest.raises(ValueError, match="one dtype"):
        add_rms_norm(x, delta.half(), w, 1e-6)
    with pytest.raises(ValueError, match=r"\[T, D\]"):
        add_rms_norm(x, delta[:2], w, 1e-6)
    with pytest.raises(ValueError, match=r"\[T, D\]"):
        add_rms_norm(x.view(3, 2, 32), delta.view(3, 2, 32), w[:32], 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(x.t().contiguous().t(), delta, w, 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm(x, delta, w[:32], 1e-6)
