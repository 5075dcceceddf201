"""Sparse decode attention: one decode query per sequence attends only to its selected blocks.

Inputs (one layer):
  q            [B, Hq, D]                          the decode query of each sequence
  kv_layer     [num_slots, 2, block_size, Hkv, D]  one layer's view of the GPU pool (dim 1: 0 = K, 1 = V)
  block_tables int32 [B, max_blocks]                logical block j of sequence b -> physical slot
                                                   (entries of blocks that are not selected may be -1)
  sel_indptr   int32 [B + 1], sel_indices int32 [nnz]
                                                   CSR list of the selected LOGICAL block ids of each
                                                   sequence (ascending by convention; the result does
                                                   not depend on the order; -1 entries are skipped)
  or, for sparse_decode_attention_padded, selection int32 [B, K]: the same ids as a padded table,
  and optionally table_rows int [B]: sequence b's table is block_tables[table_rows[b]] (block_tables
  then has any number of rows: a working set's slot table is read in place, with no gathered copy)
  seq_lens     int32 [B]                           valid tokens; logical block j holds
                                                   min(block_size, seq_len - j * block_size) of them
Output [B, Hq, D] in q's dtype. Query head h reads KV head h // (Hq // Hkv); all query heads of a
sequence share its selection. A sequence with an empty selection gets a zero output.

Several queries per sequence (padded form, ``num_queries`` = n > 1): q holds n rows per sequence,
stacked [n * B, Hq, D] (every sequence's first query, then every second one...), and query i of
sequence b attends to the same selected blocks but sees their first seq_lens[b] + i tokens: the
queries sit at consecutive positions, as oasis's x_t and its draft one past it. The K/V of each
selected block are read once for all n queries (they share the program's rows of tl.dot).

GPU design (split-K flash decoding): the grid is (batch, kv head, split). Each program serves all
query heads of one GQA group (padded to >= 16 rows, the M dimension of tl.dot), walks its share of the
sequence's CSR list a few blocks at a time with an online softmax in fp32 and writes a partial output
plus its log-sum-exp; a second kernel merges the splits. With a single split the first kernel writes
the normalised output directly. The number of splits is chosen on the host from nnz / B (no device
sync) so that the grid fills the GPU; each program divides its own sequence's list, so any
distribution of selection lengths is handled correctly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.device_info import num_sms
from oasiskv.kernels.value_checks import check_range, checks_values, interpreted

__all__ = ["sparse_decode_attention", "sparse_decode_attention_padded", "sparse_decode_padded_reference",
           "sparse_decode_reference"]

_LOG2E = 1.4426950408889634


@triton.jit
def _sparse_decode_split_kernel(
    q_ptr, kv_ptr, bt_ptr, trows_ptr, indptr_ptr, indices_ptr, seqlen_ptr, ws_ptr, out_ptr,
    qk_scale,      # softmax scale * log2(e)
    num_seqs,      # B: query i of sequence b is row i * B + b of q / out
    num_splits,
    lse_off,       # where the log-sum-exps start in the fp32 workspace
    stride_slot,   # kv_layer.stride(0); the rest of kv_layer is contiguous
    stride_bt,     # block_tables.stride(0)
    HQ: tl.constexpr, GROUP: tl.constexpr, NQ: tl.constexpr, G_PAD: tl.constexpr, HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr, PADDED: tl.constexpr,
    ROW_INDIRECT: tl.constexpr,
):
    # Few runtime arguments on purpose: Triton's per-launch host cost grows with their number.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    T: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_ITER
    STRIDE_KV: tl.constexpr = BLOCK_SIZE * HKV * HEAD_DIM
    STRIDE_TOK: tl.constexpr = HKV * HEAD_DIM

    if PADDED:  # indices is a [B, num_cols] table, -1 = skip (indptr_ptr holds num_cols)
        sel_begin = b * indptr_ptr
        sel_end = sel_begin + indptr_ptr
    else:
        sel_begin = tl.load(indptr_ptr + b)
        sel_end = tl.load(indptr_ptr + b + 1)
    n_sel = sel_end - sel_begin
    per_split = (n_sel + num_splits - 1) // num_splits
    my_begin = sel_begin + split * per_split
    my_end = tl.minimum(my_begin + per_split, sel_end)
    seq_len = tl.load(seqlen_ptr + b)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, T)
    g_mask = g < NQ * GROUP
    d_mask = d < HEAD_DIM
    query = g // GROUP  # program row g: head g % GROUP of the sequence's query `query`
    rows = (query * num_seqs + b) * HQ + kvh * GROUP + g % GROUP  # (query row, head) rows of q / out
    qo_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=qo_mask, other=0.0)

    t_blk = t // BLOCK_SIZE  # which of this iteration's blocks a token row belongs to
    t_tok = t % BLOCK_SIZE   # token within its block
    head_off = kvh * HEAD_DIM + d[None, :]
    if ROW_INDIRECT:  # sequence b's block-table row is table_rows[b]
        table_row = tl.load(trows_ptr + b).to(tl.int64)
    else:
        table_row = b.to(tl.int64)
    bt_row = bt_ptr + table_row * stride_bt

    m_i = tl.full([G_PAD], -1.0e38, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)

    # block ids of the first iteration; with PREFETCH the loop loads the next iteration's ids while
    # this iteration's K/V are in flight, so the chain indices -> block table -> K/V is not paid
    # serially every iteration
    sel_pos = my_begin + t_blk
    logical = tl.load(indices_ptr + sel_pos, mask=sel_pos < my_end, other=-1)
    row_ok = logical >= 0
    slot = tl.load(bt_row + logical, mask=row_ok, other=0)
    for it in range(my_begin, my_end, BLOCKS_PER_ITER):
        if not PREFETCH:
            sel_pos = it + t_blk
            logical = tl.load(indices_ptr + sel_pos, mask=sel_pos < my_end, other=-1)
            row_ok = logical >= 0
            slot = tl.load(bt_row + logical, mask=row_ok, other=0)
        pos = logical * BLOCK_SIZE + t_tok
        tok_ok = row_ok & (pos < seq_len + NQ - 1)  # seen by the last query
        row_off = slot.to(tl.int64) * stride_slot + t_tok * STRIDE_TOK
        ld_mask = tok_ok[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + row_off[:, None] + head_off, mask=ld_mask, other=0.0)
        v = tl.load(kv_ptr + STRIDE_KV + row_off[:, None] + head_off, mask=ld_mask, other=0.0)
        if PREFETCH:
            sel_pos = it + BLOCKS_PER_ITER + t_blk
            logical = tl.load(indices_ptr + sel_pos, mask=sel_pos < my_end, other=-1)
            row_ok = logical >= 0
            slot = tl.load(bt_row + logical, mask=row_ok, other=0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(tok_ok[None, :] & (pos[None, :] < seq_len + query[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if DIRECT:
        tl.store(out_ptr + rows[:, None] * HEAD_DIM + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        part = rows * num_splits + split  # workspace row: [NQ * B * HQ, num_splits]
        tl.store(ws_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=qo_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # -inf: split saw no token
        tl.store(ws_ptr + lse_off + part, lse, mask=g_mask)


@triton.jit
def _sparse_decode_merge_kernel(
    ws_ptr, out_ptr, num_splits, lse_off,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    row = tl.program_id(0)  # (sequence, query head)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    part = row * num_splits + s
    lse = tl.load(ws_ptr + lse_off + part, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    o = tl.load(ws_ptr + part[:, None] * HEAD_DIM + d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(o * w[:, None], axis=0)
    den = tl.sum(w, axis=0)
    den = tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + d, (num / den).to(out_ptr.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------------------------
# launcher


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreted()




def _check_inputs(q, kv_layer, block_tables, sel_indptr, sel_indices, seq_lens, out, table_rows=None):
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(
            f"kv_layer must be [num_slots, 2, block_size, Hkv, D], got shape {tuple(kv_layer.shape)}")
    B, Hq, D = q.shape
    _, _, block_size, Hkv, Dk = kv_layer.shape
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q has {D}, kv_layer has {Dk}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv})")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if kv_layer.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q is {q.dtype}, kv_layer is {kv_layer.dtype}")
    if any(st != want for st, want, n in zip(kv_layer.stride()[1:], (block_size * Hkv * D, Hkv * D, D, 1),
                                          kv_layer.shape[1:]) if n > 1):
        raise ValueError("kv_layer must be contiguous within a slot ([2, block_size, Hkv, D]); "
                         f"got strides {kv_layer.stride()}")
    if kv_layer.device != q.device:
        raise ValueError(f"device mismatch: q on {q.device}, kv_layer on {kv_layer.device}")
    for name, t, shape in (
        ("block_tables", block_tables, None),
        ("sel_indptr", sel_indptr, (B + 1,)),
        ("sel_indices", sel_indices, None),
        ("seq_lens", seq_lens, (B,)),
    ):
        if t is None:  # no indptr: the padded form
            continue
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if table_rows is not None:
        if table_rows.shape != (B,) or table_rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"table_rows must be int [B={B}], got {table_rows.dtype} {tuple(table_rows.shape)}")
        if table_rows.device != q.device:
            raise ValueError(f"table_rows is on {table_rows.device}, q on {q.device}")
        if block_tables.dim() != 2:
            raise ValueError(f"block_tables must be [rows, max_blocks], got {tuple(block_tables.shape)}")
    elif block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [B={B}, max_blocks], got {tuple(block_tables.shape)}")
    if sel_indices.dim() != 1:
        raise ValueError(f"sel_indices must be 1-D, got shape {tuple(sel_indices.shape)}")
    if out is not None:
        if tuple(out.shape) != (B, Hq, D) or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must be {(B, Hq, D)} {q.dtype} on {q.device}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return B, Hq, D, block_size, Hkv


def _check_values(kv_layer, block_tables, table_rows, seq_of, ids, seq_lens, num_queries: int) -> None:
    """The kernel loads the table entry of every selected id (seq_of: the sequence of each), and the K/V of those
    that hold a token its last query sees: ids within the table's width, those entries within the pool."""
    if table_rows is not None:
        check_range("table_rows", table_rows, 0, len(block_tables))
        row_of = table_rows.long()[seq_of]
    else:
        row_of = seq_of
    chosen = ids >= 0
    check_range("selected block ids", ids[chosen], 0, block_tables.shape[1])
    read = chosen & (ids.long() * kv_layer.shape[2] < seq_lens.long()[seq_of] + num_queries - 1)
    check_range("block_tables entries of selected blocks", block_tables[row_of[read], ids[read].long()], 0,
                kv_layer.shape[0])


def _choose_num_splits(B: int, Hkv: int, nnz: int, blocks_per_iter: int, device) -> int:
    """Enough (batch, kv head, split) programs to fill the GPU about 3 times (best on the H200 at
    B = 1 / 8 / 32, see oasiskv/bench/kernel_tiered.py), never more splits than
    the average selection has iterations. Uses only host-side sizes (no device sync)."""
    if B == 0:
        return 1
    avg_iters = max(1, triton.cdiv(triton.cdiv(nnz, B), blocks_per_iter))
    want = triton.cdiv(3 * num_sms(device), B * Hkv)
    return max(1, min(want, avg_iters, 64))


def sparse_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    sel_indptr: torch.Tensor,
    sel_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    **tuning,
) -> torch.Tensor:
    """Attention of each sequence's decode query over its selected blocks (see module docstring).

    Runs the Triton kernels for CUDA tensors or under TRITON_INTERPRET=1, else the torch reference.
    `tuning`: `num_splits`, `blocks_per_iter`, `num_warps`, `num_stages`, `prefetch` (defaults chosen
    from the shapes). The launch never synchronises with the device; it is CUDA-graph safe as long
    as nnz and B (hence num_splits) stay the same, or num_splits is given.
    """
    _check_inputs(q, kv_layer, block_tables, sel_indptr, sel_indices, seq_lens, out)
    if not _use_triton(q):
        result = sparse_decode_reference(q, kv_layer, block_tables, sel_indptr, sel_indices, seq_lens, scale)
        return result if out is None else out.copy_(result)
    return _launch(q, kv_layer, block_tables, sel_indptr.contiguous(), sel_indices.contiguous(), seq_lens, scale,
                   out, padded=False, **tuning)


def sparse_decode_attention_padded(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    selection: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_queries: int = 1,
    table_rows: torch.Tensor | None = None,
    **tuning,
) -> torch.Tensor:
    """sparse_decode_attention with the selection as a padded table: `selection` int32 [B, K] of
    logical block ids, -1 = none (anywhere in a row, in any order). No CSR conversion is needed.
    num_queries: q rows per sequence, stacked [num_queries * B, Hq, D] (module docstring).
    table_rows: int [B], the row of block_tables that holds each sequence's table (default: row b)."""
    nseq = _check_queries(q, selection, num_queries)
    flat = selection.contiguous().view(-1)
    if not _use_triton(q):
        result = sparse_decode_padded_reference(q, kv_layer, block_tables, selection, seq_lens, scale,
                                                num_queries=num_queries, table_rows=table_rows)
        return result if out is None else out.copy_(result)
    _check_inputs(q[:nseq], kv_layer, block_tables, None, flat, seq_lens, None, table_rows)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return _launch(q, kv_layer, block_tables, selection.shape[1], flat, seq_lens, scale, out, padded=True,
                   num_queries=num_queries, table_rows=table_rows, **tuning)


def _check_queries(q: torch.Tensor, selection: torch.Tensor, num_queries: int) -> int:
    """The number of sequences B, once q holds num_queries rows for each of selection's B rows."""
    if num_queries < 1:
        raise ValueError(f"num_queries must be >= 1, got {num_queries}")
    if q.dim() != 3 or q.shape[0] % num_queries:
        raise ValueError(f"q must be [num_queries * B, Hq, D] with num_queries={num_queries}, "
                         f"got shape {tuple(q.shape)}")
    nseq = q.shape[0] // num_queries
    if selection.dim() != 2 or selection.shape[0] != nseq:
        raise ValueError(f"selection must be [B={nseq}, K], got shape {tuple(selection.shape)}")
    return nseq


def sparse_decode_padded_reference(q, kv_layer, block_tables, selection, seq_lens, scale, out=None,
                                   num_queries: int = 1, table_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of sparse_decode_attention_padded (through the CSR form; syncs with the device).
    Query i of a sequence attends to the selected blocks that hold any of its seq_len + i tokens."""
    nseq = _check_queries(q, selection, num_queries)
    if table_rows is not None:
        block_tables = block_tables[table_rows.long()]
    parts = []
    for i in range(num_queries):
        lens = seq_lens + i
        starts = selection.long() * kv_layer.shape[2]
        keep = (selection >= 0) & (starts < lens[:, None].long())
        indptr = torch.zeros(nseq + 1, dtype=torch.int32, device=selection.device)
        indptr[1:] = torch.cumsum(keep.sum(1), 0)
        parts.append(sparse_decode_reference(q[i * nseq:(i + 1) * nseq], kv_layer, block_tables, indptr,
                                             selection[keep].to(torch.int32), lens.to(torch.int32), scale))
    result = parts[0] if num_queries == 1 else torch.cat(parts)
    return result if out is None else out.copy_(result)


def _launch(q, kv_layer, block_tables, indptr_arg, sel_indices, seq_lens, scale, out, *, padded: bool,
            num_queries: int = 1, table_rows: torch.Tensor | None = None, num_splits: int | None = None,
            blocks_per_iter: int | None = None, num_warps: int = 4,
            num_stages: int = 2, prefetch: bool = True) -> torch.Tensor:
    """Launches the kernels; `indptr_arg` is the CSR indptr tensor, or with `padded` the table's width."""
    rows, Hq, D = q.shape
    B = rows // num_queries  # sequences
    _, _, block_size, Hkv, _ = kv_layer.shape
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    if checks_values(None, q.device):  # on CPU tensors (the interpreter) only: a sync per call on CUDA
        if not padded and (int(indptr_arg[0]) != 0 or int(indptr_arg[-1]) > sel_indices.numel()
                           or bool((indptr_arg.diff() < 0).any())):
            raise ValueError(f"sel_indptr must rise from 0 to at most sel_indices' {sel_indices.numel()} entries, "
                             f"got {indptr_arg.tolist()}")
        seq_of = (torch.arange(B, device=q.device).repeat_interleave(indptr_arg) if padded else
                  torch.repeat_interleave(torch.arange(B, device=q.device), indptr_arg.diff().long()))
        _check_values(kv_layer, block_tables, table_rows, seq_of, sel_indices[:len(seq_of)], seq_lens, num_queries)
    if sel_indices.numel() == 0:  # nothing selected anywhere: tl.load needs a valid pointer
        out.zero_()
        return out

    group = Hq // Hkv
    g_pad = max(16, triton.next_power_of_2(num_queries * group))
    d_pad = max(16, triton.next_power_of_2(D))
    if blocks_per_iter is None:
        blocks_per_iter = max(1, 64 // block_size)
    blocks_per_iter = max(blocks_per_iter, triton.cdiv(16, block_size))  # tl.dot needs N >= 16
    if blocks_per_iter & (blocks_per_iter - 1):
        raise ValueError(f"blocks_per_iter must be a power of two, got {blocks_per_iter}")
    if num_splits is None:
        num_splits = _choose_num_splits(B, Hkv, sel_indices.numel(), blocks_per_iter, q.device)
    num_splits = max(1, int(num_splits))
    direct = num_splits == 1

    # the kernels index q / out / block-table rows / selection arrays as contiguous (no-ops when they are)
    q = q.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    dst = out if out.is_contiguous() else torch.empty_like(q)

    if direct:
        ws, lse_off = dst, 0  # placeholder: unused
    else:
        lse_off = rows * Hq * num_splits * D
        ws = torch.empty(lse_off + rows * Hq * num_splits, dtype=torch.float32, device=q.device)

    indirect = table_rows is not None
    _sparse_decode_split_kernel[(B, Hkv, num_splits)](
        q, kv_layer, block_tables, table_rows.contiguous() if indirect else seq_lens, indptr_arg, sel_indices,
        seq_lens, ws, dst,
        float(scale) * _LOG2E, B, num_splits, lse_off, kv_layer.stride(0), block_tables.stride(0),
        HQ=Hq, GROUP=group, NQ=num_queries, G_PAD=g_pad, HKV=Hkv, HEAD_DIM=D, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCKS_PER_ITER=blocks_per_iter,
        DIRECT=direct, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PREFETCH=prefetch, PADDED=padded, ROW_INDIRECT=indirect, num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        _sparse_decode_merge_kernel[(rows * Hq,)](
            ws, dst, num_splits, lse_off,
            HEAD_DIM=D, D_PAD=d_pad, S_PAD=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4 if d_pad >= 128 else 2,
        )
    if dst is not out:
        out.copy_(dst)
    return out


# ----------------------------------------------------------------------------------------------
# torch reference


def sparse_decode_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    sel_indptr: torch.Tensor,
    sel_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch twin of sparse_decode_attention: per sequence, one vectorised gather of the selected
    blocks, fp32 scores/softmax/accumulation, output in q's dtype. Works on any device."""
    B, Hq, D, block_size, Hkv = _check_inputs(
        q, kv_layer, block_tables, sel_indptr, sel_indices, seq_lens, out)
    group = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    indptr = sel_indptr.tolist()
    lens = seq_lens.tolist()
    indices = sel_indices.long()
    tok = torch.arange(block_size, device=q.device)
    for b in range(B):
        lo, hi = indptr[b], indptr[b + 1]
        logical = indices[lo:hi]
        logical = logical[logical >= 0]
        if len(logical) == 0:
            out[b].zero_()
            continue
        slots = block_tables[b].long()[logical]
        kv = kv_layer[slots].float()  # [n, 2, bs, Hkv, D]
        valid = ((logical[:, None] * block_size + tok[None, :]) < lens[b]).reshape(-1)
        if not valid.any():  # a selection with no valid token
            out[b].zero_()
            continue
        # only the valid rows: a slot's stale rows past seq_len may hold anything (0 x inf is NaN)
        k = kv[:, 0].reshape(-1, Hkv, D)[valid]
        v = kv[:, 1].reshape(-1, Hkv, D)[valid]
        qb = q[b].float().view(Hkv, group, D)
        p = torch.softmax(torch.einsum("hgd,thd->hgt", qb, k) * scale, dim=-1)
        o = torch.einsum("hgt,thd->hgd", p, v)
        out[b] = o.reshape(Hq, D).to(q.dtype)
    return out
