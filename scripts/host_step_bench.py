"""Host time of the per-step pieces the seventh session rewrote, against the forms they replaced, on this
machine's CPU: block tables (one torch.tensor per request vs block_table_array), the draft's context
(a prompt + output copy per request vs a TokenView), the n-gram tables of a new prompt and the n-gram lookups
of a decode step; and the runner's whole `prepare` of a decode step, its block tables converted whole (no table
epoch) or kept between steps (KeptTables), with no device copy.

    PYTHONPATH=. python scripts/host_step_bench.py [--requests 16] [--context 16384]
        [--ngram-before FILE]   # e.g. the module before: git show bd9c976^:oasiskv/lookahead/ngram.py > FILE
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import time

import torch

from oasiskv.engine.request import TokenView
from oasiskv.engine.runner import ModelRunner, block_table_array
from oasiskv.engine.scheduler import ScheduledChunk
from oasiskv.policies.base import KVPolicy
from oasiskv.lookahead.ngram import NgramDraft


def ms(fn, repeat: int) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--ngram-before", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    b, n = args.requests, args.context
    tables = [[rng.randrange(1 << 20) for _ in range(n // 16 + 1)] for _ in range(b)]
    prompt = [rng.randrange(1000, 151936) for _ in range(n)]
    outputs = [[1, 2, 3] for _ in range(b)]
    print(f"{b} requests of {n} tokens, per step:")
    runner = ModelRunner(None, KVPolicy(), 16, torch.device("cpu"))

    def chunks(epoch):  # one decode chunk per request, as the scheduler makes them
        return [ScheduledChunk(str(i), [5], n + i, t, True, 7, None if epoch is None else epoch + i)
                for i, t in enumerate(tables)]
    rows = [
        ("block tables, torch.tensor per request", lambda: [torch.tensor(t, dtype=torch.int32) for t in tables]),
        ("block tables, block_table_array", lambda: block_table_array(tables)),
        ("prepare, tables converted whole", lambda: runner.prepare(chunks(None), len(tables[0]))),
        ("prepare, tables kept between steps", lambda: runner.prepare(chunks(0), len(tables[0]))),
        ("draft context, prompt + output copies", lambda: [prompt + o for o in outputs]),
        ("draft context, TokenView, last 4 read", lambda: [TokenView(prompt, o)[-4:] for o in outputs]),
    ]
    for name, fn in rows:
        print(f"  {name:40s} {ms(fn, 100):.3f} ms")
    drafts = [("now", NgramDraft)]
    if args.ngram_before:
        spec = importlib.util.spec_from_file_location("ngram_before", args.ngram_before)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        drafts.insert(0, ("before", module.NgramDraft))
    for name, cls in drafts:
        took = ms(lambda: cls().lookup("r", prompt), 3)
        print(f"  once per request: n-gram tables of its prompt, {name}: {took:.1f} ms")
    for name, cls in drafts:
        print(f"  every decode step: n-gram lookups of {b} requests, one new token each, {name}: "
              f"{decode_lookups_ms(cls(), b, prompt, rng):.3f} ms")


def decode_lookups_ms(draft, requests: int, prompt: list[int], rng: random.Random, steps: int = 300) -> float:
    outputs = [[rng.randrange(151936)] for _ in range(requests)]
    for i, out in enumerate(outputs):  # the prompt's tables, outside the timing
        draft.lookup(str(i), TokenView(prompt, out))
    t = time.perf_counter()
    for _ in range(steps):
        for i, out in enumerate(outputs):
            out.append(rng.randrange(151936))
            draft.lookup(str(i), TokenView(prompt, out))
    return (time.perf_counter() - t) / steps * 1000


if __name__ == "__main__":
    main()
