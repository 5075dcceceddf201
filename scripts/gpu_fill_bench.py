"""Time the fill kernel (kernels/miss_fill.py) alone, inside CUDA graphs as the engine runs it (36 launches of
fill_misses in one graph, no counters), at each warp count. Each is checked against the torch twin first.
Commit 3312226 also timed a variant with one reduction per pass, score and block id packed into one int64 key:
at most 2 us faster a layer, not kept (docs/BENCHMARKS.md). Shapes: SmolLM2 at 8K and qwen3-8b at 16K, budget
2048 (128 selected blocks, 129 slots; and 513 slots, the working set of a 4x list at 8K), at the hit rates measured
(91% on SmolLM2 on real text, 28% with random weights). Timed by gpu_select_bench's per_call_us (the median of 20
replays); the twentieth session's numbers in docs/BENCHMARKS.md came from the versions at 3312226 and 473c9e7,
which took the mean; the twenty-ninth session's (compare sizes) from this one.

    PYTHONPATH=. python scripts/gpu_fill_bench.py [--compare-elements 8192,32768] [--json OUT.json]

--compare-elements: kernels/miss_fill.py's _COMPARE_ELEMENTS values to time (slot x column pairs a pass); default:
the committed one.
"""
from __future__ import annotations

import argparse
import itertools

import torch

import oasiskv.kernels.miss_fill as miss_fill
from oasiskv.bench.report import write_json
from oasiskv.kernels.miss_fill import fill_misses, fill_misses_reference
from scripts.gpu_select_bench import per_call_us


def make_case(batch, k, width, slots, hit_rate, seed, device):
    """x_t selects its top k of `width` blocks; each selected block is resident with probability hit_rate, and
    the rest of each row's slots hold blocks it did not select (the previous prediction's)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, width, generator=gen)
    selection = scores.topk(k, dim=1).indices.int()
    block_of = torch.full((batch, slots), -1, dtype=torch.int32)
    attended = torch.full((batch, k + 1), -1, dtype=torch.int32)
    for b in range(batch):
        hit = torch.rand(k, generator=gen) < hit_rate
        others = torch.tensor(sorted(set(range(width)) - set(selection[b].tolist())))
        spare = others[torch.randperm(len(others), generator=gen)[:slots - int(hit.sum())]]
        held = torch.cat([selection[b][hit], spare.int()])
        block_of[b, :len(held)] = held[torch.randperm(len(held), generator=gen)]
        attended[b, :k] = torch.where(hit, selection[b], -1)
    rows = torch.arange(batch)  # int64, as the policy's
    nblocks = torch.full((batch,), width, dtype=torch.int32)
    return [t.to(device) for t in (attended, selection, scores, block_of, rows, nblocks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--compare-elements", default=str(miss_fill._COMPARE_ELEMENTS))
    args = parser.parse_args()
    device = torch.device("cuda")
    shapes = {"smollm2 8K b32, hit 91%": (32, 128, 513, 129, 0.91),
              "qwen3-8b 16K b43, hit 91%": (43, 128, 1025, 129, 0.91),
              "qwen3-8b 16K b43, hit 28%": (43, 128, 1025, 129, 0.28),
              "smollm2 8K b50, 513 slots": (50, 128, 513, 513, 0.91)}  # a 4x list's working set
    rows = []
    for shape, dims in shapes.items():
        case = make_case(*dims, seed=0, device=device)
        want, want_counts = fill_misses_reference(*case)
        misses = int(((case[1] >= 0) & (case[0][:, :-1] < 0)).sum()) / dims[0]
        for elements, warps in itertools.product(map(int, args.compare_elements.split(",")), (1, 2, 4, 8)):
            miss_fill._COMPARE_ELEMENTS = elements
            got, counts = fill_misses(*case, num_warps=warps)
            ok = torch.equal(got, want) and torch.equal(counts, want_counts)
            us = per_call_us(lambda: fill_misses(*case, num_warps=warps), calls=36, repeats=20)
            rows.append({"shape": shape, "misses_per_row": round(misses, 1), "compare_elements": elements,
                         "num_warps": warps, "equal_to_twin": ok, "us_per_layer": round(us, 2)})
            print(f"{shape:28s} misses/row {misses:5.1f}  compare {elements:6d}  warps {warps}  equal {ok}  "
                  f"{us:7.2f} us", flush=True)
    if args.json:
        write_json(args.json, {"rows": rows}, torch.device("cuda"))


if __name__ == "__main__":
    main()
