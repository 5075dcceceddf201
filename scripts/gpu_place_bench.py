"""Working-set placement on the GPU: the torch placement (~30 small kernels) against the fused Triton kernel,
microseconds per placement (with its copy lists, as TieredPolicy.place asks for them), eager (CUDA events
around a loop of calls: launch overheads included) and replayed from a CUDA graph (device time only).
Each configuration places a cycle of random wanted sets, enough of them that a replay keeps missing and
evicting; both implementations start from the same state, and first run one cycle side by side that
must give identical outputs and tables (the compiled kernel against the torch placement).

    PYTHONPATH=. python scripts/gpu_place_bench.py [--rows 16,96] [--width 129] [--k 6,128] [--out place_bench.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from oasiskv.kv.working_set import WorkingSet

LAYERS, REQUESTS, MAX_BLOCKS = 36, 16, 1026  # qwen3-8b, 16 requests of 16K (1025 blocks + the opened one)


def wanted_sets(r: int, k: int, width: int, n: int, dev) -> list[tuple]:
    """n placements of R rows (rows = (layer, request) pairs as oasis's prediction groups them): each
    row wants k distinct random blocks, and protects only those."""
    layer = torch.arange(r, device=dev) // REQUESTS % LAYERS
    rows = torch.arange(r, device=dev) % REQUESTS
    out = []
    for _ in range(n):
        wanted = torch.rand(r, MAX_BLOCKS, device=dev).argsort(1)[:, :k].to(torch.int32)
        protect = torch.zeros(r, MAX_BLOCKS + 1, dtype=torch.bool, device=dev)
        protect.scatter_(1, wanted.long(), True)
        out.append((layer, rows, wanted, protect))
    return out


def working_set(fused: bool, width: int, dev) -> WorkingSet:
    return WorkingSet(LAYERS, REQUESTS, width, MAX_BLOCKS, dev, fused=fused)


def run_all(ws, sets, step, host_tables) -> None:
    for layer, rows, wanted, protect in sets:
        ws.place_with_copies(layer, rows, wanted, protect, step, host_tables)


def identical(sets, step, host_tables, width, dev) -> bool:
    """Both implementations, compiled, from the same state: equal outputs and tables after every placement."""
    ref, fused = working_set(False, width, dev), working_set(True, width, dev)
    for layer, rows, wanted, protect in sets:
        want = ref.place_with_copies(layer, rows, wanted, protect, step, host_tables)
        got = fused.place_with_copies(layer, rows, wanted, protect, step, host_tables)
        if not all(torch.equal(a, b) for a, b in zip(want, got)):
            return False
    return all(torch.equal(getattr(ref, n), getattr(fused, n)) for n in ("_slot_of", "_block_of", "_last_used"))


def eager_us(ws, sets, step, host_tables, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run_all(ws, sets, step, host_tables)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (repeats * len(sets))


def graph_us(ws, sets, step, host_tables, repeats: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (Triton compiles here)
        run_all(ws, sets, step, host_tables)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all(ws, sets, step, host_tables)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (repeats * len(sets))


def bench(r: int, width: int, k: int, repeats: int, dev) -> dict:
    n = max(8, 3 * width // k)  # enough distinct sets that a cycle keeps missing
    sets = wanted_sets(r, k, width, n, dev)
    host_tables = torch.randint(0, 1 << 20, (r, MAX_BLOCKS + 1), dtype=torch.int32, device=dev)
    step = torch.ones((), dtype=torch.int64, device=dev)
    row = {"rows": r, "width": width, "k": k, "placements_per_cycle": n,
           "identical": identical(sets, step, host_tables, width, dev)}
    for name, fused in (("torch", False), ("fused", True)):
        ws = working_set(fused, width, dev)
        run_all(ws, sets, step, host_tables)  # a full working set before timing
        row[f"{name}_eager_us"] = round(eager_us(ws, sets, step, host_tables, repeats), 2)
        row[f"{name}_graph_us"] = round(graph_us(working_set(fused, width, dev), sets, step, host_tables, repeats), 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="16,96")
    p.add_argument("--width", type=int, default=129)
    p.add_argument("--k", default="6,128")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="place_bench.json")
    args = p.parse_args()
    dev = torch.device("cuda")
    table = [bench(r, args.width, k, args.repeats, dev)
             for r in map(int, args.rows.split(",")) for k in map(int, args.k.split(","))]
    print(f"{'rows':>5} {'width':>5} {'k':>4} | {'torch eager':>11} {'fused eager':>11} | "
          f"{'torch graph':>11} {'fused graph':>11} | identical   (us per placement)")
    for t in table:
        print(f"{t['rows']:>5} {t['width']:>5} {t['k']:>4} | {t['torch_eager_us']:>11} {t['fused_eager_us']:>11} | "
              f"{t['torch_graph_us']:>11} {t['fused_graph_us']:>11} | {t['identical']}")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "placements": table}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
