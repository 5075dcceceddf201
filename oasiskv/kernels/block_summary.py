"""Block summaries (Quest): per block and KV head, element-wise min and max of the block's keys.

Layouts (one layer):

- ``kv_layer``:  [num_blocks, 2, block_size, Hkv, D]; index 0 on dim 1 is K, 1 is V. Any strides.
- ``summaries``: [num_summary_blocks, 2, Hkv, D]; index 0 on dim 1 is the min, 1 the max.
  fp32, fp16 or bf16. Min/max are computed in fp32 and cast on store; when the summaries
  dtype is the keys' dtype (or wider) the cast is exact, so the Quest bound stays a bound.

``update_block_summaries`` recomputes the summary of each listed block over its first
``num_tokens[i]`` keys (or keys ``first_token[i] .. num_tokens[i] - 1``: a sub-block summary of
the block's last part, kv/summaries.py). It serves both engine cases with one call:

- after prefill: all the request's blocks (full blocks with ``block_size``, the tail with
  its fill);
- after a decode append: the tail block only, recomputed over its filled tokens (reading
  at most 16 keys per KV head: cheap, and exact, unlike an incremental min/max that cannot
  forget a reused block's old contents).

Dispatch: the Triton kernel runs on CUDA tensors, and on CPU tensors when this module was
imported with ``TRITON_INTERPRET=1`` (interpreter); otherwise the torch reference runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["update_block_summaries", "update_block_summaries_reference"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _block_summary_kernel(
    summaries_ptr,
    kv_ptr,
    block_ids_ptr,
    summary_ids_ptr,
    num_tokens_ptr,
    first_token_ptr,
    s_sum_blk,
    s_sum_kind,
    s_sum_head,
    s_sum_d,
    s_kv_blk,
    s_kv_tok,
    s_kv_head,
    s_kv_d,
    D,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_FIRST: tl.constexpr,
):
    # One program per (listed block, KV head): loads [block_size, D] keys, reduces over tokens.
    pid = tl.program_id(0)
    head = tl.program_id(1)
    blk = tl.load(block_ids_ptr + pid).to(tl.int64)  # int64: pool offsets can pass 2**31
    dst = tl.load(summary_ids_ptr + pid).to(tl.int64)
    n = tl.load(num_tokens_ptr + pid)
    first = tl.load(first_token_ptr + pid) if HAS_FIRST else 0

    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    mask = ((t >= first) & (t < n))[:, None] & d_mask[None, :]

    k_ptrs = kv_ptr + blk * s_kv_blk + head * s_kv_head + t[:, None] * s_kv_tok + d[None, :] * s_kv_d
    k = tl.load(k_ptrs, mask=mask, other=0.0).to(tl.float32)
    k_min = tl.min(tl.where(mask, k, float("inf")), axis=0)
    k_max = tl.max(tl.where(mask, k, float("-inf")), axis=0)

    out = summaries_ptr + dst * s_sum_blk + head * s_sum_head + d * s_sum_d
    out_ty = summaries_ptr.dtype.element_ty
    tl.store(out, k_min.to(out_ty), mask=d_mask)
    tl.store(out + s_sum_kind, k_max.to(out_ty), mask=d_mask)


def _check_args(summaries, kv_layer, block_ids, num_tokens, summary_ids, first_token=None):
    if summaries.dim() != 4 or summaries.shape[1] != 2:
        raise ValueError(f"summaries must be [num_blocks, 2, Hkv, D], got {tuple(summaries.shape)}")
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(
            f"kv_layer must be [num_blocks, 2, block_size, Hkv, D], got {tuple(kv_layer.shape)}"
        )
    if tuple(summaries.shape[2:]) != tuple(kv_layer.shape[3:]):
        raise ValueError(
            f"summaries (Hkv, D) = {tuple(summaries.shape[2:])} does not match "
            f"kv_layer (Hkv, D) = {tuple(kv_layer.shape[3:])}"
        )
    if summaries.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"summaries dtype must be fp32, fp16 or bf16, got {summaries.dtype}")
    if kv_layer.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"kv_layer dtype must be fp32, fp16 or bf16, got {kv_layer.dtype}")
    named = [("block_ids", block_ids), ("num_tokens", num_tokens), ("summary_ids", summary_ids)]
    for name, t in named + ([("first_token", first_token)] if first_token is not None else []):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
        if t.device != summaries.device:
            raise ValueError(f"{name} is on {t.device}, summaries on {summaries.device}")
    lengths = [t.shape[0] for _, t in named + ([("first_token", first_token)] if first_token is not None else [])]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"block_ids ({block_ids.shape[0]}), num_tokens ({num_tokens.shape[0]}), "
            f"summary_ids ({summary_ids.shape[0]}) and first_token must have the same length"
        )
    if kv_layer.device != summaries.device:
        raise ValueError(f"kv_layer is on {kv_layer.device}, summaries on {summaries.device}")


def _check_values(summaries, kv_layer, block_ids, num_tokens, summary_ids, first_token=None):
    if block_ids.numel() == 0:
        return
    block_size = kv_layer.shape[2]
    lo, hi = int(num_tokens.min()), int(num_tokens.max())
    if lo < 1 or hi > block_size:
        raise ValueError(f"num_tokens must be in [1, {block_size}], got values in [{lo}, {hi}]")
    if first_token is not None and (bool((first_token < 0).any()) or bool((first_token >= num_tokens).any())):
        raise ValueError("first_token must be in [0, num_tokens): every summary covers at least one key")
    lo, hi = int(block_ids.min()), int(block_ids.max())
    if lo < 0 or hi >= kv_layer.shape[0]:
        raise ValueError(f"block_ids must be in [0, {kv_layer.shape[0]}), got values in [{lo}, {hi}]")
    lo, hi = int(summary_ids.min()), int(summary_ids.max())
    if lo < 0 or hi >= summaries.shape[0]:
        raise ValueError(f"summary_ids must be in [0, {summaries.shape[0]}), got values in [{lo}, {hi}]")


def update_block_summaries_reference(
    summaries: torch.Tensor,
    kv_layer: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    *,
    summary_ids: torch.Tensor | None = None,
    first_token: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch twin of :func:`update_block_summaries` (same arguments, in place, returns ``summaries``)."""
    summary_ids = block_ids if summary_ids is None else summary_ids
    _check_args(summaries, kv_layer, block_ids, num_tokens, summary_ids, first_token)
    _check_values(summaries, kv_layer, block_ids, num_tokens, summary_ids, first_token)
    if block_ids.numel() == 0:
        return summaries
    keys = kv_layer[block_ids.long(), 0].float()  # [N, block_size, Hkv, D]
    t = torch.arange(kv_layer.shape[2], device=keys.device)
    filled = t[None, :] < num_tokens[:, None].long()
    if first_token is not None:
        filled &= t[None, :] >= first_token[:, None].long()
    filled = filled[:, :, None, None]
    k_min = torch.where(filled, keys, float("inf")).amin(dim=1)
    k_max = torch.where(filled, keys, float("-inf")).amax(dim=1)
    dst = summary_ids.long()
    summaries[dst, 0] = k_min.to(summaries.dtype)
    summaries[dst, 1] = k_max.to(summaries.dtype)
    return summaries


def _triton_runs(device: torch.device) -> bool:
    # The interpreter is chosen when triton.jit runs (module import), so ask the kernel object.
    return device.type == "cuda" or type(_block_summary_kernel).__name__ == "InterpretedFunction"


def update_block_summaries(
    summaries: torch.Tensor,
    kv_layer: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    *,
    summary_ids: torch.Tensor | None = None,
    first_token: torch.Tensor | None = None,
    check_values: bool | None = None,
) -> torch.Tensor:
    """Recompute the min/max key summaries of the listed blocks, in place.

    Args:
        summaries: [num_summary_blocks, 2, Hkv, D] fp32/fp16/bf16 (0 = min, 1 = max); written.
        kv_layer: [num_blocks, 2, block_size, Hkv, D] one layer's KV (K at index 0 of dim 1).
        block_ids: int32 [N], blocks of ``kv_layer`` to summarise (should be unique).
        num_tokens: int32 [N], filled tokens of each block, in [1, block_size]; the summary
            covers keys ``0 .. num_tokens[i]-1``.
        summary_ids: optional int32 [N], rows of ``summaries`` to write; default ``block_ids``
            (use it when GPU slots and summary rows are numbered differently).
        first_token: optional int32 [N] in [0, num_tokens): the summary covers keys
            ``first_token[i] .. num_tokens[i]-1`` instead (a sub-block summary).
        check_values: check id ranges and num_tokens (costs a device->host sync on CUDA).
            Default: check on CPU tensors only. Unchecked bad values on CUDA are undefined.

    Returns:
        ``summaries`` (for chaining).
    """
    summary_ids = block_ids if summary_ids is None else summary_ids
    if not _triton_runs(summaries.device):
        return update_block_summaries_reference(
            summaries, kv_layer, block_ids, num_tokens, summary_ids=summary_ids, first_token=first_token
        )
    _check_args(summaries, kv_layer, block_ids, num_tokens, summary_ids, first_token)
    if check_values if check_values is not None else summaries.device.type != "cuda":
        _check_values(summaries, kv_layer, block_ids, num_tokens, summary_ids, first_token)
    n = block_ids.shape[0]
    if n == 0:
        return summaries
    _, _, block_size, hkv, d = kv_layer.shape
    _block_summary_kernel[(n, hkv)](
        summaries,
        kv_layer,
        block_ids,
        summary_ids,
        num_tokens,
        num_tokens if first_token is None else first_token,  # not read without HAS_FIRST
        summaries.stride(0),
        summaries.stride(1),
        summaries.stride(2),
        summaries.stride(3),
        kv_layer.stride(0),
        kv_layer.stride(2),
        kv_layer.stride(3),
        kv_layer.stride(4),
        d,
        BLOCK_T=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(d),
        HAS_FIRST=first_token is not None,
        num_warps=2,
    )
    return summaries
