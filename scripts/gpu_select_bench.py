"""Block selection and prefetch planning: torch path vs the fused Triton kernels (oasiskv/kernels/block_topk.py).

Checks the fused results against the torch path first (selection and mask exactly, fetch lists as sets),
then times each call as CUDA-graph replays of --calls calls (no launch overhead of the Python side, as in
the engine's captured decode step): microseconds per call, a table, and JSON.
  select   one layer's selection of B queries (SparsePolicy.select)
  predict  oasis's draft group: selection + mask + fetch list of B x --group rows (OasisPolicy.predict)

    PYTHONPATH=. python scripts/gpu_select_bench.py [--batch 16,96] [--max-blocks 1025] [--budget 128] \\
        [--caps 6,128] [--json select_bench.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from oasiskv.config import KVConfig
from oasiskv.kernels.selection_rule import select_blocks_padded
from oasiskv.kernels.block_topk import predict_prefetch, predict_prefetch_reference, select_blocks_fused

DEFAULTS = KVConfig()


def case(rows: int, max_blocks: int, budget: int, layers: int, seed: int):
    """Scores, lengths (the last ~10% of rows shorter), and a working set holding ~2 budgets per row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(rows, max_blocks, device="cuda", generator=g)
    n = torch.full((rows,), max_blocks, dtype=torch.int32, device="cuda")
    n[-max(rows // 10, 1):] = max_blocks * 3 // 4
    slot_of = torch.full((layers, rows, max_blocks + 2), -1, dtype=torch.int32, device="cuda")
    held = torch.rand(layers, rows, max_blocks + 2, device="cuda", generator=g) < 2 * budget / max_blocks
    slot_of[held] = 0
    residency = dict(slot_of=slot_of[..., : max_blocks + 1],
                     layer_of=torch.randint(0, layers, (rows,), device="cuda", generator=g),
                     rows=torch.arange(rows, device="cuda"))
    return scores, n, residency


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` replays of a CUDA graph of `calls` calls, per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # compile and warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def check_select(scores, n, budget, sink, local) -> None:
    got, ref = select_blocks_fused(scores, n, budget, sink, local), select_blocks_padded(scores, n, budget, sink, local)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), "fused selection differs from the torch path"


def check_predict(args_, residency) -> None:
    prediction, mask, fetch = predict_prefetch(*args_, **residency)
    ref_prediction, ref_mask, ref_fetch = predict_prefetch_reference(*args_, **residency)
    assert torch.equal(prediction, ref_prediction) and torch.equal(mask, ref_mask), "fused prediction differs"
    assert torch.equal(fetch.sort(1).values, ref_fetch.sort(1).values), "fused fetch lists differ (as sets)"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", default="16,96")
    p.add_argument("--max-blocks", type=int, default=1025, help="blocks per row (16K context + the draft's)")
    p.add_argument("--budget", type=int, default=128, help="budget in blocks")
    p.add_argument("--caps", default="6,128", help="fetch caps in blocks")
    p.add_argument("--group", type=int, default=6, help="layers predicted together (OasisPolicy.PREDICT_GROUP)")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--json", default="select_bench.json")
    args = p.parse_args()
    sink, local = DEFAULTS.sink_blocks, DEFAULTS.local_blocks
    results = []
    for batch in map(int, args.batch.split(",")):
        scores, n, _ = case(batch, args.max_blocks, args.budget, args.layers, seed=batch)
        check_select(scores, n, args.budget, sink, local)
        torch_us = per_call_us(lambda: select_blocks_padded(scores, n, args.budget, sink, local), args.calls)
        fused_us = per_call_us(lambda: select_blocks_fused(scores, n, args.budget, sink, local), args.calls)
        results.append(dict(op="select", batch=batch, rows=batch, cap=None, torch_us=torch_us, fused_us=fused_us))
        rows = batch * args.group
        scores, n, residency = case(rows, args.max_blocks, args.budget, args.layers, seed=rows)
        for cap in map(int, args.caps.split(",")):
            call = (scores, n, args.budget, sink, local, cap, args.max_blocks + 1)
            check_predict(call, residency)
            torch_us = per_call_us(lambda: predict_prefetch_reference(*call, **residency), args.calls)
            fused_us = per_call_us(lambda: predict_prefetch(*call, **residency), args.calls)
            results.append(dict(op="predict", batch=batch, rows=rows, cap=cap, torch_us=torch_us, fused_us=fused_us))
    print(f"{torch.cuda.get_device_name()}, max_blocks {args.max_blocks}, budget {args.budget} blocks, "
          f"sink {sink}, local {local}; us per call (CUDA-graph replay of {args.calls} calls)")
    print(f"{'op':8} {'batch':>5} {'rows':>5} {'cap':>4} {'torch us':>9} {'fused us':>9} {'speedup':>8}")
    for r in results:
        print(f"{r['op']:8} {r['batch']:5d} {r['rows']:5d} {str(r['cap'] or '-'):>4} {r['torch_us']:9.1f} "
              f"{r['fused_us']:9.1f} {r['torch_us'] / r['fused_us']:7.2f}x")
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), max_blocks=args.max_blocks, budget=args.budget,
                       sink=sink, local=local, calls=args.calls, results=results), f, indent=1)


if __name__ == "__main__":
    main()
