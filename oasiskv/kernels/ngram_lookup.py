"""Prompt lookup on the device: each decode row's draft token, from a paged pool of the tokens themselves.

    pool[block, offset] = the token at that place of the request whose block table names `block`
    (int32 [num_blocks, block_size]: the KV cache's layout, one int per token instead of its K/V)

Row b's context c is its first lengths[b] tokens, found through tables[b] as attention finds their K/V.
The draft is the token after the latest earlier occurrence of c's longest matching suffix: for n from
max_n down to min_n (n <= L - 1), the latest end e in [n, L - 1] with c[e - n:e] == c[L - n:L] gives c[e];
with no occurrence at all, c[L - 1] (repeat). This is lookahead/ngram.py's NgramDraft.lookup, computed
from the tokens where the host keeps hash tables per request.

Why one scan finds it: a match of length m at end e is a match of every shorter length there, so the
longest n with any occurrence is max over e of m(e) (m capped at max_n), and its latest occurrence is the
largest e with that m. The kernel maximises m * 2^32 + e over the row, one program per row, BLOCK ends
at a time (H200, 2026-12-02, scripts/gpu_ngram_bench.py: 40 us for 16 rows of 16K tokens; splitting each row
over several programs would use more than 16 SMs). Without CUDA: under TRITON_INTERPRET=1 the kernel runs on CPU
tensors (tests); otherwise the torch reference runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.value_checks import check_range, check_table_reads, checks_values, interpreted

__all__ = ["ngram_lookup", "ngram_lookup_reference", "write_step_tokens"]


@triton.jit
def _ngram_kernel(pool_ptr, tables_ptr, lens_ptr, out_ptr, s_table,
                  BS: tl.constexpr, MAX_N: tl.constexpr, MIN_N: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n_tok = tl.load(lens_ptr + b).to(tl.int64)
    table = tables_ptr + b * s_table
    best = tl.full([BLOCK], -1, tl.int64)
    for start in range(1, n_tok, BLOCK):
        ends = start + tl.arange(0, BLOCK).to(tl.int64)
        alive = ends <= n_tok - 1
        matched = tl.zeros([BLOCK], tl.int64)
        for k in tl.static_range(1, MAX_N + 1):
            j = ends - k  # the occurrence's k-th token from its end
            s = tl.maximum(n_tok - k, 0)  # the suffix's k-th token from its end (a scalar)
            live = alive & (j >= 0)  # (so k <= e <= L - 1: the suffix fits too)
            blk = tl.load(table + j // BS, mask=live, other=0).to(tl.int64)
            tok = tl.load(pool_ptr + blk * BS + j % BS, mask=live, other=-1)
            s_blk = tl.load(table + s // BS).to(tl.int64)
            suffix = tl.load(pool_ptr + s_blk * BS + s % BS)
            alive = live & (tok == suffix)
            matched += alive.to(tl.int64)
        score = tl.where(matched >= MIN_N, matched * 4294967296 + ends, -1)
        best = tl.maximum(best, score)
    top = tl.max(best, axis=0)
    pick = tl.where(top >= 0, top % 4294967296, n_tok - 1)  # the follower's position, or the last token
    p_blk = tl.load(table + pick // BS).to(tl.int64)
    tl.store(out_ptr + b, tl.load(pool_ptr + p_blk * BS + pick % BS).to(tl.int64))


def _check(pool, tables, lengths, out, max_n, min_n) -> None:
    if pool.dim() != 2 or pool.dtype != torch.int32 or not pool.is_contiguous():
        raise ValueError(f"pool must be a contiguous int32 [blocks, block_size], got {pool.dtype} {tuple(pool.shape)}")
    if tables.dim() != 2 or tables.dtype not in (torch.int32, torch.int64) or tables.stride(1) != 1:
        raise ValueError(f"tables must be int32/int64 [B, width] with unit column stride, got {tables.dtype} "
                         f"{tuple(tables.shape)} strides {tables.stride()}")
    b = tables.shape[0]
    if lengths.shape != (b,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be int32/int64 [{b}], got {lengths.dtype} {tuple(lengths.shape)}")
    if out.shape != (b,) or out.dtype != torch.int64 or (b and out.stride(0) != 1):
        raise ValueError(f"out must be a contiguous int64 [{b}], got {out.dtype} {tuple(out.shape)}")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
    for name, t in (("tables", tables), ("lengths", lengths), ("out", out)):
        if t.device != pool.device:
            raise ValueError(f"{name} is on {t.device}, the pool on {pool.device}")


def ngram_lookup_reference(pool, tables, lengths, out, max_n: int = 3, min_n: int = 1) -> torch.Tensor:
    """Torch twin: every row's context gathered whole ([B, width * block_size]) and compared shifted."""
    _check(pool, tables, lengths, out, max_n, min_n)
    if tables.shape[0] == 0:
        return out
    context = pool[tables.long()].reshape(tables.shape[0], -1).long()  # [B, W]
    n_tok = lengths.long()[:, None]
    ends = torch.arange(context.shape[1], device=pool.device)[None, :]
    alive = (ends >= 1) & (ends <= n_tok - 1)
    matched = torch.zeros_like(context)
    for k in range(1, max_n + 1):
        j = ends - k
        suffix = context.gather(1, (n_tok - k).clamp(min=0))
        tok = context.gather(1, j.clamp(min=0).expand_as(context))
        alive = alive & (j >= 0) & (k <= n_tok - 1) & (tok == suffix)
        matched += alive.long()
    score = torch.where(matched >= min_n, matched * (1 << 32) + ends, -1).amax(1, keepdim=True)
    pick = torch.where(score >= 0, score % (1 << 32), n_tok - 1)
    out.copy_(context.gather(1, pick.clamp(max=context.shape[1] - 1)).squeeze(1))
    return out


def check_reads(pool, tables, lengths) -> None:
    """Each length within [1, the table's tokens] and each table entry it reaches within the pool."""
    bs = pool.shape[1]
    check_range("lengths", lengths, 1, tables.shape[1] * bs + 1)
    blocks = torch.arange(tables.shape[1], device=tables.device)[None, :].expand_as(tables)
    used = blocks < (lengths.long()[:, None] + bs - 1) // bs
    check_table_reads("tables", tables, torch.where(used, blocks, -1), pool.shape[0])


def ngram_lookup(pool, tables, lengths, out, max_n: int = 3, min_n: int = 1,
                 check_values: bool | None = None) -> torch.Tensor:
    """Writes row b's draft token into out[b] (int64 [B], e.g. the draft rows of a step's input ids). Every
    length must be at least 1 and every table entry a row reads a pool block: checked where that costs no sync
    (value_checks.checks_values), since the kernel would read outside the pool."""
    _check(pool, tables, lengths, out, max_n, min_n)
    if checks_values(check_values, pool.device):
        check_reads(pool, tables, lengths)
    interpret = interpreted() and not pool.is_cuda
    if not (pool.is_cuda or interpret):
        return ngram_lookup_reference(pool, tables, lengths, out, max_n, min_n)
    if tables.shape[0] == 0:
        return out
    block = 256 if interpret else 1024
    _ngram_kernel[(tables.shape[0],)](pool, tables, lengths, out, tables.stride(0), BS=pool.shape[1],
                                      MAX_N=max_n, MIN_N=min_n, BLOCK=block, num_warps=4)
    return out


def write_step_tokens(pool, blocks, offsets, tokens) -> None:
    """pool[blocks[i], offsets[i]] = tokens[i]: a step's input tokens into the pool, where their K/V go."""
    if not (blocks.shape == offsets.shape == tokens.shape) or blocks.dim() != 1:
        raise ValueError(f"blocks, offsets and tokens must be [T] each, got {tuple(blocks.shape)}, "
                         f"{tuple(offsets.shape)}, {tuple(tokens.shape)}")
    pool[blocks.long(), offsets.long()] = tokens.to(torch.int32)
