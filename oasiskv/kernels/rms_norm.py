"""RMSNorm in one launch (replaces ~8 elementwise/reduction kernels of the torch form).

For every row x of the last dimension D (rows = all leading dims of ``x``), exactly as transformers'
LlamaRMSNorm (and our RMSNorm before this kernel):

  xf  = float32(x)
  y   = xf * rsqrt(mean_d(xf[d]^2) + eps)                 (fp32)
  out = weight * cast(y, x.dtype)                         (cast BEFORE the weight multiply)

``out`` has the promoted dtype of (weight, x): bf16 x with fp32 weight gives fp32, as torch's
``weight * y.to(x.dtype)`` does. The product is taken in fp32 and rounded once to that dtype; for
fp32/fp16/bf16 operands the fp32 product of the two is exact, so the only rounding is the one torch
makes too. The sum of squares is reduced in fp32 in the kernel's own order, so results agree with
the torch reference to fp32 rounding, not bit for bit.

Layouts: ``x`` [..., D] with ANY strides: the launcher views it as [A, B, D] (B = x.shape[-2], A =
the other leading dims) through ``reshape``, which is a free view for the q/k-norm case, a
[T, H, D] view of a slice of a wider projection output (strides (W, D, 1)); only when the dims
before -2 cannot be merged without a copy does ``reshape`` copy. The kernel reads x through its
three strides (the last need not be 1); ``out`` is a new contiguous tensor of x's shape.
``weight`` is [D], any stride. fp32, fp16 and bf16 only.

Dispatch: the Triton kernel runs on CUDA tensors, and on CPU tensors when this module was imported
with ``TRITON_INTERPRET=1`` (interpreter); otherwise the torch reference runs. Engine code calls
the reference itself on CPU tensors (RMSNorm.forward), so CPU model runs are the torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# a program's tile: rows of head_dim 128 go 16 to a program (at one row a program, all RMSNorms took 19 ms of a
# 16K qwen3-8b prefill's 535 on the H200, 2026-12-04); rows of 2048 and more stay one a program
_TILE_ELEMENTS = 2048


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, w_ptr, ROWS_TOTAL, B, s_xa, s_xb, s_xd, s_w, D, eps,
                     BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    # ROWS rows a program (many for short rows: a q/k norm has T x heads rows of head_dim); rows are numbered
    # a * B + b, which is also the row of the contiguous out.
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    a = row // B
    b = row % B
    d = tl.arange(0, BLOCK_D)
    m = (row[:, None] < ROWS_TOTAL) & (d[None, :] < D)
    x = tl.load(x_ptr + a[:, None] * s_xa + b[:, None] * s_xb + d[None, :] * s_xd, mask=m, other=0.0)
    out = _normed_rows(x, w_ptr, s_w, d, D, eps)
    tl.store(out_ptr + row[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _normed_rows(x, w_ptr, s_w, d, D, eps):
    # fp32 weight * cast(x / rms(x), x.dtype) for a [rows, BLOCK_D] tile (both kernels: the same bits)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=1) / D
    y = (xf * tl.rsqrt(ms + eps)[:, None]).to(x.dtype)  # the cast to x.dtype, before the weight
    w = tl.load(w_ptr + d * s_w, mask=d < D, other=0.0)
    return w.to(tl.float32)[None, :] * y.to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(sum_ptr, out_ptr, x_ptr, delta_ptr, w_ptr, ROWS_TOTAL, D, eps,
                         BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    # the residual stream's add, rounded to x's dtype as torch's x + delta is, then _rms_norm_kernel's math on
    # the rounded sum (contiguous [rows, D] throughout)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    m = (row[:, None] < ROWS_TOTAL) & (d[None, :] < D)
    at = row[:, None] * D + d[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0)
    delta = tl.load(delta_ptr + at, mask=m, other=0.0)
    total = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(sum_ptr + at, total, mask=m)
    out = _normed_rows(total, w_ptr, 1, d, D, eps)
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=m)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension ([..., D])")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [D] = [{x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x dtype must be fp32, fp16 or bf16, got {x.dtype}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"weight dtype must be fp32, fp16 or bf16, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch twin of :func:`rms_norm`: the very ops of transformers' LlamaRMSNorm (no checks, so it
    stays exactly what RMSNorm.forward always ran)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _triton_runs(device: torch.device) -> bool:
    # The interpreter is chosen when triton.jit runs (module import), so ask the kernel object.
    return device.type == "cuda" or type(_rms_norm_kernel).__name__ == "InterpretedFunction"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every row of ``x`` [..., D] with ``weight`` [D] (see the module docstring).

    Returns a new contiguous tensor of x's shape, in the promoted dtype of (weight, x). Not
    differentiable on the Triton path: callers that need gradients use :func:`rms_norm_reference`.
    """
    _check(x, weight)
    if not _triton_runs(x.device):
        return rms_norm_reference(x, weight, eps)
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if out.numel() == 0:
        return out
    b = x.shape[-2] if x.dim() >= 2 else 1
    x3 = x.reshape(-1, b, d)  # a view unless the dims before -2 cannot merge (then a copy)
    rows = x3.shape[0] * b
    grid, tile = _tiles(rows, d)
    _rms_norm_kernel[grid](out, x3, weight, rows, b, x3.stride(0), x3.stride(1), x3.stride(2), weight.stride(0), d,
                           float(eps), **tile)
    return out


def _tiles(rows: int, d: int) -> tuple[tuple[int], dict]:
    """Both kernels' grid and tile: rows a program for a tile of about _TILE_ELEMENTS values, and its warps."""
    block_d = triton.next_power_of_2(d)
    per_program = max(1, _TILE_ELEMENTS // block_d)
    warps = min(max(block_d * per_program // 256, 1), 8)
    return (triton.cdiv(rows, per_program),), dict(BLOCK_D=block_d, ROWS=per_program, num_warps=warps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one launch: the decoder's residual add and the next RMSNorm, which
    torch runs as an add kernel (two reads, one write) and the norm (one read more). x and delta are contiguous
    [T, D] of one dtype, weight [D] contiguous; the sum is rounded to x's dtype before the norm reads it, as the
    two torch ops do. Not differentiable on the Triton path: see add_rms_norm_reference."""
    _check(x, weight)
    if x.dim() != 2 or delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
        raise ValueError(f"x and delta must be [T, D] of one dtype and device, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(delta.shape)} {delta.dtype}")
    if not (x.is_contiguous() and delta.is_contiguous() and weight.is_contiguous()):
        raise ValueError("x, delta and weight must be contiguous")
    if not _triton_runs(x.device):
        return add_rms_norm_reference(x, delta, weight, eps)
    total = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if out.numel() == 0:
        return total, out
    rows, d = x.shape
    grid, tile = _tiles(rows, d)
    _add_rms_norm_kernel[grid](total, out, x, delta, weight, rows, d, float(eps), **tile)
    return total, out


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`add_rms_norm`: the add, then rms_norm_reference of the sum."""
    total = x + delta
    return total, rms_norm_reference(total, weight, eps)
