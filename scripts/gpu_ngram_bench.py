"""Device time of the prompt-lookup kernel (kernels/ngram_lookup.py) at the #4 shape: one launch drafts for every
decode row of a step. Checks the kernel against the torch twin on the same inputs, then times both.

    PYTHONPATH=. python scripts/gpu_ngram_bench.py [--batch 16] [--context 16384] [--json FILE]"""
from __future__ import annotations

import argparse
import json

import torch

from oasiskv.kernels.ngram_lookup import ngram_lookup, ngram_lookup_reference
from scripts.gpu_select_bench import per_call_us


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--json")
    args = p.parse_args()
    b, bs = args.batch, args.block_size
    nblocks = -(-args.context // bs)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, args.vocab, (b * nblocks + 8, bs), generator=gen, dtype=torch.int32).cuda()
    tables = torch.randperm(b * nblocks, generator=gen).view(b, nblocks).to(torch.int32).cuda()
    lens = torch.full((b,), args.context, dtype=torch.int32).cuda() - torch.arange(b, dtype=torch.int32).cuda()
    out, ref = torch.empty(b, dtype=torch.long).cuda(), torch.empty(b, dtype=torch.long).cuda()
    ngram_lookup(pool, tables, lens, out)
    ngram_lookup_reference(pool, tables, lens, ref)
    same = torch.equal(out, ref)
    kernel = per_call_us(lambda: ngram_lookup(pool, tables, lens, out), calls=50)
    twin = per_call_us(lambda: ngram_lookup_reference(pool, tables, lens, ref), calls=5)
    tokens_bytes = int(lens.sum()) * 4
    row = {"batch": b, "context": args.context, "kernel_us": round(kernel, 2), "torch_twin_us": round(twin, 1),
           "equal_to_twin": same, "token_bytes": tokens_bytes,
           "effective_GBps": round(tokens_bytes / kernel / 1e3, 1), "gpu": torch.cuda.get_device_name()}
    print(f"ngram lookup b{b} x {args.context}: kernel {kernel:.1f} us ({row['effective_GBps']} GB/s of tokens), "
          f"torch twin {twin:.0f} us, equal: {same}")
    if args.json:
        json.dump([row], open(args.json, "w"), indent=1)
    if not same:
        raise SystemExit("the kernel's drafts differ from the torch twin's")


if __name__ == "__main__":
    main()
