"""Time oasis's residency check with the draft's placement (kernels/residency.py's fused kernel) alone, inside CUDA
graphs as the engine runs it (36 launches a graph), against the working set's width and the size of the
slot/protected-block compare a pass (kernels/draft_kv.py's _COMPARE_ELEMENTS).

Why: with a 2x shortlist (257 slots a row) the torch profiler gave this kernel 118.6 us a call against 11.8 us
without a list (docs/BENCHMARKS.md, twenty-eighth session). Its placement compares every slot of a row with
every protected block when a draft opens a block that has no slot.

qwen3-8b's shapes: 43 rows, a selection of 128 blocks (90% resident), 1025 blocks a row, a token's K of 8 x 128
bf16. `opened`: none (every draft stays in its tail block) or all (every row's draft opens a block without a
slot, as happens to every row at once every 16 steps when the prompts are equally long). Each call first restores
the tables (the placement changes them); the restore alone is timed too and subtracted. Every variant is checked
against the torch twins first.

    PYTHONPATH=. python scripts/gpu_resident_bench.py [--json OUT.json]
"""
from __future__ import annotations

import argparse

import torch

import oasiskv.kernels.draft_kv as draft_kv
from oasiskv.bench.report import write_json
from oasiskv.kernels.draft_kv import DraftWrite, write_draft_kv_reference
from oasiskv.kernels.residency import COUNTERS, resident_selection, resident_selection_reference
from scripts.gpu_select_bench import per_call_us

ROWS, K, BLOCKS, TOKEN_SHAPE, BLOCK = 43, 128, 1025, (8, 128), 16


def make_case(width: int, opens: bool, device, seed: int = 0):
    """Full working sets of `width` slots; x_t selects K blocks, 90% of them held; drafts open a free block."""
    gen = torch.Generator().manual_seed(seed)
    slot_of = torch.full((1, ROWS, BLOCKS + 1), -1, dtype=torch.int32)
    block_of = torch.full((1, ROWS, width + 1), -1, dtype=torch.int32)
    last_used = torch.randint(0, 50, (1, ROWS, width + 1), generator=gen)
    selection = torch.full((ROWS, K), -1, dtype=torch.int32)
    opened = torch.full((ROWS,), -1, dtype=torch.int32)
    for r in range(ROWS):
        blocks = torch.randperm(BLOCKS - 1, generator=gen)
        held, free = blocks[:width], blocks[width:]
        block_of[0, r, :width] = held.int()
        slot_of[0, r, held] = (r * width + torch.arange(width)).int()
        hits = int(0.9 * K)
        selection[r] = torch.cat([held[torch.randperm(width, generator=gen)[:hits]], free[:K - hits]]).int()
        if opens:
            opened[r] = int(free[-1])
    kv = torch.randn(ROWS * width, 2, BLOCK, *TOKEN_SHAPE, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(ROWS, *TOKEN_SHAPE, generator=gen).to(torch.bfloat16) for _ in range(2))
    tail = torch.arange(ROWS) * width
    offset = torch.where(opened >= 0, 0, 5)
    tables = [t.to(device) for t in (slot_of, block_of, last_used)]
    rest = [t.to(device) for t in (selection, opened, kv, k, v, tail, offset)]
    return tables, rest


def run_fused(tables, rest, counts, predicted, rows, fresh, ids, step, reference=False):
    slot_of, block_of, last_used = tables
    selection, opened, kv, k, v, tail, offset = rest
    draft = DraftWrite(kv, block_of, last_used, tail, offset, k, v, step)
    args = (selection, slot_of, predicted, rows, fresh, *counts, ids, 0, opened)
    if not reference:
        return resident_selection(*args, draft=draft)
    out = resident_selection_reference(*args)
    write_draft_kv_reference(*draft.arguments(slot_of, 0, rows, opened, out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows_t = torch.arange(ROWS, device=device)
    fresh = torch.ones(ROWS, dtype=torch.bool, device=device)
    ids = torch.arange(len(COUNTERS), device=device)
    step = torch.tensor(60, device=device)
    counts = (torch.zeros(ROWS, 8, dtype=torch.int64, device=device), torch.zeros(1, 8, dtype=torch.int64,
                                                                                   device=device))
    results = []
    for width in (129, 257, 513):
        block_w = 1 << (width - 1).bit_length()
        for opens in (False, True):
            pristine, rest = make_case(width, opens, device)
            predicted = torch.rand(pristine[0].shape, device=device) < 0.5
            live = [t.clone() for t in pristine]

            def restore():
                for dst, src in zip(live, pristine):
                    dst.copy_(src)

            restore_us = per_call_us(restore, calls=36, repeats=20)
            ref_tables = [t.clone() for t in pristine]
            ref_rest = [t.clone() for t in rest]
            want = run_fused(ref_tables, ref_rest, counts, predicted, rows_t, fresh, ids, step, reference=True)
            for elements in (512, 2048, 8192, block_w * K):
                draft_kv._COMPARE_ELEMENTS = elements
                restore()
                got_rest = [t.clone() for t in rest]
                got = run_fused(live, got_rest, counts, predicted, rows_t, fresh, ids, step)
                ok = torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(live, ref_tables)) and \
                    torch.equal(got_rest[2], ref_rest[2])

                def call():
                    restore()
                    run_fused(live, rest, counts, predicted, rows_t, fresh, ids, step)

                us = per_call_us(call, calls=36, repeats=20) - restore_us
                chunk = max(2, elements // block_w)
                row = {"slots": width, "opened": "all" if opens else "none", "compare_elements": elements,
                       "chunk": chunk, "equal_to_twins": ok, "us_per_layer": round(us, 2),
                       "restore_us": round(restore_us, 2)}
                results.append(row)
                print(f"slots {width:4d}  opened {row['opened']:4s}  compare {elements:6d} (chunk {chunk:3d})  "
                      f"equal {ok}  {us:8.2f} us  (restore {restore_us:.2f} us subtracted)", flush=True)
    if args.json:
        write_json(args.json, {"rows": results}, torch.device("cuda"))


if __name__ == "__main__":
    main()
