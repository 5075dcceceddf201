"""Rotary embedding of q and k in one launch (replaces ~10 elementwise kernels of the torch form).

Non-interleaved rotary (transformers' rotate_half convention). For every head row x of length D
(h = D / 2), with cos, sin the row's position's [D] vectors:

  rotated = cat(-x[h:], x[:h])
  out     = x * cos + rotated * sin

Rounding invariant, so the kernel is bit for bit the torch form: torch computes each of the three
ops in fp32 and rounds its result to the tensor dtype, so the kernel does the same:

  a   = round(x * cos),  b = round(rotated * sin),  out = round(a + b)

(``-x`` is exact). For fp16 and bf16 the fp32 products are exact, so each rounding is the one
torch makes; the compiler turns these ops into native half ops (``mul.rn.f16``...), which give the
same results (fp32 has at least 2p + 2 significand bits, p = 11 or 8, so rounding twice equals
rounding once). For fp32 the roundings are no-ops and the math is plain fp32. In every dtype FMA
contraction must stay off (``_COMPILE_OPTIONS``): by default the compiler fuses ``x * cos`` into
the add (``fma.rn.f16`` even in fp16), which skips a rounding. The interpreter cannot show this; a
test reads the PTX.

Layouts: q [T, Hq, D] and k [T, Hkv, D] with ANY strides (views of a wider projection output, the
q/k-norm outputs, transposes); cos and sin [T, 1, D] or [T, D], any strides, of q's dtype. The
outputs are new contiguous tensors of q's and k's shapes. fp32, fp16 and bf16 only.

Dispatch: the Triton kernel runs on CUDA tensors, and on CPU tensors when this module was imported
with ``TRITON_INTERPRET=1`` (interpreter); otherwise the torch reference runs. Engine code calls
the reference itself on CPU tensors (Attention.forward), so CPU model runs are the torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_rotary_qk", "apply_rotary_qk_reference", "apply_rotary_reference"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_COMPILE_OPTIONS = {"enable_fp_fusion": False}  # no FMA: see the module docstring
# Elements of x's half-rows per program: BLOCK_R = _TILE / BLOCK_H head rows (16 at D = 128). Fewer, wider programs
# than one per row; under the interpreter, whose cost is per program, the engine tests' prefill is ~16x cheaper.
_TILE = 1024


@triton.jit
def _rotate(x, c, r, s):
    """round(round(x * c) + round(r * s)) in x's dtype: the torch form's three roundings."""
    dt = x.dtype
    a = (x.to(tl.float32) * c.to(tl.float32)).to(dt).to(tl.float32)
    b = (r.to(tl.float32) * s.to(tl.float32)).to(dt).to(tl.float32)
    return (a + b).to(dt)


@triton.jit
def _rotary_qk_kernel(qo_ptr, ko_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, ROWS, HQ, HKV,
                      s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_ct, s_cd, s_st, s_sd, HALF,
                      BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    # BLOCK_R head rows per program; row t * (HQ + HKV) + h, the first HQ heads of a position are q's.
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = row // (HQ + HKV)
    h = row % (HQ + HKV)
    is_q = h < HQ
    src = tl.where(is_q, q_ptr + t * s_qt + h * s_qh, k_ptr + t * s_kt + (h - HQ) * s_kh)
    s_d = tl.where(is_q, s_qd, s_kd)
    dst = tl.where(is_q, qo_ptr + (t * HQ + h) * 2 * HALF, ko_ptr + (t * HKV + h - HQ) * 2 * HALF)
    j = tl.arange(0, BLOCK_H)
    m = (row < ROWS)[:, None] & (j < HALF)[None, :]
    src_lo, src_hi = src[:, None] + j[None, :] * s_d[:, None], src[:, None] + (j + HALF)[None, :] * s_d[:, None]
    x1 = tl.load(src_lo, mask=m, other=0.0)
    x2 = tl.load(src_hi, mask=m, other=0.0)
    c_row, s_row = cos_ptr + t[:, None] * s_ct, sin_ptr + t[:, None] * s_st
    c1 = tl.load(c_row + j[None, :] * s_cd, mask=m, other=0.0)
    c2 = tl.load(c_row + (j + HALF)[None, :] * s_cd, mask=m, other=0.0)
    s1 = tl.load(s_row + j[None, :] * s_sd, mask=m, other=0.0)
    s2 = tl.load(s_row + (j + HALF)[None, :] * s_sd, mask=m, other=0.0)
    tl.store(dst[:, None] + j[None, :], _rotate(x1, c1, -x2, s1), mask=m)
    tl.store(dst[:, None] + HALF + j[None, :], _rotate(x2, c2, x1, s2), mask=m)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same T and D")
    if d % 2:
        raise ValueError(f"head dim D must be even, got {d}")
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) not in ((t, 1, d), (t, d)):
            raise ValueError(f"{name} must be [T, 1, D] or [T, D] = [{t}, 1, {d}], got {tuple(c.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q dtype must be fp32, fp16 or bf16, got {q.dtype}")
    tensors = (q, k, cos, sin)
    if any(x.dtype != q.dtype for x in tensors):
        raise ValueError(f"q, k, cos, sin must share one dtype, got {[x.dtype for x in tensors]}")
    if any(x.device != q.device for x in tensors):
        raise ValueError(f"q, k, cos, sin must be on one device, got {[str(x.device) for x in tensors]}")


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Torch twin of the kernel for one tensor x [T, H, D] with cos, sin [T, 1, D]: the very ops the
    model always ran (no checks; differentiable)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_qk_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`apply_rotary_qk` (cos, sin [T, 1, D])."""
    return apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)


def _triton_runs(device: torch.device) -> bool:
    # The interpreter is chosen when triton.jit runs (module import), so ask the kernel object.
    return device.type == "cuda" or type(_rotary_qk_kernel).__name__ == "InterpretedFunction"


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, Hq, D] and k [T, Hkv, D] by cos, sin [T, 1, D] or [T, D], in one
    launch (see the module docstring). Returns new contiguous (q_out, k_out), bit for bit
    :func:`apply_rotary_reference` of each. Not differentiable on the Triton path."""
    _check(q, k, cos, sin)
    cos, sin = (c.unsqueeze(1) if c.dim() == 2 else c for c in (cos, sin))  # each by its own shape: they may differ
    if not _triton_runs(q.device):
        return apply_rotary_qk_reference(q, k, cos, sin)
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rows = t * (hq + hkv)
    if rows == 0 or d == 0:
        return q_out, k_out
    block_h = triton.next_power_of_2(d // 2)
    block_r = max(_TILE // block_h, 1)
    _rotary_qk_kernel[(triton.cdiv(rows, block_r),)](
        q_out, k_out, q, k, cos, sin, rows, hq, hkv, *q.stride(), *k.stride(),
        cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2), d // 2,
        BLOCK_H=block_h, BLOCK_R=block_r, num_warps=4, **_COMPILE_OPTIONS,
    )
    return q_out, k_out
