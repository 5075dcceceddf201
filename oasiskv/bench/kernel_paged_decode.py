"""Micro-benchmark of the dense paged decode-attention kernel on the GPU.

    python -m oasiskv.bench.kernel_paged_decode [--context 16384] [--batch 1 8 32]
                                                [--out results/kernel_paged_decode.json]

Qwen3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token
blocks). Random non-zero K/V in a pool whose physical blocks are handed out in a
random order (shuffled block tables). Each case is first checked against
paged_decode_reference (relative Frobenius error), then timed with
triton.testing.do_bench (median; do_bench flushes L2 between calls). Bandwidth counts
the K and V bytes read; the roofline is the H200's measured HBM copy ceiling. Each case
is timed twice: "eager" calls the Python launcher each time (launch cost included),
"graph" replays the launch captured in a CUDA graph (kernel time).

Measured 2026-11-29 on the lent H200 (torch 2.11.0+cu130, triton 3.6.0), context 16384:

    batch  eager us  GB/s  % of 4200 | graph us  GB/s  % of 4200 | splits
        1      63.3  1060      25.2% |     33.5  2003      47.7% |     64
        8     141.3  3800      90.5% |    140.9  3810      90.7% |      8
       32     506.3  4242     101.0% |    505.0  4253     101.3% |      8

(Reads alone can pass the copy ceiling, which counts a read and a write per byte.
Batch 1 eager is bound by the launcher's ~60 us of Python per call: two Triton launches.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import triton
import triton.testing

from oasiskv.kernels.paged_decode import (
    choose_partition,
    paged_decode_attention,
    paged_decode_reference,
    scratch_bytes,
)

HBM_CEILING_GBPS = 4200.0  # measured H200 device-to-device copy, read + write counted
QWEN3_8B = dict(q_heads=32, kv_heads=8, head_dim=128, block_size=16)
REL_ERR_LIMIT = 2e-2  # bf16 inputs and output


def make_case(batch, context, q_heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = triton.cdiv(context, block_size)
    num_blocks = batch * blocks_per_seq + 1  # one spare so block ids really are shuffled
    kv_layer = torch.randn(
        (num_blocks, 2, block_size, kv_heads, head_dim), generator=gen, device=device, dtype=torch.float32
    ).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)[: batch * blocks_per_seq]
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn((batch, q_heads, head_dim), generator=gen, device=device, dtype=torch.float32).to(dtype)
    return q, kv_layer, block_tables, seq_lens


def _graph_of(fn):
    """fn captured in a CUDA graph: replaying it times the kernels without Python launch cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def run_case(batch, context, shapes, dtype, device, warmup, rep):
    q_heads, kv_heads, head_dim, block_size = (
        shapes["q_heads"],
        shapes["kv_heads"],
        shapes["head_dim"],
        shapes["block_size"],
    )
    q, kv_layer, block_tables, seq_lens = make_case(batch, context, q_heads, kv_heads, head_dim, block_size, dtype,
                                                    device)
    scale = head_dim**-0.5
    out = torch.empty_like(q)

    paged_decode_attention(q, kv_layer, block_tables, seq_lens, scale, out, max_seq_len=context)
    ref = paged_decode_reference(q, kv_layer, block_tables, seq_lens, scale).float()
    rel_err = ((out.float() - ref).norm() / ref.norm()).item()
    if not rel_err < REL_ERR_LIMIT:
        raise SystemExit(f"batch {batch} context {context}: relative error {rel_err:.3e} > {REL_ERR_LIMIT}")

    def fn():
        paged_decode_attention(q, kv_layer, block_tables, seq_lens, scale, out, max_seq_len=context)

    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    ms_graph = triton.testing.do_bench(_graph_of(fn).replay, warmup=warmup, rep=rep, return_mode="median")
    kv_bytes = int(seq_lens.sum().item()) * 2 * kv_heads * head_dim * kv_layer.element_size()
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    partition, splits = choose_partition(batch, kv_heads, context,
                                         torch.cuda.get_device_properties(device).multi_processor_count)
    del q, kv_layer, block_tables, seq_lens, out, ref
    torch.cuda.empty_cache()
    return dict(
        batch=batch,
        context=context,
        time_us=ms * 1e3,
        kv_bytes=kv_bytes,
        gbps=gbps,
        pct_of_ceiling=100.0 * gbps / HBM_CEILING_GBPS,
        graph_time_us=ms_graph * 1e3,
        graph_gbps=kv_bytes / (ms_graph * 1e-3) / 1e9,
        graph_pct_of_ceiling=100.0 * kv_bytes / (ms_graph * 1e-3) / 1e9 / HBM_CEILING_GBPS,
        rel_err=rel_err,
        partition_size=partition,
        num_splits=splits,
        scratch_bytes=scratch_bytes(batch, q_heads, head_dim, splits),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, nargs="+", default=[16384])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    parser.add_argument("--out", default="results/kernel_paged_decode.json")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        raise SystemExit("kernel_paged_decode: needs a CUDA GPU")
    device = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)

    rows = []
    for context in args.context:
        for batch in args.batch:
            rows.append(run_case(batch, context, QWEN3_8B, dtype, device, args.warmup, args.rep))

    print(f"paged decode attention, Qwen3-8B shapes ({QWEN3_8B}), bf16, {torch.cuda.get_device_name(device)}")
    print("eager: one launcher call per timing (Python launch cost included); graph: CUDA-graph replay")
    print(
        f"{'batch':>5} {'context':>7} {'time(us)':>9} {'KV bytes':>12} {'GB/s':>8} {'% of 4200':>9} "
        f"{'graph(us)':>9} {'GB/s':>8} {'% of 4200':>9} {'splits':>6} {'rel err':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['time_us']:>9.1f} {r['kv_bytes']:>12} {r['gbps']:>8.0f} "
            f"{r['pct_of_ceiling']:>8.1f}% {r['graph_time_us']:>9.1f} {r['graph_gbps']:>8.0f} "
            f"{r['graph_pct_of_ceiling']:>8.1f}% {r['num_splits']:>6} {r['rel_err']:>9.2e}"
        )

    result = dict(
        benchmark="kernel_paged_decode",
        when=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        device=torch.cuda.get_device_name(device),
        num_sms=torch.cuda.get_device_properties(device).multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        dtype=str(dtype),
        shapes=QWEN3_8B,
        hbm_ceiling_gbps=HBM_CEILING_GBPS,
        timer="triton.testing.do_bench median",
        rows=rows,
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
