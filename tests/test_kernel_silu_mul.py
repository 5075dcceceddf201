"""kernels/silu_mul.py: the Triton kernel (interpreted on the CPU) against torch's F.silu(gate) * up and a float64
computation, on contiguous inputs and on the column halves of one fused [T, 2I] product."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.silu_mul import silu_mul, silu_mul_reference  # noqa: E402

from tests.kernel_device import DEV  # noqa: E402

ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10}


def make(tokens, inner, dtype, seed, fused):
    gen = torch.Generator().manual_seed(seed)
    both = (torch.randn(tokens, 2 * inner, generator=gen) * 4).to(dtype).to(DEV)
    if fused:  # the halves of one gate/up product, rows 2I apart
        return both[:, :inner], both[:, inner:]
    return both[:, :inner].contiguous(), both[:, inner:].contiguous()


@pytest.mark.parametrize("tokens, inner", [(1, 7), (5, 96), (3, 1500), (64, 2048), (2, 3000)])  # 1500, 3000: chunks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])                            # of 1024 and a rest
@pytest.mark.parametrize("fused", [False, True])
def test_kernel_matches_torch_and_float64(tokens, inner, dtype, fused):
    gate, up = make(tokens, inner, dtype, seed=tokens + inner, fused=fused)
    out = silu_mul(gate, up)
    assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
    ref = silu_mul_reference(gate, up)
    # one unit in the last place of the output (the module docstring), relative to each value
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=2 * ULP[dtype])
    g = gate.double()
    exact = g / (1 + torch.exp(-g)) * up.double()
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=4 * ULP[dtype])


def test_empty():
    gate = torch.empty(0, 8, device=DEV)
    assert silu_mul(gate, gate).shape == (0, 8)


def test_bad_inputs_raise():
    gate, up = make(2, 8, torch.float32, seed=0, fused=False)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(gate, up[:, :4])
    with pytest.raises(ValueError, match="share a float dtype"):
        silu_mul(gate, up.half())
    with pytest.raises(ValueError, match="contiguous along their last"):
        silu_mul(gate.t(), up.t())
