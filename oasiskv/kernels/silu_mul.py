"""The MLP's SiLU(gate) x up in one launch (torch: two, and a [T, intermediate] temporary written and read again).

  out = cast(cast(silu(float32(gate)), dtype) * up, dtype),  silu(g) = g / (1 + exp(-g))

as torch computes F.silu(gate) * up for bf16/fp16 inputs: SiLU in fp32, rounded to the input dtype, then the product
of the two rounded values in fp32, rounded once. Triton's exp and division may differ from CUDA's in the last fp32
place, so a result can sit one unit of the output dtype off torch's where the fp32 value falls at a rounding boundary.

`gate` and `up` are [T, I] with any row stride (the halves of the fused gate/up product are column views of one [T, 2I]
tensor) and unit column stride; the output is a new contiguous [T, I]. The torch reference is silu_mul_reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from oasiskv.kernels.value_checks import interpreted

__all__ = ["silu_mul", "silu_mul_reference"]

_BLOCK = 1024  # values a program: one row's chunk


@triton.jit
def _silu_mul_kernel(out_ptr, gate_ptr, up_ptr, s_g, s_u, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < I
    gate = tl.load(gate_ptr + row * s_g + cols, mask=inside, other=0.0)
    up = tl.load(up_ptr + row * s_u + cols, mask=inside, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate_ptr.dtype.element_ty)  # rounded to the input dtype, as F.silu returns it
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * I + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate, up [T, I] of one float dtype on one device (see the module docstring). Triton on
    CUDA tensors and under TRITON_INTERPRET=1, else the torch reference."""
    _check(gate, up)
    if not gate.is_cuda and not interpreted():  # no Triton driver on a CPU
        return silu_mul_reference(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    tokens, inner = gate.shape
    _silu_mul_kernel[(tokens, triton.cdiv(inner, _BLOCK))](out, gate, up, gate.stride(0), up.stride(0), inner,
                                                           BLOCK=_BLOCK, num_warps=4)
    return out


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The torch ops the MLP ran before the kernel."""
    return F.silu(gate) * up


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"gate and up must be [T, I] of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype or gate.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gate and up must share a float dtype (fp32, fp16, bf16), got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate is on {gate.device}, up on {up.device}")
    if gate.shape[1] > 1 and (gate.stride(1) != 1 or up.stride(1) != 1):
        raise ValueError("gate and up must be contiguous along their last dimension")
