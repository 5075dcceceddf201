"""The shortlist's scores in one launch: shortlist_block_lse's per-head log-sum-exps -> each listed block's mass,
placed at its logical id in a row of block scores.

For row b the listed blocks' mass is (kernels/shortlist_mass.py, listed_mass)
  mass[b, w] = sum over KV groups of max over the group's query heads h of exp(block_lse[b, h, w] - total[b, h]),
  total[b, h] = logsumexp over w of block_lse[b, h, w]
(a term is 0 where block_lse is -inf: a listed block not on the GPU), and the row of scores is -inf everywhere but
at listed[b, w], which gets mass[b, w] (on_the_list). In torch that is about ten launches a layer over [B, Hq, W];
here one program per row holds a KV group's [group, W] log-sum-exps at a time, then writes its row. The torch twin is
listed_scores_reference; the tests check both against a direct computation."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.shortlist_mass import listed_mass
from oasiskv.kernels.value_checks import check_range, checks_values

__all__ = ["listed_scores", "listed_scores_reference", "on_the_list", "MAX_KERNEL_ELEMENTS"]

MAX_KERNEL_ELEMENTS = 1 << 15  # a group's padded [group, W] tile held in registers; longer lists take the twin
_ROW_TILE = 1024  # the -inf fill's stride along a row of scores


@triton.jit
def _listed_scores_kernel(lse_ptr, listed_ptr, out_ptr, s_lb, s_lh, s_ib, s_ob, KV_HEADS, GROUP, WIDTH, OUT_WIDTH,
                          G_PAD: tl.constexpr, W_PAD: tl.constexpr, ROW_TILE: tl.constexpr):
    b = tl.program_id(0)
    g, w = tl.arange(0, G_PAD), tl.arange(0, W_PAD)
    inside = (g[:, None] < GROUP) & (w[None, :] < WIDTH)
    total_mass = tl.zeros((W_PAD,), dtype=tl.float32)
    for kv in range(KV_HEADS):
        heads = kv * GROUP + g
        lse = tl.load(lse_ptr + b * s_lb + heads[:, None] * s_lh + w[None, :], mask=inside, other=float("-inf"))
        top = tl.max(lse, axis=1)
        top = tl.where(top == float("-inf"), 0.0, top)  # a head with nothing resident: its mass is 0 everywhere
        # the sum is at least 1 (the top term) unless every column is -inf: then 1 keeps log finite, masses 0
        total = top + tl.log(tl.maximum(tl.sum(tl.exp(lse - top[:, None]), axis=1), 1.0))
        mass = tl.where(lse > float("-inf"), tl.exp(lse - total[:, None]), 0.0)
        total_mass += tl.max(mass, axis=0)
    for start in range(0, OUT_WIDTH, ROW_TILE):
        cols = start + tl.arange(0, ROW_TILE)
        tl.store(out_ptr + b * s_ob + cols, tl.full((ROW_TILE,), float("-inf"), tl.float32), mask=cols < OUT_WIDTH)
    tl.debug_barrier()  # the -inf row is written before any thread writes a listed block's mass over it
    logical = tl.load(listed_ptr + b * s_ib + w, mask=w < WIDTH, other=-1)
    tl.store(out_ptr + b * s_ob + logical, total_mass, mask=(logical >= 0) & (logical < OUT_WIDTH))


def listed_scores(block_lse: torch.Tensor, listed: torch.Tensor, kv_heads: int, width: int,
                  check_values: bool | None = None) -> torch.Tensor:
    """fp32 [B, width]: each listed block's mass (block_lse fp32 [B, Hq, W], listed int32 [B, W] logical ids,
    distinct in a row, -1 = none) at its logical id, -inf elsewhere. Lists too long for one program's registers run
    the torch twin. The ids are checked where that costs no sync (value_checks.checks_values): the kernel drops an
    id past the row where the twin fails."""
    _check(block_lse, listed, kv_heads, width)
    if checks_values(check_values, block_lse.device):
        check_range("listed block ids", listed, -1, width)
    bsz, hq, w = block_lse.shape
    group = hq // kv_heads
    g_pad, w_pad = triton.next_power_of_2(group), triton.next_power_of_2(max(w, 1))
    if g_pad * w_pad > MAX_KERNEL_ELEMENTS:
        return listed_scores_reference(block_lse, listed, kv_heads, width)
    out = torch.empty(bsz, width, dtype=torch.float32, device=block_lse.device)
    if bsz == 0 or width == 0:
        return out
    _listed_scores_kernel[(bsz,)](block_lse, listed, out, block_lse.stride(0), block_lse.stride(1), listed.stride(0),
                                  out.stride(0), kv_heads, group, w, width, G_PAD=g_pad, W_PAD=w_pad,
                                  ROW_TILE=_ROW_TILE, num_warps=4 if g_pad * w_pad <= 4096 else 8)
    return out


def listed_scores_reference(block_lse: torch.Tensor, listed: torch.Tensor, kv_heads: int, width: int) -> torch.Tensor:
    """Torch twin of listed_scores: listed_mass, then on_the_list."""
    _check(block_lse, listed, kv_heads, width)
    return on_the_list(listed_mass(block_lse, kv_heads), listed, width)


def on_the_list(mass: torch.Tensor, listed: torch.Tensor, width: int) -> torch.Tensor:
    """The listed blocks' scores [B, W] at their logical ids in a row of `width` blocks, -inf for every other."""
    out = torch.full((mass.shape[0], width + 1), float("-inf"), device=mass.device)
    return out.scatter_(1, torch.where(listed >= 0, listed.long(), width), mass)[:, :width]  # -1: a spare column


def _check(block_lse, listed, kv_heads, width) -> None:
    if block_lse.dim() != 3 or block_lse.dtype != torch.float32 or block_lse.stride(2) != 1:
        raise ValueError(f"block_lse must be float32 [B, Hq, W], contiguous along W; got {block_lse.dtype} "
                         f"{tuple(block_lse.shape)}")
    bsz, hq, w = block_lse.shape
    if kv_heads < 1 or hq % kv_heads:
        raise ValueError(f"{hq} query heads do not split into {kv_heads} KV groups")
    if listed.dtype != torch.int32 or tuple(listed.shape) != (bsz, w) or listed.stride(1) != 1 \
            or listed.device != block_lse.device:
        raise ValueError(f"listed must be int32 {(bsz, w)} on {block_lse.device}, contiguous; got {listed.dtype} "
                         f"{tuple(listed.shape)} on {listed.device}")
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")


def compile_for(arch: int, group: int, width: int):
    """_listed_scores_kernel compiled ahead of time (kernels/aot.py) for a query group and list length."""
    from oasiskv.kernels.aot import compile_ahead

    g_pad, w_pad = triton.next_power_of_2(group), triton.next_power_of_2(width)
    pointers = {"lse_ptr": "*fp32", "listed_ptr": "*i32", "out_ptr": "*fp32"}
    return compile_ahead(_listed_scores_kernel, pointers, dict(G_PAD=g_pad, W_PAD=w_pad, ROW_TILE=_ROW_TILE), arch,
                         num_warps=4 if g_pad * w_pad <= 4096 else 8)
