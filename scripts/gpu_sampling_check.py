"""GPU check of vLLM's sampling fields (allowed_token_ids, bad_words, truncate_prompt_tokens, detokenize) where the
CPU tests cannot reach: CUDA graphs and async scheduling. A random-weight model (its tokenizer is bytes, so a bad
word is its UTF-8 bytes), one engine per mode, with async scheduling on and off; each check against another way to
the same tokens. Prints a table; exits non-zero on a failed check.

    PYTHONPATH=. python scripts/gpu_sampling_check.py [--model qwen3-0.6b] [--modes dense,quest,oasis]
"""
from __future__ import annotations

import argparse
import sys

from oasiskv.api import LLM, SamplingParams

ALLOWED = [97, 98, 99, 100, 101]  # "abcde"


def contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i:i + len(word)] == word for i in range(len(ids)))


def checks(llm: LLM, prompts: list[list[int]], tokens: int) -> dict[str, bool]:
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=tokens, ignore_eos=True)
    run = lambda params: [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]  # noqa: E731
    only = run(SamplingParams(**{**vars_of(greedy), "allowed_token_ids": ALLOWED}))
    biased = run(SamplingParams(**{**vars_of(greedy), "logit_bias": {t: 100 for t in ALLOWED}}))
    drawn = run(SamplingParams(**{**vars_of(seeded), "allowed_token_ids": ALLOWED}))
    banned = run(SamplingParams(**{**vars_of(seeded), "allowed_token_ids": ALLOWED, "bad_words": ["ab", "c"]}))
    cut = run(SamplingParams(**{**vars_of(greedy), "truncate_prompt_tokens": 24}))
    alone = [o.outputs[0] for o in llm.generate([p[-24:] for p in prompts], greedy, use_tqdm=False)]
    bare = run(SamplingParams(**{**vars_of(seeded), "detokenize": False}))
    plain = run(seeded)
    return {
        "allowed: greedy = +100 bias": all(a.token_ids == b.token_ids for a, b in zip(only, biased)),
        "allowed: draws in the set": all(set(o.token_ids) <= set(ALLOWED) for o in only + drawn),
        "bad_words: never completed": all(not contains(o.token_ids, [97, 98]) and 99 not in o.token_ids
                                          for o in banned),
        "truncate: = last 24 alone": all(a.token_ids == b.token_ids for a, b in zip(cut, alone)),
        "detokenize off: ids, no text": all(a.token_ids == b.token_ids and a.text == "" for a, b in zip(bare, plain)),
        "_tokens": [o.token_ids for o in drawn + banned + bare],
    }


def vars_of(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in ("temperature", "seed", "max_tokens", "ignore_eos")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--modes", default="dense,quest,oasis")
    parser.add_argument("--context", type=int, default=1500, help="prompt tokens (above the budget: sparse steps)")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    prompts = [[(i * 37 + j * 11) % 256 for j in range(args.context - 50 * i)] for i in range(4)]
    failed, rows = False, []
    for mode in args.modes.split(","):
        found = {}
        for overlap in (True, False):
            llm = LLM(model=args.model, load_format="dummy", dtype="float32", kv_mode=mode, kv_budget=512,
                      async_scheduling=overlap, max_model_len=args.context + 256, gpu_memory_gb=24,
                      show_progress=False)
            found[overlap] = checks(llm, prompts, args.tokens)
            del llm
        same = found[True].pop("_tokens") == found[False].pop("_tokens")
        for overlap, result in found.items():
            for name, ok in result.items():
                rows.append((mode, "async" if overlap else "sync", name, ok))
        rows.append((mode, "both", "async = sync (seeded draws)", same))
    for mode, how, name, ok in rows:
        print(f"{mode:8} {how:6} {name:32} {'ok' if ok else 'FAILED'}")
        failed |= not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
