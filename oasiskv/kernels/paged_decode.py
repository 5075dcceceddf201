"""Dense paged decode attention: one query token per sequence over its paged KV.

Flash-decoding (split-K) design:

* ``_paged_decode_split_kernel`` runs on a grid (batch, kv_head, split). One program
  takes all query heads of one GQA group (padded to >= 16 rows so they form the M
  dimension of ``tl.dot``), so each K/V byte is read from HBM once per group. It walks
  its range of tokens (a "partition") in tiles of ``BLOCK_N`` tokens gathered through
  the block table, keeps an online softmax in fp32 (base-2 exponentials) and writes the
  partial (max, sum, unnormalised acc) of each query head to a fp32 scratch buffer.
* ``_paged_decode_reduce_kernel`` runs on a grid (batch, q_head) and merges the valid
  splits of a sequence into the output.
* When a launch needs one split only, the first kernel normalises and writes the
  output itself and the reduce kernel is skipped.

Everything that depends on sequence lengths (partition size, number of splits, the
sequence lengths themselves) is a runtime argument, so a new length never triggers a
recompile; compile-time values are shapes of the model/pool (head_dim, group size,
block size) and the dtype.

Layouts (see DESIGN.md, "Memory layout"):

* ``q``            [B, Hq, D], fp16 / bf16 / fp32
* ``kv_layer``     [num_blocks, 2, block_size, Hkv, D]; dim 1: 0 = K, 1 = V
* ``block_tables`` int32 [B, max_blocks_per_seq]; entry j holds tokens
  [j * block_size, (j + 1) * block_size); entries past ceil(seq_len / block_size) are
  never read (they may be garbage such as -1)
* ``seq_lens``     int32 [B], >= 1, the current token included
* output           [B, Hq, D] in q's dtype; query head h reads KV head h // (Hq // Hkv)

``paged_decode_reference`` is the plain-torch twin (fp32 accumulation), also used by
the engine on the CPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from oasiskv.kernels.device_info import num_sms
from oasiskv.kernels.value_checks import check_range, check_table_reads, checks_values

__all__ = [
    "paged_decode_attention",
    "paged_decode_reference",
    "choose_partition",
    "scratch_bytes",
    "INTERPRETED",
]

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tile and split policy, tuned on an H200 (triton 3.6) with Qwen3-8B shapes at 16K context
# (see oasiskv/bench/kernel_paged_decode.py): 64-token tiles (four 16-token blocks),
# 3-stage load pipelining, 4 warps; partitions start at 2048 tokens and halve (down to
# 128) until the grid has >= 3 programs per SM; long contexts grow them so that a launch
# never has more than 256 splits.
_BLOCK_N = 64
_NUM_STAGES = 3
_NUM_WARPS = 4
_MAX_PARTITION = 2048
_MIN_PARTITION = 128
_MAX_SPLITS = 256
_PROGRAMS_PER_SM = 3
# Splits merged per step of the reduce kernel.
_REDUCE_BLOCK_S = 32


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scratch_ptr,  # fp32: acc [B, Hq, S, D], then max [B, Hq, S], then sum [B, Hq, S]
    out_ptr,
    qk_scale,  # softmax scale * log2(e)
    partition_size,  # tokens per split (runtime: no recompile per length)
    num_splits,  # runtime
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    stride_kv_d,
    stride_bt_b,
    stride_bt_j,
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)
    # The last split takes whatever remains, so a too-small max_seq_len hint costs
    # speed, never correctness.
    end = tl.where(split == num_splits - 1, seq_len, end)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_hd = mask_h[:, None] & mask_d[None, :]
    q_heads = kv_head * GROUP + offs_h

    q = tl.load(
        q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_hd,
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt_b
    kv_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
    d_off = offs_d[None, :] * stride_kv_d

    for tile_start in range(start, end, BLOCK_N):
        tok = tile_start + offs_n
        mask_n = tok < end
        # Only entries of valid tokens are read: garbage past the sequence is never touched.
        block = tl.load(bt_row + (tok // BLOCK_SIZE) * stride_bt_j, mask=mask_n, other=0)
        row = block.to(tl.int64) * stride_kv_block + (tok % BLOCK_SIZE) * stride_kv_tok
        k_ptrs = kv_head_ptr + row[:, None] + d_off
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptrs, mask=mask_kv, other=0.0)
        v = tl.load(k_ptrs + stride_kv_kv, mask=mask_kv, other=0.0)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_SPLIT:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + b * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_hd,
        )
    else:
        q_heads_total = tl.num_programs(1) * GROUP
        n_rows = tl.num_programs(0).to(tl.int64) * q_heads_total * num_splits
        rows = (b * q_heads_total + q_heads).to(tl.int64) * num_splits + split  # [BLOCK_H]
        tl.store(scratch_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_hd)
        ml_ptr = scratch_ptr + n_rows * HEAD_DIM + rows
        tl.store(ml_ptr, m_i, mask=mask_h)
        tl.store(ml_ptr + n_rows, l_i, mask=mask_h)


@triton.jit
def _paged_decode_reduce_kernel(
    scratch_ptr,
    seq_lens_ptr,
    out_ptr,
    partition_size,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)

    seq_len = tl.load(seq_lens_ptr + b)
    # Splits that hold tokens of this sequence (split 0 always does).
    n_valid = tl.minimum(tl.cdiv(seq_len, partition_size), num_splits)

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    n_rows = tl.num_programs(0).to(tl.int64) * tl.num_programs(1) * num_splits
    row0 = (b * tl.num_programs(1) + head).to(tl.int64) * num_splits
    acc_base = scratch_ptr + row0 * HEAD_DIM
    m_base = scratch_ptr + n_rows * HEAD_DIM + row0
    l_base = m_base + n_rows

    # Pass 1: the global max over splits.
    m_max = tl.max(tl.load(m_base + offs_s, mask=offs_s < n_valid, other=float("-inf")), 0)
    for s0 in range(BLOCK_S, n_valid, BLOCK_S):
        s = s0 + offs_s
        m_s = tl.load(m_base + s, mask=s < n_valid, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m_s, 0))

    # Pass 2: rescale and sum.
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    denom = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        s = s0 + offs_s
        mask_s = s < n_valid
        m_s = tl.load(m_base + s, mask=mask_s, other=float("-inf"))
        l_s = tl.load(l_base + s, mask=mask_s, other=0.0)
        w = tl.where(mask_s, tl.exp2(m_s - m_max), 0.0)
        denom += w * l_s
        a = tl.load(
            acc_base + s[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask_s[:, None] & mask_d[None, :],
            other=0.0,
        )
        acc += tl.sum(a * w[:, None], 0)

    out = acc / tl.sum(denom, 0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


# True when triton was imported with TRITON_INTERPRET=1 (checked at decoration time):
# the kernels then run on CPU tensors through the interpreter.
INTERPRETED = type(_paged_decode_split_kernel).__name__ == "InterpretedFunction"


# --------------------------------------------------------------------------- helpers


def _check_inputs(q, kv_layer, block_tables, seq_lens, out, name):
    """Shape/dtype/device checks shared by the kernel launcher and the reference."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"{name}: q must be a 3-D tensor [batch, q_heads, head_dim], got {_shape(q)}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name}: q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if not isinstance(kv_layer, torch.Tensor) or kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(
            f"{name}: kv_layer must be [num_blocks, 2, block_size, kv_heads, head_dim], got {_shape(kv_layer)}"
        )
    if kv_layer.dtype != q.dtype:
        raise ValueError(f"{name}: kv_layer dtype {kv_layer.dtype} differs from q dtype {q.dtype}")
    batch, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, kv_head_dim = kv_layer.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"{name}: head_dim mismatch: q has {head_dim}, kv_layer has {kv_head_dim}")
    if head_dim < 1 or block_size < 1 or kv_heads < 1:
        raise ValueError(f"{name}: kv_layer has an empty dimension: {tuple(kv_layer.shape)}")
    if q_heads % kv_heads != 0:
        raise ValueError(f"{name}: q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"{name}: block_tables must be [batch={batch}, max_blocks_per_seq], "
                         f"got {_shape(block_tables)}")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"{name}: block_tables must be int32, got {block_tables.dtype}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"{name}: seq_lens must be [batch={batch}], got {_shape(seq_lens)}")
    if seq_lens.dtype != torch.int32:
        raise ValueError(f"{name}: seq_lens must be int32, got {seq_lens.dtype}")
    for other_name, t in (("kv_layer", kv_layer), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name}: {other_name} is on {t.device} but q is on {q.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            raise ValueError(f"{name}: out must have q's shape {tuple(q.shape)}, got {_shape(out)}")
        if out.dtype != q.dtype:
            raise ValueError(f"{name}: out dtype {out.dtype} differs from q dtype {q.dtype}")
        if out.device != q.device:
            raise ValueError(f"{name}: out is on {out.device} but q is on {q.device}")


def _check_values(kv_layer, block_tables, seq_lens) -> None:
    """seq_lens within [1, the table's capacity]; the table entries of the blocks they cover within the pool."""
    block_size, max_blocks = kv_layer.shape[2], block_tables.shape[1]
    check_range("paged_decode_attention: seq_lens", seq_lens, 1, max_blocks * block_size + 1)
    nblocks = (seq_lens.long() + block_size - 1) // block_size
    j = torch.arange(max_blocks, device=block_tables.device)
    logical = torch.where(j[None, :] < nblocks[:, None], j[None, :], -1)
    check_table_reads("paged_decode_attention: block_tables", block_tables, logical, kv_layer.shape[0])


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__




@functools.lru_cache(maxsize=4096)
def choose_partition(batch: int, kv_heads: int, max_seq_len: int, num_sms: int = 132) -> tuple[int, int]:
    """Tokens per split and number of splits for one launch.

    Starts from 2048-token partitions and halves them (down to 128) until the grid
    (batch x kv_heads x splits) has at least 3 programs per SM; grows them when a very
    long context would need more than 256 splits. Partitions are multiples of the
    64-token tile. Returns (partition_size, num_splits); num_splits == 1 means no
    reduce pass and no scratch.
    """
    max_seq_len = max(int(max_seq_len), 1)
    target = _PROGRAMS_PER_SM * num_sms
    part = _MAX_PARTITION
    while part > _MIN_PARTITION and batch * kv_heads * -(-max_seq_len // part) < target:
        part //= 2
    while -(-max_seq_len // part) > _MAX_SPLITS:
        part *= 2
    return part, -(-max_seq_len // part)


def scratch_bytes(batch: int, q_heads: int, head_dim: int, num_splits: int) -> int:
    """Bytes of fp32 scratch one multi-split launch allocates (max, sum and acc per split)."""
    if num_splits <= 1:
        return 0
    return 4 * batch * q_heads * num_splits * (head_dim + 2)


# --------------------------------------------------------------------------- launcher


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    partition_size: int | None = None,
    check_values: bool | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged KV (Triton).

    q [B, Hq, D]; kv_layer [num_blocks, 2, block_size, Hkv, D]; block_tables int32
    [B, max_blocks]; seq_lens int32 [B] (each >= 1); returns [B, Hq, D] in q's dtype
    (written into ``out`` when given).

    Keyword-only tuning knobs:
      max_seq_len: the largest entry of seq_lens, as a host int. Pass it (the scheduler
        knows it) to avoid a device->host sync; when omitted it is read from seq_lens.
        It only shapes the split count: a value below the true max is still correct
        (the last split takes the rest), just slower.
      partition_size: force tokens per split (tests); default from choose_partition().
      check_values: check seq_lens and the table entries they reach (a device->host sync on CUDA); default: on
        CPU tensors only (kernels/value_checks.py).

    CUDA tensors run the compiled kernels; CPU tensors run only under TRITON_INTERPRET=1.
    """
    _check_inputs(q, kv_layer, block_tables, seq_lens, out, "paged_decode_attention")
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"paged_decode_attention: {q.device.type} tensors need the Triton interpreter (TRITON_INTERPRET=1 set "
            "before oasiskv.kernels.paged_decode is imported); use paged_decode_reference on the CPU"
        )
    if checks_values(check_values, q.device):
        _check_values(kv_layer, block_tables, seq_lens)

    batch, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    group = q_heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out

    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())  # device sync on CUDA; pass max_seq_len to avoid it
    max_seq_len = max(int(max_seq_len), 1)
    if partition_size is None:
        partition_size, num_splits = choose_partition(batch, kv_heads, max_seq_len,
                                                       num_sms(q.device) if q.is_cuda else 132)
    else:
        partition_size = int(partition_size)
        if partition_size < 1:
            raise ValueError(f"paged_decode_attention: partition_size must be >= 1, got {partition_size}")
        num_splits = -(-max_seq_len // partition_size)

    block_h = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    single = num_splits == 1
    # One fp32 buffer: acc [B, Hq, S, D], then max and sum [B, Hq, S] each.
    scratch = out if single else torch.empty(batch * q_heads * num_splits * (head_dim + 2), dtype=torch.float32,
                                             device=q.device)
    stride_ob, stride_oh, stride_od = out.stride()
    _paged_decode_split_kernel[(batch, kv_heads, num_splits)](
        q,
        kv_layer,
        block_tables,
        seq_lens,
        scratch,
        out,
        float(scale) * _LOG2E,
        partition_size,
        num_splits,
        *q.stride(),
        *kv_layer.stride(),
        *block_tables.stride(),
        stride_ob,
        stride_oh,
        stride_od,
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_N=_BLOCK_N,
        SINGLE_SPLIT=single,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    if not single:
        _paged_decode_reduce_kernel[(batch, q_heads)](
            scratch,
            seq_lens,
            out,
            partition_size,
            num_splits,
            stride_ob,
            stride_oh,
            stride_od,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=min(_REDUCE_BLOCK_S, triton.next_power_of_2(num_splits)),
            num_warps=4,
        )
    return out


# --------------------------------------------------------------------------- reference


def paged_decode_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of paged_decode_attention (fp32 accumulation, any device).

    One gather of whole blocks per sequence, batched matmuls over KV heads; the only
    Python loop is over the batch.
    """
    _check_inputs(q, kv_layer, block_tables, seq_lens, out, "paged_decode_reference")
    batch, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    group = q_heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    lens = seq_lens.tolist()
    max_blocks = block_tables.shape[1]
    for b, seq_len in enumerate(lens):
        n_blocks = -(-seq_len // block_size)
        if seq_len < 1 or n_blocks > max_blocks:
            raise ValueError(
                f"paged_decode_reference: seq_lens[{b}]={seq_len} must be in [1, {max_blocks * block_size}]"
            )
        blocks = block_tables[b, :n_blocks].long()
        kv = kv_layer.index_select(0, blocks)  # [n_blocks, 2, block_size, Hkv, D]
        kv = kv.transpose(0, 1).reshape(2, n_blocks * block_size, kv_heads, head_dim)[:, :seq_len]
        k = kv[0].float().permute(1, 2, 0)  # [Hkv, D, L]
        v = kv[1].float().transpose(0, 1)  # [Hkv, L, D]
        qb = q[b].float().view(kv_heads, group, head_dim)
        probs = torch.softmax(torch.bmm(qb, k) * scale, dim=-1)  # [Hkv, G, L]
        out[b] = torch.bmm(probs, v).reshape(q_heads, head_dim).to(out.dtype)
    return out
