"""Block selection (Quest): upper-bound scores over block summaries, then the selection.

Score. For one decode query per sequence, query head ``h`` and its KV head ``g = h // group``
(``group = Hq // Hkv``), the Quest upper bound of ``q_h . k`` over the keys of a block is

    score_h(block) = sum_d max(q[h, d] * min[g, d], q[h, d] * max[g, d])

with ``min``/``max`` the block's summary. One transfer serves all heads, so the engine needs
ONE score per (sequence, block); it is defined as

    score(block) = sum_g  max_{h in group g}  score_h(block)

i.e. the best query head of each KV-head group, summed over KV heads. Scores may be negative.
Logical blocks ``j >= num_blocks_per_seq[b]`` score ``-inf``.

Sub-block summaries (``parts`` > 1, kv/summaries.py): block ``b``'s summaries are rows ``b * parts ..
b * parts + parts - 1``, and ``score_h(block)`` is the best of its sub-blocks' bounds (a tighter upper
bound), taken per KV head before the sum over KV heads.

Several queries per sequence (:func:`block_scores_multi`): q [NQ, B, Hq, D], each query its own
block count (``num_blocks`` int32 [NQ, B]), all against the same block table. Each program loads
a tile of summaries once per KV head and scores every query against it, so NQ queries cost one
read of the summaries instead of NQ (oasis scores x_t and its draft token this way). Each query's
scores are computed with the same fp32 operations, in the same order, as a one-query launch: they
are bit-identical to separate :func:`block_scores` calls, which is the ``NQ = 1`` case.

Which blocks those scores select: kernels/selection_rule.py (torch) and kernels/block_topk.py (its kernel).

Dispatch of :func:`block_scores` and :func:`block_scores_multi`: the Triton kernel runs on CUDA
tensors, and on CPU tensors when this module was imported with ``TRITON_INTERPRET=1``; otherwise
the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.value_checks import checks_values

__all__ = ["block_scores", "block_scores_multi", "block_scores_multi_reference", "block_scores_reference"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_N = 32  # logical blocks per program


@triton.jit
def _block_scores_kernel(
    q_ptr,
    summaries_ptr,
    block_tables_ptr,
    num_blocks_ptr,
    scores_ptr,
    s_q_n,
    s_q_b,
    s_q_h,
    s_q_d,
    s_sum_blk,
    s_sum_kind,
    s_sum_head,
    s_sum_d,
    s_bt_b,
    s_bt_j,
    s_nb_n,
    s_nb_b,
    s_out_n,
    s_out_b,
    s_out_j,
    max_blocks,
    D,
    NQ: tl.constexpr,
    NQ_POW2: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PARTS: tl.constexpr,
):
    # Grid (batch, tile of BLOCK_N summary rows: BLOCK_N / PARTS blocks). Each program reads the summaries of BLOCK_N
    # sub-blocks (blocks when PARTS = 1) for every KV head
    # once and scores them for all NQ queries. Per KV head g and query, the group's query heads are the
    # rows of one tile (row r: head g * GROUP + r, always at the same rows, so a query's scores do not
    # depend on NQ), and
    #   score_h = sum_d max(q_hd * mn_d, q_hd * mx_d) = q_h+ . mx + q_h- . mn     (mn <= mx)
    # is two dot products on the tensor cores; the group's best head is a max over the rows, and a block's
    # score per KV head the max over its PARTS sub-blocks.
    BLOCKS: tl.constexpr = BLOCK_N // PARTS
    b = tl.program_id(0)
    tile = tl.program_id(1)
    j = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # summary rows of the blocks' parts
    blk = j // PARTS
    jb = tile * BLOCKS + tl.arange(0, BLOCKS)  # the tile's blocks
    n = tl.arange(0, NQ_POW2)
    counts = tl.load(num_blocks_ptr + n * s_nb_n + b * s_nb_b, mask=n < NQ, other=0)
    valid = (jb[None, :] < counts[:, None]) & (jb[None, :] < max_blocks)  # [NQ_POW2, BLOCKS]
    read = (blk < tl.max(counts, axis=0)) & (blk < max_blocks)  # blocks any query scores
    phys = tl.load(block_tables_ptr + b * s_bt_b + blk * s_bt_j, mask=read, other=0).to(tl.int64) * PARTS + j % PARTS

    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    tile_mask = read[:, None] & d_mask[None, :]
    row = summaries_ptr + phys[:, None] * s_sum_blk + d[None, :] * s_sum_d
    r = tl.arange(0, ROWS)
    r_ok = r < GROUP
    q_row = q_ptr + b.to(tl.int64) * s_q_b + r[:, None] * s_q_h + d[None, :] * s_q_d
    q_mask = r_ok[:, None] & d_mask[None, :]

    total = tl.zeros([NQ_POW2, BLOCKS], dtype=tl.float32)
    for g in range(0, HKV):
        k_min = tl.load(row + g * s_sum_head, mask=tile_mask, other=0.0)
        k_max = tl.load(row + g * s_sum_head + s_sum_kind, mask=tile_mask, other=0.0)
        if DOT_FP32:
            k_min, k_max = k_min.to(tl.float32), k_max.to(tl.float32)
        for qi in tl.static_range(NQ):
            qh = tl.load(q_row + qi * s_q_n + (g * GROUP) * s_q_h, mask=q_mask, other=0.0)
            if DOT_FP32:
                qh = qh.to(tl.float32)
            zero = tl.zeros_like(qh)
            q_pos, q_neg = tl.where(qh > zero, qh, zero), tl.where(qh < zero, qh, zero)  # exact, in q's dtype
            if DOT_FP32:
                s = tl.dot(q_pos, tl.trans(k_max), input_precision="ieee")
                s = tl.dot(q_neg, tl.trans(k_min), s, input_precision="ieee")
            else:
                s = tl.dot(q_pos, tl.trans(k_max))
                s = tl.dot(q_neg, tl.trans(k_min), s)
            best = tl.max(tl.where(r_ok[:, None], s, float("-inf")), axis=0)
            if PARTS > 1:
                best = tl.max(tl.reshape(best, (BLOCKS, PARTS)), axis=1)
            total = tl.where(n[:, None] == qi, total + best[None, :], total)

    total = tl.where(valid, total, float("-inf"))
    out = scores_ptr + n[:, None] * s_out_n + b * s_out_b + jb[None, :] * s_out_j
    tl.store(out, total, mask=(n[:, None] < NQ) & (jb[None, :] < max_blocks))


def _check_args(q, summaries, block_tables, num_blocks_per_seq):
    """One query per sequence: q [B, Hq, D], num_blocks_per_seq int32 [B]."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    bsz = q.shape[0]
    if (
        num_blocks_per_seq.dim() != 1
        or num_blocks_per_seq.dtype != torch.int32
        or num_blocks_per_seq.shape[0] != bsz
    ):
        raise ValueError(
            f"num_blocks_per_seq must be int32 [B={bsz}], got {num_blocks_per_seq.dtype} "
            f"{tuple(num_blocks_per_seq.shape)}"
        )
    _check_shared_args(q[None], summaries, block_tables, num_blocks_per_seq, "num_blocks_per_seq")


def _check_multi_args(q, summaries, block_tables, num_blocks):
    """NQ queries per sequence: q [NQ, B, Hq, D], num_blocks int32 [NQ, B]."""
    if q.dim() != 4 or q.shape[0] == 0:
        raise ValueError(f"q must be [NQ >= 1, B, Hq, D], got {tuple(q.shape)}")
    nq, bsz = q.shape[:2]
    if num_blocks.dim() != 2 or num_blocks.dtype != torch.int32 or tuple(num_blocks.shape) != (nq, bsz):
        raise ValueError(
            f"num_blocks must be int32 [NQ={nq}, B={bsz}], got {num_blocks.dtype} {tuple(num_blocks.shape)}"
        )
    _check_shared_args(q, summaries, block_tables, num_blocks, "num_blocks")


def _check_shared_args(q, summaries, block_tables, num_blocks, num_blocks_name):
    """q [NQ, B, Hq, D]; the block counts' shape is already checked."""
    if summaries.dim() != 4 or summaries.shape[1] != 2:
        raise ValueError(f"summaries must be [num_blocks, 2, Hkv, D], got {tuple(summaries.shape)}")
    if q.dtype not in _FLOAT_DTYPES or summaries.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q and summaries must be fp32/fp16/bf16, got {q.dtype} and {summaries.dtype}")
    bsz, hq, d = q.shape[1:]
    hkv = summaries.shape[2]
    if summaries.shape[3] != d:
        raise ValueError(f"head_dim mismatch: q has D={d}, summaries D={summaries.shape[3]}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq ({hq}) must be a multiple of Hkv ({hkv})")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.shape[0] != bsz:
        raise ValueError(
            f"block_tables must be int32 [B={bsz}, max_blocks], got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    for name, t in (("summaries", summaries), ("block_tables", block_tables), (num_blocks_name, num_blocks)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def _check_parts(summaries, parts: int, block_n: int = _BLOCK_N) -> None:
    if parts < 1 or block_n % parts or summaries.shape[0] % parts:
        raise ValueError(f"parts must divide {block_n} and the summaries' {summaries.shape[0]} rows, got {parts}")


def _check_values(summaries, block_tables, num_blocks, num_blocks_name, parts: int = 1):
    """num_blocks: [NQ, B]; a table entry is read when any query of its sequence counts its block."""
    max_blocks = block_tables.shape[1]
    if num_blocks.numel() == 0:
        return
    lo, hi = int(num_blocks.min()), int(num_blocks.max())
    if lo < 0 or hi > max_blocks:
        raise ValueError(f"{num_blocks_name} must be in [0, {max_blocks}], got values in [{lo}, {hi}]")
    j = torch.arange(max_blocks, device=block_tables.device)
    used = block_tables[j[None, :] < num_blocks.amax(0)[:, None].long()]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= summaries.shape[0] // parts):
        raise ValueError(
            f"block_tables entries of valid blocks must be in [0, {summaries.shape[0] // parts}), "
            f"got values in [{int(used.min())}, {int(used.max())}]"
        )


def block_scores_reference(
    q: torch.Tensor,
    summaries: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks_per_seq: torch.Tensor,
    parts: int = 1,
) -> torch.Tensor:
    """Torch twin of :func:`block_scores` (same arguments and result).

    Uses ``max(q*mn, q*mx) = relu(q)*mx + min(q, 0)*mn`` so that each KV head is two matmuls;
    that identity needs ``mn <= mx``, which real summaries satisfy (the kernel uses it too, as two dot products).
    """
    _check_args(q, summaries, block_tables, num_blocks_per_seq)
    _check_parts(summaries, parts)
    _check_values(summaries, block_tables, num_blocks_per_seq[None], "num_blocks_per_seq", parts)
    bsz, hq, d = q.shape
    hkv = summaries.shape[2]
    scores = torch.full(block_tables.shape, float("-inf"), dtype=torch.float32, device=q.device)
    qf = q.float().view(bsz, hkv, hq // hkv, d)
    q_pos, q_neg = qf.clamp(min=0), qf.clamp(max=0)
    by_block = summaries.view(-1, parts, *summaries.shape[1:])  # [blocks, parts, 2, Hkv, D]
    for b, n in enumerate(num_blocks_per_seq.tolist()):
        if n == 0:
            continue
        s = by_block[block_tables[b, :n].long()].float()  # [n, parts, 2, Hkv, D]
        per_head = torch.einsum("npgd,ghd->npgh", s[:, :, 1], q_pos[b]) + torch.einsum(
            "npgd,ghd->npgh", s[:, :, 0], q_neg[b]
        )  # [n, parts, Hkv, group]
        scores[b, :n] = per_head.amax(dim=3).amax(dim=1).sum(dim=1)
    return scores


def block_scores_multi_reference(
    q: torch.Tensor,
    summaries: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks: torch.Tensor,
    parts: int = 1,
) -> torch.Tensor:
    """Torch twin of :func:`block_scores_multi` (same arguments and result): one
    :func:`block_scores_reference` per query."""
    _check_multi_args(q, summaries, block_tables, num_blocks)
    _check_parts(summaries, parts)
    _check_values(summaries, block_tables, num_blocks, "num_blocks", parts)
    return torch.stack([block_scores_reference(qn, summaries, block_tables, nb, parts)
                        for qn, nb in zip(q, num_blocks)])


def _triton_runs(device: torch.device) -> bool:
    # The interpreter is chosen when triton.jit runs (module import), so ask the kernel object.
    return device.type == "cuda" or type(_block_scores_kernel).__name__ == "InterpretedFunction"


def block_scores(
    q: torch.Tensor,
    summaries: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks_per_seq: torch.Tensor,
    parts: int = 1,
    *,
    check_values: bool | None = None,
) -> torch.Tensor:
    """Quest upper-bound score of every logical block of every sequence, for one query each.

    ``score[b, j] = sum_g max_{h in group g} sum_d max(q[b,h,d]*mn[g,d], q[b,h,d]*mx[g,d])``
    where ``mn, mx = summaries[block_tables[b, j], 0/1]``, ``g = h // (Hq // Hkv)``: the best
    query head of each KV-head group, summed over KV heads (see module docstring).

    Args:
        q: [B, Hq, D] decode queries (fp32/fp16/bf16; computed in fp32).
        summaries: [num_blocks x parts, 2, Hkv, D] one layer's summaries (0 = min, 1 = max).
        block_tables: int32 [B, max_blocks], logical block j of sequence b -> physical block
            (its summaries: rows ``parts`` x block ..). Entries at ``j >= num_blocks_per_seq[b]`` are never read.
        num_blocks_per_seq: int32 [B], valid logical blocks per sequence (<= max_blocks).
        parts: summaries per block (module docstring); a divisor of 32.
        check_values: check value ranges (costs a device->host sync on CUDA). Default: check on
            CPU tensors only. Unchecked bad values on CUDA are undefined.

    Returns:
        fp32 [B, max_blocks]; ``-inf`` where ``j >= num_blocks_per_seq[b]``.
    """
    if not _triton_runs(q.device):
        return block_scores_reference(q, summaries, block_tables, num_blocks_per_seq, parts)
    _check_args(q, summaries, block_tables, num_blocks_per_seq)
    _check_parts(summaries, parts)
    if checks_values(check_values, q.device):
        _check_values(summaries, block_tables, num_blocks_per_seq[None], "num_blocks_per_seq", parts)
    return _launch_scores(q[None], summaries, block_tables, num_blocks_per_seq[None], parts)[0]


def block_scores_multi(
    q: torch.Tensor,
    summaries: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks: torch.Tensor,
    parts: int = 1,
    *,
    check_values: bool | None = None,
) -> torch.Tensor:
    """:func:`block_scores` for NQ queries per sequence, reading the summaries once for all.

    ``result[n]`` is bit-identical to ``block_scores(q[n], summaries, block_tables, num_blocks[n])``.

    Args:
        q: [NQ, B, Hq, D], any strides (e.g. two row ranges of one [T, Hq, D] tensor, viewed as
            ``q[:real + B].unfold(0, B, real).movedim(-1, 1)``, without a copy).
        summaries: [num_blocks, 2, Hkv, D] one layer's summaries (0 = min, 1 = max).
        block_tables: int32 [B, max_blocks], shared by the NQ queries of a sequence. Entries at
            ``j >= max_n num_blocks[n, b]`` are never read.
        num_blocks: int32 [NQ, B], the logical blocks each query scores (<= max_blocks).
        parts, check_values: as for :func:`block_scores`.

    Returns:
        fp32 [NQ, B, max_blocks]; ``-inf`` where ``j >= num_blocks[n, b]``.
    """
    if not _triton_runs(q.device):
        return block_scores_multi_reference(q, summaries, block_tables, num_blocks, parts)
    _check_multi_args(q, summaries, block_tables, num_blocks)
    _check_parts(summaries, parts)
    if checks_values(check_values, q.device):
        _check_values(summaries, block_tables, num_blocks, "num_blocks", parts)
    return _launch_scores(q, summaries, block_tables, num_blocks, parts)


def _launch_scores(q, summaries, block_tables, num_blocks, parts: int = 1, block_n: int = _BLOCK_N,
                   num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """`block_n`, `num_warps`, `num_stages`: tuning (scripts/gpu_score_bench.py times them)."""
    nq, bsz, hq, d = q.shape
    hkv = summaries.shape[2]
    max_blocks = block_tables.shape[1]
    scores = torch.empty((nq, bsz, max_blocks), dtype=torch.float32, device=q.device)
    if bsz == 0 or max_blocks == 0:
        return scores
    grid = (bsz, triton.cdiv(max_blocks * parts, block_n))
    stages = {} if num_stages is None else {"num_stages": num_stages}
    group = hq // hkv
    _block_scores_kernel[grid](
        q,
        summaries,
        block_tables,
        num_blocks,
        scores,
        *q.stride(),
        *summaries.stride(),
        *block_tables.stride(),
        *num_blocks.stride(),
        *scores.stride(),
        max_blocks,
        d,
        NQ=nq,
        NQ_POW2=triton.next_power_of_2(nq),
        HKV=hkv,
        GROUP=group,
        ROWS=max(16, triton.next_power_of_2(group)),  # a dot product's rows: at least 16
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_FP32=q.dtype == torch.float32 or q.dtype != summaries.dtype,
        PARTS=parts,
        num_warps=num_warps,
        **stages,
    )
    return scores


def compile_for(arch: int, parts: int):
    """_block_scores_kernel compiled ahead of time (kernels/aot.py) at qwen3-8b's heads in bf16, x_t and its draft
    (NQ 2), `parts` summaries per block."""
    from oasiskv.kernels.aot import compile_ahead

    pointers = {"q_ptr": "*bf16", "summaries_ptr": "*bf16", "block_tables_ptr": "*i32", "num_blocks_ptr": "*i32",
                "scores_ptr": "*fp32"}
    meta = dict(NQ=2, NQ_POW2=2, HKV=8, GROUP=4, ROWS=16, BLOCK_N=_BLOCK_N, BLOCK_D=128, DOT_FP32=False, PARTS=parts)
    return compile_ahead(_block_scores_kernel, pointers, meta, arch)
