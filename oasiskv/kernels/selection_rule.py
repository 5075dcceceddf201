"""The selection rule, in torch: per sequence the sink blocks, the local window (whose last block is the tail
block) and the top-scored remaining blocks, ``budget_blocks`` in total, from per-block scores
(kernels/block_select.py). :func:`select_blocks_padded` gives a fixed-shape table without a host sync, and is the
reference of kernels/block_topk.py's fused kernel; :func:`select_blocks` gives the same as CSR.
"""
from __future__ import annotations

import torch

__all__ = ["select_blocks", "select_blocks_padded"]


def _check_select_args(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks):
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores must be a float [B, max_blocks] tensor, got {scores.dtype} {tuple(scores.shape)}")
    bsz = scores.shape[0]
    if (
        num_blocks_per_seq.dim() != 1
        or num_blocks_per_seq.shape[0] != bsz
        or num_blocks_per_seq.is_floating_point()
    ):
        raise ValueError(
            f"num_blocks_per_seq must be an integer [B={bsz}] tensor, got {num_blocks_per_seq.dtype} "
            f"{tuple(num_blocks_per_seq.shape)}"
        )
    if budget_blocks < 1 or sink_blocks < 0 or local_blocks < 1:
        raise ValueError(
            f"need budget_blocks >= 1, sink_blocks >= 0, local_blocks >= 1; got "
            f"{budget_blocks}, {sink_blocks}, {local_blocks}"
        )
    if sink_blocks + local_blocks > budget_blocks:
        raise ValueError(
            f"sink_blocks + local_blocks ({sink_blocks} + {local_blocks}) exceeds budget_blocks ({budget_blocks})"
        )


def _check_select_values(n: torch.Tensor, max_blocks: int) -> None:
    if n.numel() and (int(n.min()) < 0 or int(n.max()) > max_blocks):
        raise ValueError(
            f"num_blocks_per_seq must be in [0, {max_blocks}], got values in [{int(n.min())}, {int(n.max())}]"
        )


def select_blocks_padded(
    scores: torch.Tensor,
    num_blocks_per_seq: torch.Tensor,
    budget_blocks: int,
    sink_blocks: int,
    local_blocks: int,
    *,
    check_values: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_blocks` as a padded [B, K] table: no host sync, CUDA-graph capturable.

    Same selection rule and tie-break as :func:`select_blocks`. With ``num_blocks_per_seq``
    on ``scores.device`` nothing waits on the device (values are then only checked when
    ``check_values=True``; on the CPU they are always checked).

    Returns:
        ``(counts, indices)`` on ``scores.device``: int32 [B] with ``counts[b] =
        min(n_b, budget_blocks)``, and int32 [B, K], ``K = min(budget_blocks, max_blocks)``,
        row b holding its ``counts[b]`` logical block ids ascending, then ``-1`` padding.
    """
    _check_select_args(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks)
    bsz, max_blocks = scores.shape
    dev = scores.device
    if check_values if check_values is not None else num_blocks_per_seq.device.type == "cpu":
        _check_select_values(num_blocks_per_seq, max_blocks)
    n = num_blocks_per_seq.to(device=dev, dtype=torch.int64)
    counts = n.clamp(max=budget_blocks).to(torch.int32)
    k = min(budget_blocks, max_blocks)
    if bsz == 0 or k == 0:
        return counts, torch.empty((bsz, k), dtype=torch.int32, device=dev)
    n = n[:, None]
    j = torch.arange(max_blocks, device=dev)
    # rank: int64, ordered like the fp32 score, ties to the lower block id, all keys distinct,
    # so the set topk returns is the same on every device.
    big = torch.finfo(torch.float32).max
    key = torch.nan_to_num(scores.float(), nan=-big, posinf=big, neginf=-big) + 0.0  # -0.0 -> +0.0
    bits = key.view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # order-preserving float -> int
    rank = ordered.to(torch.int64) * (1 << 32) + (max_blocks - 1 - j)
    # forced blocks (sink, local window with the tail) above every score, invalid ones below
    forced = (j < sink_blocks) | (j >= n - local_blocks)
    rank = rank.masked_fill(forced, torch.iinfo(torch.int64).max)
    rank = rank.masked_fill(j >= n, torch.iinfo(torch.int64).min)
    # the top k hold all min(n, budget) selected blocks; push the invalid ones to the end
    order = torch.topk(rank, k, dim=1, sorted=False).indices
    chosen = order.masked_fill(order >= n, max_blocks).sort(dim=1).values
    return counts, chosen.masked_fill(chosen == max_blocks, -1).to(torch.int32)


def select_blocks(
    scores: torch.Tensor,
    num_blocks_per_seq: torch.Tensor,
    budget_blocks: int,
    sink_blocks: int,
    local_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence selection as CSR of logical block ids.

    For sequence ``b`` with ``n = num_blocks_per_seq[b]`` blocks:

    - ``n <= budget_blocks``: all blocks ``0 .. n-1``;
    - otherwise exactly ``budget_blocks`` blocks: the sink blocks ``0 .. sink_blocks-1``, the
      local window ``n-local_blocks .. n-1`` (its last block is the tail block), and the
      highest-scored of the remaining blocks to fill the budget.

    Ties: among equal scores the lower logical block id wins (keys made unique before
    ``torch.topk``), the same on CPU and GPU. NaN and ``-inf`` scores rank as the lowest
    finite score, ``+inf`` scores as the largest finite one, so forced blocks always win.

    Args:
        scores: [B, max_blocks] float (e.g. from :func:`block_scores`); entries at
            ``j >= n`` are ignored.
        num_blocks_per_seq: int [B], on the CPU or on ``scores.device``. Its values are needed
            on the host to size the output: pass it on the CPU to avoid a device->host sync.
        budget_blocks: blocks per sequence in total (sink and local included), >= 1.
        sink_blocks: >= 0.
        local_blocks: >= 1 (the tail block is always selected).
        ``sink_blocks + local_blocks <= budget_blocks`` is required.

    Returns:
        ``(indptr, indices)`` on ``scores.device``: int32 [B+1] and int32 [nnz], ids sorted
        ascending within each sequence; ``nnz = sum_b min(n_b, budget_blocks)``.
        :func:`select_blocks_padded` gives the same as a fixed-shape table, without a sync.
    """
    _check_select_args(scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks)
    bsz, max_blocks = scores.shape
    dev = scores.device
    n_host = num_blocks_per_seq.to("cpu", torch.int64)
    _check_select_values(n_host, max_blocks)
    indptr_host = torch.zeros(bsz + 1, dtype=torch.int64)
    torch.cumsum(n_host.clamp(max=budget_blocks), dim=0, out=indptr_host[1:])
    nnz = int(indptr_host[-1])
    indptr = indptr_host.to(device=dev, dtype=torch.int32)
    if nnz == 0:
        return indptr, torch.empty(0, dtype=torch.int32, device=dev)
    counts, padded = select_blocks_padded(
        scores, num_blocks_per_seq, budget_blocks, sink_blocks, local_blocks, check_values=False
    )
    rows = torch.repeat_interleave(torch.arange(bsz, device=dev), counts.long(), output_size=nnz)
    cols = torch.arange(nnz, device=dev) - indptr[:-1].long()[rows]
    return indptr, padded[rows, cols]
