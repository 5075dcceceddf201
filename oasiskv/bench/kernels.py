"""`oasiskv bench kernels`: the decode-path kernels against the copy ceilings, all measured in one process.

- gather: N random (layer, block) chunks of a pinned host store into random GPU slots in one launch,
  GB/s against one contiguous pinned host -> GPU copy of the same bytes (checked bit for bit);
- sparse decode attention: one layer, `budget` tokens selected out of `context` per request (sink + local
  window + random blocks), GB/s of the K/V it reads against a device-to-device copy; eager (launch cost
  included, do_bench) and, on the GPU, replayed from a CUDA graph over inputs larger than the L2 (kernel
  time); checked against the torch reference;
- scoring: block scores over the summaries plus the top-k selection, time per layer and per step;
- shortlist: the --shortlist pass's exact mass over a list of --shortlist x the budget (bench/kernel_shortlist.py).
Defaults are Qwen3-8B's shapes at 16K context. On the CPU the torch references run instead (tiny sizes
for tests). The GPU-only details (tile sweeps, the per-chunk memcpy loop) stay in
`python -m oasiskv.bench.kernel_tiered`.
"""
from __future__ import annotations

import argparse
import math

import torch

from oasiskv.bench.ceilings import host_to_device_gbps, memory_copy_gbps, timed_ms
from oasiskv.bench.kernel_paged_decode import make_case
from oasiskv.bench.kernel_shortlist import bench_shortlist
from oasiskv.bench.kernel_tiered import _fill_random_ as fill_random_
from oasiskv.bench.report import print_table, sig, write_json
from oasiskv.config import BenchConfig
from oasiskv.engine.engine import pick_device, pick_dtype
from oasiskv.kernels.block_mass import block_mass_scores_multi, block_mass_scores_multi_reference
from oasiskv.kernels.block_select import block_scores, block_scores_reference
from oasiskv.kernels.selection_rule import select_blocks_padded
from oasiskv.kernels.host_gather import gather_host_blocks, gather_host_blocks_reference
from oasiskv.kernels.sparse_decode import sparse_decode_attention, sparse_decode_reference

BLOCK = 16
REL_ERR_LIMIT = 2e-2  # bf16 inputs and output against the fp32 reference


def add_args(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on the GPU, fp32 on the CPU")
    p.add_argument("--context", type=int, default=d.kernel_context)
    p.add_argument("--batches", default=d.kernel_batches)
    p.add_argument("--budget", type=int, default=2048, help="tokens each request's selection holds")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=36, help="layers per decode step (scoring time per step)")
    p.add_argument("--host-gib", type=float, default=d.kernel_host_gib, help="pinned host store the gather reads")
    p.add_argument("--chunks", type=int, default=d.kernel_chunks, help="(layer, block) chunks per gather")
    p.add_argument("--shortlist", type=float, default=2.0, help="the listed blocks, times the budget's")
    p.add_argument("--json", default=None)


def bench_gather(host_gib: float, chunks: int, kv_heads: int, head_dim: int, dtype, device) -> dict:
    shape = (2, BLOCK, kv_heads, head_dim)
    chunk_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    layers = 4
    blocks = max(chunks, int(host_gib * 2**30) // (layers * chunk_bytes))
    host = torch.empty((layers, blocks, *shape), dtype=dtype, pin_memory=device.type == "cuda")
    if device.type == "cuda":
        fill_random_(host)
    else:
        host.copy_(torch.randn(host.shape))
    slots = torch.empty((layers, chunks, *shape), dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    lists = [torch.randint(0, layers, (chunks,), generator=g, dtype=torch.int32),  # layer of each chunk
             torch.randint(0, blocks, (chunks,), generator=g, dtype=torch.int32),  # its host block
             torch.randperm(chunks, generator=g).int()]  # its slot, each slot once
    lists = [t.to(device) for t in lists]
    gather = gather_host_blocks if device.type == "cuda" else gather_host_blocks_reference
    gather(host, slots, *lists)
    if device.type == "cuda":
        torch.cuda.synchronize()
    src = host[lists[0].cpu().long(), lists[1].cpu().long()]
    correct = torch.equal(slots[lists[0].long(), lists[2].long()].cpu(), src)
    nbytes = chunks * chunk_bytes
    ms = timed_ms(lambda: gather(host, slots, *lists), device)
    contiguous = host_to_device_gbps(device, nbytes)
    return {"chunks": chunks, "chunk_kib": chunk_bytes / 1024, "host_store_gib": sig(host.nbytes / 2**30),
            "bytes": nbytes, "gather_ms": sig(ms), "gather_gbps": sig(nbytes / ms / 1e6),
            "contiguous_h2d_gbps": sig(contiguous), "ratio_to_contiguous": sig(nbytes / ms / 1e6 / contiguous),
            "correct": bool(correct)}


def selection_case(batch: int, context: int, budget: int, shapes: dict, dtype, device, seed: int, rotations: int):
    """`rotations` batches of `batch` requests over one pool, each request selecting budget // 16 blocks:
    the sink, a local window of 8 with the tail, random blocks between. Returns argument tuples."""
    nb = -(-context // BLOCK)
    n_sel = min(budget // BLOCK, nb)
    q, kv, tables, seq_lens = make_case(batch * rotations, context, shapes["q_heads"], shapes["kv_heads"],
                                        shapes["head_dim"], BLOCK, dtype, device, seed)
    g = torch.Generator().manual_seed(seed)
    local = min(8, n_sel - 1)
    cases = []
    for r in range(rotations):
        rows = []
        for _ in range(batch):
            middle = (torch.randperm(nb - 1 - local, generator=g)[: n_sel - 1 - local] + 1).tolist()
            rows.append(sorted([0] + middle + list(range(nb - local, nb))))
        indptr = torch.tensor([0] + [len(x) for x in rows], dtype=torch.int32).cumsum(0).to(torch.int32)
        indices = torch.tensor([b for x in rows for b in x], dtype=torch.int32)
        lo, hi = r * batch, (r + 1) * batch
        cases.append((q[lo:hi], kv, tables[lo:hi], indptr.to(device), indices.to(device), seq_lens[lo:hi],
                      shapes["head_dim"] ** -0.5))
    return cases, n_sel


def bench_sparse_attention(batch: int, context: int, budget: int, shapes: dict, dtype, device,
                           copy_gbps: float) -> dict:
    per_launch = batch * (budget // BLOCK) * 2 * BLOCK * shapes["kv_heads"] * shapes["head_dim"] * dtype.itemsize
    rotations = max(1, math.ceil((256 << 20) / per_launch)) if device.type == "cuda" else 1  # L2 is 60 MB
    cases, n_sel = selection_case(batch, context, budget, shapes, dtype, device, batch, rotations)
    args = cases[0]
    ref = sparse_decode_reference(*args).float()
    attend = sparse_decode_attention if device.type == "cuda" else sparse_decode_reference
    out = attend(*args).float()
    rel_err = ((out - ref).norm() / ref.norm()).item()
    nbytes = per_launch + 2 * args[0].nbytes
    ms = timed_ms(lambda: attend(*args), device)
    row = {"batch": batch, "context": context, "selected_blocks": n_sel, "bytes": nbytes, "rel_err": rel_err,
           "correct": bool(rel_err < REL_ERR_LIMIT and torch.isfinite(out).all()),
           "eager_us": sig(1000 * ms), "eager_gbps": sig(nbytes / ms / 1e6),
           "eager_vs_copy": sig(nbytes / ms / 1e6 / copy_gbps)}
    if device.type == "cuda":
        from triton.testing import do_bench_cudagraph

        def all_cases():
            for c in cases:
                sparse_decode_attention(*c)
        us = do_bench_cudagraph(all_cases, rep=50, return_mode="median") * 1000 / rotations
        row.update(graph_us=sig(us), graph_gbps=sig(nbytes / us / 1e3),
                   graph_vs_copy=sig(nbytes / us / 1e3 / copy_gbps))
    return row


def bench_scoring(batch: int, context: int, budget: int, shapes: dict, layers: int, dtype, device) -> dict:
    nb = -(-context // BLOCK)
    g = torch.Generator(device=device).manual_seed(batch)
    summaries = torch.randn((batch * nb, 2, shapes["kv_heads"], shapes["head_dim"]), generator=g, device=device)
    summaries = torch.stack([summaries.amin(1), summaries.amax(1)], 1).to(dtype)  # min <= max per element
    tables = torch.randperm(batch * nb, generator=g, device=device).view(batch, nb).int()
    nblocks = torch.full((batch,), nb, dtype=torch.int32, device=device)
    q = torch.randn((batch, shapes["q_heads"], shapes["head_dim"]), generator=g, device=device).to(dtype)
    cuda = device.type == "cuda"
    score = block_scores if cuda else block_scores_reference
    mass = block_mass_scores_multi if cuda else block_mass_scores_multi_reference
    scale = shapes["head_dim"] ** -0.5

    def select():
        scores = score(q, summaries, tables, nblocks)
        return select_blocks_padded(scores, nblocks, budget // BLOCK, 1, 4)

    def select_by_mass():
        scores = mass(q[None], summaries, tables, nblocks[None], scale)[0]
        return select_blocks_padded(scores, nblocks, budget // BLOCK, 1, 4)
    ms, mass_ms = timed_ms(select, device), timed_ms(select_by_mass, device)
    summary_bytes = batch * nb * summaries[0].numel() * summaries.element_size()
    return {"batch": batch, "context": context, "blocks": nb, "summary_mb": sig(summary_bytes / 1e6),
            "score_select_us_per_layer": sig(1000 * ms), "score_select_ms_per_step": sig(ms * layers),
            "mass_select_us_per_layer": sig(1000 * mass_ms), "mass_select_ms_per_step": sig(mass_ms * layers),
            "layers": layers}


def checked_batches(args) -> list[int]:
    """--batches as counts; every size checked before a tensor is made."""
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"error: --batches takes comma-separated counts, got {args.batches!r}") from None
    if args.budget % BLOCK or args.budget < 10 * BLOCK:
        raise SystemExit(f"error: --budget must be a multiple of {BLOCK} of at least {10 * BLOCK} tokens")
    rules = [("--batches", args.batches, min(batches) >= 1, "counts of at least 1"),
             ("--context", args.context, args.context >= args.budget, f"at least --budget ({args.budget})"),
             ("--kv-heads", args.kv_heads, args.kv_heads >= 1, "at least 1"),
             ("--q-heads", args.q_heads, args.q_heads >= 1 and args.q_heads % max(args.kv_heads, 1) == 0,
              "a positive multiple of --kv-heads"),
             ("--head-dim", args.head_dim, args.head_dim >= 1, "at least 1"),
             ("--layers", args.layers, args.layers >= 1, "at least 1"),
             ("--host-gib", args.host_gib, args.host_gib > 0, "above 0"),
             ("--chunks", args.chunks, args.chunks >= 1, "at least 1"),
             ("--shortlist", args.shortlist, args.shortlist >= 1, "at least 1 (times the budget)")]
    for flag, value, ok, rule in rules:
        if not ok:
            raise SystemExit(f"error: {flag} must be {rule}, got {value}")
    return batches


def run(args) -> dict:
    try:
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    shapes = {"q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    batches = checked_batches(args)
    copy_gbps = memory_copy_gbps(device)
    gather = bench_gather(args.host_gib, args.chunks, args.kv_heads, args.head_dim, dtype, device)
    attention = [bench_sparse_attention(b, args.context, args.budget, shapes, dtype, device, copy_gbps)
                 for b in batches]
    scoring = [bench_scoring(b, args.context, args.budget, shapes, args.layers, dtype, device) for b in batches]
    shortlist = [row for b in batches
                 for row in bench_shortlist(b, args.context, args.budget, args.shortlist, shapes, dtype, device,
                                            copy_gbps)]
    result = {"kind": "kernels", "dtype": str(dtype), "shapes": shapes, "memory_copy_gbps": sig(copy_gbps),
              "gather": gather, "sparse_attention": attention, "scoring": scoring, "shortlist": shortlist}
    print_kernels(result)
    if args.json:
        write_json(args.json, result, device)
    return result


def print_kernels(r: dict) -> None:
    g = r["gather"]
    print(f"\nmemory copy (device to device, read + write counted): {r['memory_copy_gbps']:.1f} GB/s")
    print(f"gather {g['chunks']} x {g['chunk_kib']:.0f} KiB from a {g['host_store_gib']} GiB host store: "
          f"{g['gather_gbps']:.4g} GB/s = {g['ratio_to_contiguous']:.4g} x one contiguous pinned copy "
          f"({g['contiguous_h2d_gbps']:.4g} GB/s); correct={g['correct']}")
    print("\nsparse decode attention (GB/s of the selected K/V, against the memory copy):")
    print_table(r["sparse_attention"], ("batch", "selected_blocks", "eager_us", "eager_gbps", "eager_vs_copy",
                                        "graph_us", "graph_gbps", "graph_vs_copy", "rel_err", "correct"))
    print("\nscoring + top-k selection (bound: Quest's; mass: --block-score mass):")
    print_table(r["scoring"], ("batch", "blocks", "summary_mb", "score_select_us_per_layer", "score_select_ms_per_step",
                               "mass_select_us_per_layer", "mass_select_ms_per_step"))
    print("\nshortlist pass (GB/s of the listed blocks' keys, against the memory copy; cols: listed blocks a program):")
    print_table(r["shortlist"], ("batch", "listed_blocks", "keys", "cols", "key_mb", "us", "gbps", "vs_copy",
                                 "max_abs_err", "correct"))
