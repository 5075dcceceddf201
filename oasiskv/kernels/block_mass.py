"""Block selection scores as estimated attention mass: each head's estimated logits through a softmax.

Quest's score (kernels/block_select.py) adds raw logit bounds over KV heads. A head whose logits
spread wide then outvotes one that puts its mass on a single block (a needle), although the
attention a block receives is what matters; and the bound, the block's most optimistic logit, runs
ahead of the keys' typical ones by the block's spread. Here each query head ``h`` estimates each
block's logit from the block's centre and radius (``c = (min + max) / 2``, ``r = (max - min) / 2``
of the summary of KV head ``g = h // group``) and turns the estimates into the share of its
attention each block gets (the normaliser runs over the sequence's valid blocks but the tail, below):

    e_h(j)    = q[h] . c[g] + RADIUS_WEIGHT * |q[h]| . r[g]     (RADIUS_WEIGHT = 1 would be Quest's bound)
    p_h(j)    = exp(scale * e_h(j)) / sum_i exp(scale * e_h(i))      (i over the valid blocks but the tail)
    score(j)  = sum_g  max_{h in group g}  p_h(j)

combined over heads as Quest's score is (the best query head of each KV-head group, summed over KV
heads), so the selection rule and tensor parallelism's combination over ranks stay as they are.
Blocks ``j >= num_blocks[n, b]`` score ``-inf``; a sequence of one block scores 0.

Sub-block summaries (``parts`` > 1, kv/summaries.py): each block's parts are estimated as blocks of their own, the
softmax runs over the parts of every valid block but the tail, and a head's mass of a block is the sum of its parts'
before the best head of each group is taken.

The normaliser leaves out the tail block (the last valid one), which selection always keeps. This keeps oasis's
prediction exact: a draft that opens a block scores it before the block has a summary (its table entry is
padding), and at the next step that block is x_t's tail. Without the tail, the draft's normaliser runs over the
same blocks, with the same summaries, as the next step's.

Three kernels: the first writes every head's estimates and, per tile of blocks, their max and sum of
exponentials; the second folds the tiles into each head's normaliser, once per sequence; the third writes the
scores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.block_select import _check_multi_args, _check_parts, _check_values
from oasiskv.kernels.value_checks import checks_values

__all__ = ["RADIUS_WEIGHT", "block_mass_scores_multi", "block_mass_scores_multi_reference", "scores_from_logits"]

# Tuning, H200, 2026-12-02, qwen3-8b heads, 1025 blocks, x_t and draft: 39 / 104 us per layer at b16 / b43; the best
# of 12 tunings at b16, 3.6% behind the best at b43 (scripts/gpu_score_bench.py --mass; docs/BENCHMARKS.md,
# seventeenth session)
_BLOCK_N = 32  # logical blocks per program
_NUM_WARPS = 2
_TILE_CHUNK = 64  # tiles folded at once into a head's normaliser
_LOG2E = 1.4426950408889634
# Half the radius: on SmolLM2's decode steps the selection then keeps about half of the attention (47-48% for each
# step's worst head) that Quest's bound loses against exact selection; the full radius, or none, keeps less
# (scripts/selection_recall.py; docs/ACCURACY.md, "Block scores").
RADIUS_WEIGHT = 0.5


@triton.jit
def _head_estimates_kernel(
    q_ptr, summaries_ptr, block_tables_ptr, num_blocks_ptr, estimates_ptr, part_max_ptr, part_sum_ptr,
    s_q_n, s_q_b, s_q_h, s_q_d,
    s_sum_blk, s_sum_kind, s_sum_head, s_sum_d,
    s_bt_b, s_bt_j, s_nb_n, s_nb_b,
    s_bd_n, s_bd_b, s_bd_h, s_bd_j,
    s_pt_n, s_pt_b, s_pt_h, s_pt_t,
    max_blocks, D, scale_log2,
    NQ: tl.constexpr, NQ_POW2: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, RADIUS: tl.constexpr, PARTS: tl.constexpr,
):
    # Grid (batch, tile of BLOCK_N summary rows: BLOCK_N / PARTS blocks). Per KV head g and query, the group's
    # query heads are the rows of one tile; each row's estimates over the tile's (sub-)blocks are stored, with
    # their max and sum of exponentials. Estimates are indexed by summary row j = block x PARTS + part.
    b = tl.program_id(0)
    tile = tl.program_id(1)
    j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = j // PARTS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    r = tl.arange(0, ROWS)
    r_ok = r < GROUP
    q_row = q_ptr + b.to(tl.int64) * s_q_b + r[:, None] * s_q_h + d[None, :] * s_q_d
    q_mask = r_ok[:, None] & d_mask[None, :]
    n = tl.arange(0, NQ_POW2)
    counts = tl.load(num_blocks_ptr + n * s_nb_n + b * s_nb_b, mask=n < NQ, other=0)
    read = (blk < tl.max(counts, axis=0)) & (blk < max_blocks)  # blocks any query scores: read once for all
    phys = tl.load(block_tables_ptr + b * s_bt_b + blk * s_bt_j, mask=read, other=0).to(tl.int64) * PARTS + j % PARTS
    row = summaries_ptr + phys[:, None] * s_sum_blk + d[None, :] * s_sum_d
    tile_mask = read[:, None] & d_mask[None, :]
    for g in range(0, HKV):
        k_min = tl.load(row + g * s_sum_head, mask=tile_mask, other=0.0).to(tl.float32)
        k_max = tl.load(row + g * s_sum_head + s_sum_kind, mask=tile_mask, other=0.0).to(tl.float32)
        centre, radius = (k_min + k_max) * 0.5, (k_max - k_min) * (0.5 * RADIUS)
        if not DOT_FP32:
            centre, radius = centre.to(q_ptr.dtype.element_ty), radius.to(q_ptr.dtype.element_ty)
        for qi in tl.static_range(NQ):
            count = tl.load(num_blocks_ptr + qi * s_nb_n + b * s_nb_b)
            valid = (blk < count) & (blk < max_blocks)
            normalised = (blk < count - 1) & (blk < max_blocks)  # every valid block but the tail (module docstring)
            qh = tl.load(q_row + qi * s_q_n + (g * GROUP) * s_q_h, mask=q_mask, other=0.0)
            if DOT_FP32:
                qh = qh.to(tl.float32)
                s = tl.dot(qh, tl.trans(centre), input_precision="ieee")
                s = tl.dot(tl.abs(qh), tl.trans(radius), s, input_precision="ieee")
            else:
                s = tl.dot(qh, tl.trans(centre))
                s = tl.dot(tl.abs(qh), tl.trans(radius), s)
            s = tl.where(valid[None, :], s, float("-inf"))  # [ROWS, BLOCK_N]
            heads = g * GROUP + r
            out = estimates_ptr + qi * s_bd_n + b.to(tl.int64) * s_bd_b + heads[:, None] * s_bd_h + j[None, :] * s_bd_j
            tl.store(out, s, mask=r_ok[:, None] & (blk[None, :] < max_blocks))
            s = tl.where(normalised[None, :], s, float("-inf"))
            m = tl.max(s, axis=1)  # [ROWS]; -inf where the tile holds no normalised block
            m_safe = tl.where(m > float("-inf"), m, 0.0)
            total = tl.sum(tl.exp2((s - m_safe[:, None]) * scale_log2), axis=1)
            part = qi * s_pt_n + b.to(tl.int64) * s_pt_b + heads * s_pt_h + tile * s_pt_t
            tl.store(part_max_ptr + part, m, mask=r_ok)
            tl.store(part_sum_ptr + part, total, mask=r_ok)


@triton.jit
def _normaliser_kernel(
    part_max_ptr, part_sum_ptr, norm_ptr,
    s_pt_n, s_pt_b, s_pt_h, s_pt_t, s_nm_k, s_nm_n, s_nm_b,
    num_tiles, scale_log2,
    NQ: tl.constexpr, HQ: tl.constexpr, HQ_POW2: tl.constexpr, TILE_CHUNK: tl.constexpr,
):
    # Grid (batch). Every query head at once (rows): its normaliser, folded from every tile's (max, sum) once,
    # stored as (max, sum) for the mass kernel's programs to read (each folding it again would cost the square of
    # the tiles).
    b = tl.program_id(0)
    h = tl.arange(0, HQ_POW2)
    h_ok = h < HQ
    t = tl.arange(0, TILE_CHUNK)
    for qi in tl.static_range(NQ):
        part = qi * s_pt_n + b.to(tl.int64) * s_pt_b + h[:, None] * s_pt_h
        run_max = tl.full([HQ_POW2], float("-inf"), dtype=tl.float32)
        run_sum = tl.zeros([HQ_POW2], dtype=tl.float32)
        for t0 in range(0, num_tiles, TILE_CHUNK):
            t_ok = h_ok[:, None] & ((t0 + t)[None, :] < num_tiles)
            m = tl.load(part_max_ptr + part + (t0 + t)[None, :] * s_pt_t, mask=t_ok, other=float("-inf"))
            s = tl.load(part_sum_ptr + part + (t0 + t)[None, :] * s_pt_t, mask=t_ok, other=0.0)
            new_max = tl.maximum(run_max, tl.max(m, axis=1))
            base = tl.where(new_max > float("-inf"), new_max, 0.0)
            run_sum = run_sum * tl.exp2((run_max - base) * scale_log2) + tl.sum(
                s * tl.exp2((m - base[:, None]) * scale_log2), axis=1)
            run_max = new_max
        out = norm_ptr + qi * s_nm_n + b.to(tl.int64) * s_nm_b + h
        tl.store(out, run_max, mask=h_ok)
        tl.store(out + s_nm_k, run_sum, mask=h_ok)


@triton.jit
def _mass_kernel(
    estimates_ptr, norm_ptr, num_blocks_ptr, scores_ptr,
    s_bd_n, s_bd_b, s_bd_h, s_bd_j,
    s_nm_k, s_nm_n, s_nm_b,
    s_nb_n, s_nb_b, s_out_n, s_out_b, s_out_j,
    max_blocks, scale_log2,
    NQ: tl.constexpr, HQ: tl.constexpr, HQ_POW2: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, PARTS: tl.constexpr,
):
    # Grid (batch, tile of BLOCK_N summary rows). Every query head at once (rows): p = exp(scale * (e - max)) / sum
    # for this tile's (sub-)blocks with the head's normaliser; then, in registers, each block's parts summed per
    # head, each group's best head, summed over groups.
    BLOCKS: tl.constexpr = BLOCK_N // PARTS
    b = tl.program_id(0)
    tile = tl.program_id(1)
    j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = j // PARTS
    jb = tile * BLOCKS + tl.arange(0, BLOCKS)
    h = tl.arange(0, HQ_POW2)
    h_ok = h < HQ
    for qi in tl.static_range(NQ):
        count = tl.load(num_blocks_ptr + qi * s_nb_n + b * s_nb_b)
        valid = (blk < count) & (blk < max_blocks)
        norm = norm_ptr + qi * s_nm_n + b.to(tl.int64) * s_nm_b + h
        run_max = tl.load(norm, mask=h_ok, other=float("-inf"))
        run_sum = tl.load(norm + s_nm_k, mask=h_ok, other=0.0)
        base = tl.where(run_max > float("-inf"), run_max, 0.0)
        est = tl.load(estimates_ptr + qi * s_bd_n + b.to(tl.int64) * s_bd_b + h[:, None] * s_bd_h + j[None, :] * s_bd_j,
                      mask=h_ok[:, None] & valid[None, :], other=float("-inf"))
        p = tl.exp2((est - base[:, None]) * scale_log2) / tl.where(run_sum > 0, run_sum, 1.0)[:, None]
        p = tl.where(run_sum[:, None] > 0, p, 0.0)  # a sequence of one block: nothing to normalise over
        if PARTS > 1:
            p = tl.sum(tl.reshape(p, (HQ_POW2, BLOCKS, PARTS)), axis=2)
        total = tl.zeros([BLOCKS], dtype=tl.float32)
        for g in range(0, HKV):
            in_group = (h >= g * GROUP) & (h < (g + 1) * GROUP)
            total += tl.max(tl.where(in_group[:, None], p, 0.0), axis=0)
        block_valid = (jb < count) & (jb < max_blocks)
        out = scores_ptr + qi * s_out_n + b * s_out_b + jb * s_out_j
        tl.store(out, tl.where(block_valid, total, float("-inf")), mask=jb < max_blocks)


def block_mass_scores_multi_reference(q: torch.Tensor, summaries: torch.Tensor, block_tables: torch.Tensor,
                                      num_blocks: torch.Tensor, scale: float, parts: int = 1,
                                      radius_weight: float = RADIUS_WEIGHT) -> torch.Tensor:
    """Torch twin of :func:`block_mass_scores_multi` (same arguments and result). `radius_weight`: the
    estimates' weight of the block radius (scripts/selection_recall.py compares others)."""
    _check_multi_args(q, summaries, block_tables, num_blocks)
    _check_parts(summaries, parts, _BLOCK_N)
    _check_values(summaries, block_tables, num_blocks, "num_blocks", parts)
    nq, bsz, hq, d = q.shape
    # as in the kernel, a query's scores do not depend, to the bit, on the queries beside it or on table columns past
    # every sequence's blocks (oasis scores x_t beside its draft over one column more, quest alone; one einsum
    # over both rounded them apart): one query at a time, over the columns in use
    if nq > 1:
        return torch.cat([block_mass_scores_multi_reference(q[i:i + 1], summaries, block_tables, num_blocks[i:i + 1],
                                                            scale, parts, radius_weight) for i in range(nq)])
    width = int(num_blocks.max()) if num_blocks.numel() else 0
    if width < block_tables.shape[1]:
        out = torch.full((1, *block_tables.shape), float("-inf"), device=q.device)
        if width:
            out[:, :, :width] = block_mass_scores_multi_reference(q, summaries, block_tables[:, :width], num_blocks,
                                                                  scale, parts, radius_weight)
        return out
    hkv = summaries.shape[2]
    by_block = summaries.view(-1, parts, *summaries.shape[1:])  # [blocks, parts, 2, Hkv, D]
    s = by_block[block_tables.long().clamp(min=0)].flatten(1, 2).float()  # [B, W x parts, 2, Hkv, D]
    centre, radius = (s[:, :, 0] + s[:, :, 1]) / 2, (s[:, :, 1] - s[:, :, 0]) / 2 * radius_weight
    if q.dtype == summaries.dtype != torch.float32:  # the kernel's tensor-core dots take them in that dtype
        centre, radius = centre.to(q.dtype).float(), radius.to(q.dtype).float()
    qf = q.float().view(nq, bsz, hkv, hq // hkv, d)
    estimates = torch.einsum("bjgd,nbghd->nbghj", centre, qf) + torch.einsum(
        "bjgd,nbghd->nbghj", radius, qf.abs())  # [NQ, B, Hkv, group, W x parts]
    return scores_from_logits(estimates * scale, num_blocks, parts)


def scores_from_logits(logits: torch.Tensor, num_blocks: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """The mass score from each head's estimated logits, fp32 [NQ, B, Hkv, group, W x parts] (already scaled), and
    each query's block count int [NQ, B]: the exponentials over their sum over every block but the tail, each
    block's parts summed, the best head of each group, summed over groups. fp32 [NQ, B, W], ``-inf`` past each
    query's blocks."""
    blocks = torch.arange(logits.shape[-1], device=logits.device)[None, None, :] // parts  # each row's block
    normalised = (blocks < num_blocks.long()[:, :, None] - 1)[:, :, None, None, :]  # all but the tail block
    lse = logits.masked_fill(~normalised, float("-inf")).logsumexp(dim=-1, keepdim=True)
    mass = torch.where(lse > float("-inf"), (logits - lse).exp(), 0.0)  # one block: nothing to normalise over
    mass = mass.view(*mass.shape[:-1], -1, parts).sum(-1)
    valid = torch.arange(mass.shape[-1], device=logits.device)[None, None, :] < num_blocks.long()[:, :, None]
    return mass.amax(dim=3).sum(dim=2).masked_fill(~valid, float("-inf"))


def _triton_runs(device: torch.device) -> bool:
    return device.type == "cuda" or type(_mass_kernel).__name__ == "InterpretedFunction"


def block_mass_scores_multi(q: torch.Tensor, summaries: torch.Tensor, block_tables: torch.Tensor,
                            num_blocks: torch.Tensor, scale: float, parts: int = 1, *,
                            check_values: bool | None = None) -> torch.Tensor:
    """Estimated attention mass of every logical block, for NQ queries per sequence (module docstring).

    Args:
        q: [NQ, B, Hq, D] decode queries, any strides (fp32/fp16/bf16; computed in fp32).
        summaries: [num_blocks x parts, 2, Hkv, D] one layer's summaries (0 = min, 1 = max).
        block_tables: int32 [B, max_blocks], shared by the NQ queries of a sequence.
        num_blocks: int32 [NQ, B], the logical blocks each query scores (<= max_blocks).
        scale: the attention's softmax scale (1 / sqrt(D) unless the model says otherwise).
        parts: summaries per block (module docstring), a divisor of 32.
        check_values: check value ranges (a device->host sync on CUDA); default: on CPU tensors only.

    Returns:
        fp32 [NQ, B, max_blocks]; ``-inf`` where ``j >= num_blocks[n, b]``.
    """
    if not _triton_runs(q.device):
        return block_mass_scores_multi_reference(q, summaries, block_tables, num_blocks, scale, parts)
    _check_multi_args(q, summaries, block_tables, num_blocks)
    _check_parts(summaries, parts, _BLOCK_N)
    if checks_values(check_values, q.device):
        _check_values(summaries, block_tables, num_blocks, "num_blocks", parts)
    return _launch(q, summaries, block_tables, num_blocks, scale, parts)


def _launch(q, summaries, block_tables, num_blocks, scale: float, parts: int = 1, block_n: int = _BLOCK_N,
            num_warps: int = _NUM_WARPS) -> torch.Tensor:
    """`block_n`, `num_warps`: tuning (scripts/gpu_score_bench.py --mass times them)."""
    nq, bsz, hq, d = q.shape
    hkv, max_blocks = summaries.shape[2], block_tables.shape[1]
    scores = torch.empty((nq, bsz, max_blocks), dtype=torch.float32, device=q.device)
    if bsz == 0 or max_blocks == 0:
        return scores
    tiles = triton.cdiv(max_blocks * parts, block_n)
    estimates = torch.empty((nq, bsz, hq, max_blocks * parts), dtype=torch.float32, device=q.device)
    part_max = torch.empty((nq, bsz, hq, tiles), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    group, rows = hq // hkv, max(16, triton.next_power_of_2(hq // hkv))  # a dot product's rows: at least 16
    scale_log2 = float(scale) * _LOG2E
    common = dict(NQ=nq, HKV=hkv, GROUP=group, BLOCK_N=block_n, PARTS=parts, num_warps=num_warps)
    _head_estimates_kernel[(bsz, tiles)](
        q, summaries, block_tables, num_blocks, estimates, part_max, part_sum,
        *q.stride(), *summaries.stride(), *block_tables.stride(), *num_blocks.stride(),
        *estimates.stride(), *part_max.stride(), max_blocks, d, scale_log2,
        NQ_POW2=triton.next_power_of_2(nq), BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_FP32=q.dtype == torch.float32 or q.dtype != summaries.dtype, RADIUS=RADIUS_WEIGHT, ROWS=rows, **common)
    norm = torch.empty((2, nq, bsz, hq), dtype=torch.float32, device=q.device)  # each head's (max, sum)
    heads = dict(NQ=nq, HQ=hq, HQ_POW2=triton.next_power_of_2(hq))
    _normaliser_kernel[(bsz,)](
        part_max, part_sum, norm, *part_max.stride(), *norm.stride()[:3], tiles, scale_log2,
        TILE_CHUNK=_TILE_CHUNK, num_warps=num_warps, **heads)
    _mass_kernel[(bsz, tiles)](
        estimates, norm, num_blocks, scores,
        *estimates.stride(), *norm.stride()[:3], *num_blocks.stride(), *scores.stride(),
        max_blocks, scale_log2, **dict(common, **heads))
    return scores


def compile_for(arch: int, parts: int):
    """The three kernels compiled ahead of time (kernels/aot.py) at qwen3-8b's heads in bf16, x_t and its draft
    (NQ 2), `parts` summaries per block."""
    from oasiskv.kernels.aot import compile_ahead

    common, floats = dict(NQ=2, HQ=32, HQ_POW2=32), {"scale_log2": "fp32"}
    estimates = compile_ahead(
        _head_estimates_kernel,
        {"q_ptr": "*bf16", "summaries_ptr": "*bf16", "block_tables_ptr": "*i32", "num_blocks_ptr": "*i32",
         "estimates_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"},
        dict(NQ=2, HKV=8, GROUP=4, BLOCK_N=_BLOCK_N, PARTS=parts, NQ_POW2=2, ROWS=16, BLOCK_D=128, DOT_FP32=False,
             RADIUS=RADIUS_WEIGHT), arch, num_warps=_NUM_WARPS, scalars=floats)
    normaliser = compile_ahead(
        _normaliser_kernel, {"part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "norm_ptr": "*fp32"},
        dict(common, TILE_CHUNK=_TILE_CHUNK), arch, num_warps=_NUM_WARPS, scalars=floats)
    mass = compile_ahead(
        _mass_kernel, {"estimates_ptr": "*fp32", "norm_ptr": "*fp32", "num_blocks_ptr": "*i32", "scores_ptr": "*fp32"},
        dict(common, HKV=8, GROUP=4, BLOCK_N=_BLOCK_N, PARTS=parts), arch, num_warps=_NUM_WARPS, scalars=floats)
    return estimates, normaliser, mass
