"""The shortlist's second pass (--shortlist): blocks ranked by the exact attention they get from the decode
query, in a softmax over the shortlisted keys alone.

Block summaries rank blocks by an estimate; the exact attention mass ranks them as well as any selection can
(the oracle mode), but over every key it reads the whole context. Here the summaries' score keeps a shortlist of
a few times the budget, and only those blocks' keys are read.

For decode row b, query head h and listed column w (logical block listed[b, w], -1 = none; its physical block
tables[b, listed[b, w]], -1 = not on the GPU, as in a working set's table: no keys):
  block_lse[b, h, w] = log sum_t exp(scale * q[b, h] . k_t)  over the block's keys t < seq_lens[b]
  (-inf where nothing is listed). The kernel writes these, one program per (row, KV head, chunk of COLS listed
  columns): it gathers the chunk's keys into one tile (each tile row finds its own physical block) and scores the
  KV head's group of query heads against it in one tl.dot, so each key is read once and the tensor cores do the
  products. listed_mass() turns them into each block's
  score: per head exp(block_lse - logsumexp over the row's columns), the best head of each KV group, summed over
  the groups (as quest and the oracle combine heads). The torch twin runs on the CPU; the tests check both
  against a float64 brute force."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.value_checks import check_range, checks_values

__all__ = ["fp8_key_copy", "listed_mass", "shortlist_block_lse", "shortlist_block_lse_reference"]


@triton.jit
def _block_lse_kernel(q_ptr, kv_ptr, tables_ptr, listed_ptr, lens_ptr, out_ptr, scale, ks_ptr,
                      s_qb, s_qh, s_kvb, s_kvt, s_kvh, s_tb, s_lb, s_ob, s_oh, s_ksb, s_kst, GROUP, D, WIDTH,
                      BLOCK: tl.constexpr, COLS: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr, WIDEN_F16: tl.constexpr = False):
    b, h, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, d = tl.arange(0, G_PAD), tl.arange(0, D_PAD)
    r = tl.arange(0, COLS * BLOCK)  # the key tile's rows: listed column chunk * COLS + r // BLOCK, token r % BLOCK
    col = chunk * COLS + r // BLOCK
    logical = tl.load(listed_ptr + b * s_lb + col, mask=col < WIDTH, other=-1)
    physical = tl.load(tables_ptr + b * s_tb + tl.maximum(logical, 0), mask=logical >= 0, other=-1).to(tl.int64)
    positions = logical * BLOCK + r % BLOCK
    valid = (logical >= 0) & (physical >= 0) & (positions < tl.load(lens_ptr + b))
    heads = h * GROUP + g
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=(g[:, None] < GROUP) & (d[None, :] < D),
                other=0.0)
    k = tl.load(kv_ptr + physical[:, None] * s_kvb + (r % BLOCK)[:, None] * s_kvt + h * s_kvh + d[None, :],
                mask=valid[:, None] & (d[None, :] < D), other=0.0)  # K: index 0 of dim 1
    if SCALED:  # fp8 keys: widened to q's dtype (or fp16: one conversion on sm_90), then each key's own scale
        if WIDEN_F16:
            logits = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))
        else:
            logits = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        key_scale = tl.load(ks_ptr + physical * s_ksb + (r % BLOCK) * s_kst + h, mask=valid, other=0.0)
        logits = logits * (key_scale[None, :] * scale)
    else:
        logits = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION) * scale  # [G_PAD, COLS * BLOCK]
    logits = tl.reshape(tl.where(valid[None, :], logits, float("-inf")), (G_PAD, COLS, BLOCK))
    top = tl.max(logits, axis=2)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty column: log(0) = -inf below, not nan
    lse = top + tl.log(tl.sum(tl.exp(logits - top[:, :, None]), axis=2))  # [G_PAD, COLS]
    cols = chunk * COLS + tl.arange(0, COLS)
    tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + cols[None, :], lse,
             mask=(g[:, None] < GROUP) & (cols[None, :] < WIDTH))


def shortlist_block_lse(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, listed: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, cols: int | None = None,
                        fp8_keys: tuple[torch.Tensor, torch.Tensor] | None = None, widen_f16: bool = False,
                        num_warps: int = 4) -> torch.Tensor:
    """fp32 [B, Hq, W]: per query head, the log-sum-exp of its logits over each listed block's keys.
    q [B, Hq, D]; kv_layer [blocks, 2, block_size, Hkv, D]; tables int32 [B, max_blocks] (logical -> physical);
    listed int32 [B, W] logical ids, -1 = none; seq_lens int32 [B], the new token included. `cols`: listed blocks
    per program (a power of two; default: a key tile of 128 rows). `fp8_keys`: (keys float8_e4m3fn [blocks,
    block_size, Hkv, D], scales fp32 [blocks, block_size, Hkv]) as fp8_key_copy makes them, read in place of
    kv_layer's keys (half the bytes); `widen_f16`: their product in fp16 rather than q's dtype (q must fit fp16's
    range: nothing checks it)."""
    _check(q, kv_layer, tables, listed, seq_lens)
    _check_fp8(kv_layer, fp8_keys)
    bsz, hq, d = q.shape
    _, _, block, hkv, _ = kv_layer.shape
    if block & (block - 1):
        raise ValueError(f"the block size must be a power of two, got {block}")
    if checks_values(None, q.device):  # on CPU tensors (the interpreter): a sync per call on CUDA
        _check_values(kv_layer, tables, listed)
    width = listed.shape[1]
    out = torch.empty(bsz, hq, width, dtype=torch.float32, device=q.device)
    if bsz == 0 or width == 0:
        return out
    cols = cols or _tile_cols(block, width)
    if cols & (cols - 1) or cols * block < 16:
        raise ValueError(f"cols must be a power of two with cols x block_size >= 16 (tl.dot), got {cols} x {block}")
    group = hq // hkv
    keys, key_scales = fp8_keys or (kv_layer, out)  # out: an unread stand-in for the scales
    strides = (keys.stride(0), keys.stride(1), keys.stride(2)) if fp8_keys else \
        (kv_layer.stride(0), kv_layer.stride(2), kv_layer.stride(3))
    seq_lens = seq_lens.contiguous()  # read as seq_lens[b]
    _block_lse_kernel[(bsz, hkv, triton.cdiv(width, cols))](
        q, keys, tables, listed, seq_lens, out, scale, key_scales,
        q.stride(0), q.stride(1), *strides, tables.stride(0), listed.stride(0), out.stride(0), out.stride(1),
        key_scales.stride(0) if fp8_keys else 0, key_scales.stride(1) if fp8_keys else 0, group, d, width,
        **_meta(block, cols, group, d, q.dtype == torch.float32), SCALED=fp8_keys is not None,
        WIDEN_F16=widen_f16 and fp8_keys is not None, num_warps=num_warps)
    return out


def _tile_cols(block: int, width: int) -> int:
    """Listed blocks per program: a 128-row key tile, fewer for a short list, at least the 16 rows tl.dot needs."""
    return max(triton.cdiv(16, block), min(triton.next_power_of_2(max(1, 128 // block)),
                                           triton.next_power_of_2(width)))


def _meta(block: int, cols: int, group: int, head_dim: int, fp32: bool) -> dict:
    return dict(BLOCK=block, COLS=cols, G_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot's M >= 16
                D_PAD=max(16, triton.next_power_of_2(head_dim)), DOT_PRECISION="ieee" if fp32 else "tf32")


def shortlist_block_lse_reference(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor,
                                  listed: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                  fp8_keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Torch twin of shortlist_block_lse (fixed shapes, no host sync)."""
    _check(q, kv_layer, tables, listed, seq_lens)
    _check_fp8(kv_layer, fp8_keys)
    bsz, hq, d = q.shape
    _, _, block, hkv, _ = kv_layer.shape
    physical = tables.long().gather(1, listed.long().clamp(min=0))  # [B, W]
    if fp8_keys:
        keys = fp8_keys[0][physical.clamp(min=0)].float() * fp8_keys[1][physical.clamp(min=0)][..., None]
    else:
        keys = kv_layer[physical.clamp(min=0), 0].float()  # [B, W, block, Hkv, D]
    logits = torch.einsum("bhgd,bwthd->bhgwt", q.float().view(bsz, hkv, hq // hkv, d), keys) * scale
    positions = listed.long()[:, :, None] * block + torch.arange(block, device=q.device)
    valid = (listed[:, :, None] >= 0) & (positions < seq_lens.long()[:, None, None]) & (physical[:, :, None] >= 0)
    logits = logits.masked_fill(~valid[:, None, None], float("-inf"))
    return torch.logsumexp(logits, -1).reshape(bsz, hq, listed.shape[1])


def fp8_key_copy(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_layer [blocks, 2, block_size, Hkv, D] -> its keys as float8 e4m3 [blocks, block_size, Hkv, D] and one fp32
    scale per token and KV head [blocks, block_size, Hkv] (the token's largest |k| maps to e4m3's largest, 448): the
    copy shortlist_block_lse(fp8_keys=...) reads. A scale per token is what a write of one token can keep; in the
    twin (docs/ACCURACY.md, "The list pass over fp8 keys") such keys ranked the list as the exact keys did."""
    keys = kv_layer[:, 0].float()
    scales = keys.abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (keys / scales[..., None]).to(torch.float8_e4m3fn), scales


def listed_mass(block_lse: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, W] -> fp32 [B, W]: each listed block's attention mass in a softmax over the listed keys alone, the
    best query head of each KV group, summed over the groups (0 where nothing is listed)."""
    total = torch.logsumexp(block_lse, -1, keepdim=True)
    mass = torch.where(block_lse > float("-inf"), (block_lse - total).exp(), torch.zeros_like(block_lse))
    bsz, hq, width = mass.shape
    return mass.view(bsz, kv_heads, hq // kv_heads, width).amax(2).sum(1)


def _check(q, kv_layer, tables, listed, seq_lens) -> None:
    if q.dim() != 3 or kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(f"q must be [B, Hq, D] and kv_layer [blocks, 2, block_size, Hkv, D], got "
                         f"{tuple(q.shape)} and {tuple(kv_layer.shape)}")
    bsz, hq, d = q.shape
    hkv = kv_layer.shape[3]
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or kv_layer.dtype != q.dtype:
        raise ValueError(f"q and kv_layer must share one of float16, bfloat16, float32; got {q.dtype} and "
                         f"{kv_layer.dtype}")
    if hq % hkv or kv_layer.shape[4] != d:
        raise ValueError(f"q [B, {hq}, {d}] does not fit kv_layer's {hkv} KV heads x head_dim {kv_layer.shape[4]}")
    for name, t, dims in (("tables", tables, 2), ("listed", listed, 2), ("seq_lens", seq_lens, 1)):
        if t.dim() != dims or t.dtype != torch.int32 or t.shape[0] != bsz or t.device != q.device:
            raise ValueError(f"{name} must be int32 with {dims} dimension(s), {bsz} rows, on {q.device}; got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if kv_layer.device != q.device or kv_layer.stride(4) != 1 or q.stride(2) != 1:
        raise ValueError("q and kv_layer must be on one device and contiguous along head_dim")
    if tables.stride(1) != 1 or listed.stride(1) != 1:
        raise ValueError("tables and listed must be contiguous along their last dimension")


def _check_values(kv_layer, tables, listed) -> None:
    """Listed ids within the tables' width; their entries within the pool or -1 (a block not on the GPU)."""
    chosen = listed >= 0
    check_range("listed block ids", listed[chosen], 0, tables.shape[1])
    rows = torch.arange(len(tables), device=tables.device)[:, None].expand_as(listed)
    check_range("tables entries of listed blocks", tables[rows[chosen], listed[chosen].long()], -1,
                kv_layer.shape[0])


def _check_fp8(kv_layer, fp8_keys) -> None:
    if fp8_keys is None:
        return
    keys, scales = fp8_keys
    blocks, _, block, hkv, d = kv_layer.shape
    if keys.dtype != torch.float8_e4m3fn or tuple(keys.shape) != (blocks, block, hkv, d) or keys.stride(3) != 1:
        raise ValueError(f"fp8 keys must be float8_e4m3fn {(blocks, block, hkv, d)}, contiguous along head_dim; got "
                         f"{keys.dtype} {tuple(keys.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (blocks, block, hkv) or scales.stride(2) != 1:
        raise ValueError(f"fp8 key scales must be float32 {(blocks, block, hkv)}, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if keys.device != kv_layer.device or scales.device != kv_layer.device:
        raise ValueError("fp8 keys and scales must be on kv_layer's device")


def compile_for(arch: int, group: int, head_dim: int, block: int = 16, fp8: bool = False, widen_f16: bool = False):
    """_block_lse_kernel compiled ahead of time (kernels/aot.py) for a model's query group and head size; `fp8`:
    the variant that reads fp8_key_copy's keys (`widen_f16`: in fp16)."""
    from oasiskv.kernels.aot import compile_ahead

    pointers = {n: "*i32" for n in ("tables_ptr", "listed_ptr", "lens_ptr")}
    pointers.update(q_ptr="*bf16", kv_ptr="*fp8e4nv" if fp8 else "*bf16", out_ptr="*fp32", ks_ptr="*fp32")
    meta = dict(_meta(block, _tile_cols(block, 1 << 10), group, head_dim, fp32=False), SCALED=fp8,
                WIDEN_F16=widen_f16)
    return compile_ahead(_block_lse_kernel, pointers, meta, arch, num_warps=4, scalars={"scale": "fp32"})
