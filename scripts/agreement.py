"""Lookahead agreement of each draft source on real long texts: per layer, the share of the true
next-step selection that the previous step's prediction contained (oasis mode, greedy decoding).

Texts every Python install has: the language reference prose of pydoc_data/topics.py and the source
of the standard library's own modules. Prompts are the first CONTEXT tokens; the model continues.

    PYTHONPATH=. python scripts/agreement.py --contexts 4096,8192 --drafts ngram,repeat[,eagle3,ngram+eagle3,teacher]
        [--draft-model DIR] [--budget 2048] [--fetch-cap 0.05] [--miss-policy skip|fetch] [--working-set TOKENS]
        [--steps 128] [--host-kv-gb GB] [--json FILE]

`teacher` drafts the tokens of a quest run at the same budget: the ceiling of any draft source.
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time

from oasiskv.api import LLM, SamplingParams
from oasiskv.config import HEAD_DRAFTS
from oasiskv.lookahead.teacher import TeacherDraft


def long_texts() -> dict[str, str]:
    lib = sysconfig.get_paths()["stdlib"]
    with open(os.path.join(lib, "pydoc_data", "topics.py"), encoding="utf-8") as f:
        namespace: dict = {}
        exec(compile(f.read(), "topics.py", "exec"), namespace)  # a dict of reference-manual topics
    prose = "\n\n".join(namespace["topics"][k] for k in sorted(namespace["topics"]))
    code = ""
    for name in ("argparse.py", "inspect.py", "typing.py", "dataclasses.py"):
        with open(os.path.join(lib, name), encoding="utf-8") as f:
            code += f.read()
    return {"reference-prose": prose, "stdlib-code": code}


def measure(args, draft: str, context: int, prompts: dict[str, list[int]]) -> dict:
    """One oasis run of every prompt with this draft source. `teacher` first runs quest at the same budget
    and then drafts its tokens: the ceiling of any draft (exact while the oasis run follows quest's
    tokens, which --miss-policy fetch guarantees; the row says how far it followed)."""
    reference = generate(args, "quest", None, context, prompts) if draft == "teacher" else None
    t = time.perf_counter()
    outputs, stats = generate(args, "oasis", draft, context, prompts, reference)
    row = {"draft": draft, "context": context, "budget": args.budget, "fetch_cap": args.fetch_cap,
           "miss_policy": args.miss_policy, "working_set": args.working_set or args.budget,
           "steps": args.steps, "texts": list(prompts), "seconds": round(time.perf_counter() - t, 1)}
    for key in ("kv_agreement", "kv_agreement_per_layer", "kv_hit_rate", "kv_misses", "kv_selected_blocks",
                "kv_prefetch_bytes_per_step"):
        row[key.removeprefix("kv_")] = stats.get(key)
    row["draft_accuracy"] = stats.get("draft_accuracy")  # share of drafts equal to the next token
    if reference is not None:
        pairs = [(a, b) for name in prompts for a, b in zip(outputs[name], reference[0][name])]
        row["follows_reference"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
    return row


def generate(args, mode: str, draft: str | None, context: int, prompts: dict[str, list[int]], reference=None):
    """Greedy continuations of the prompts (request ids: the texts' names) and the engine's statistics."""
    drafted = "repeat" if draft == "teacher" else draft  # the teacher replaces it once the engine is built
    kv = dict(fetch_cap=args.fetch_cap, draft=drafted, miss_policy=args.miss_policy,
              draft_model=args.draft_model if drafted in HEAD_DRAFTS else None, working_set=args.working_set,
              host_kv_gb=args.host_kv_gb) if mode == "oasis" else {}
    llm = LLM(args.model, show_progress=False, kv_mode=mode, kv_budget=args.budget,
              max_model_len=context + args.steps + 16, max_num_batched_tokens=8192, **kv)
    engine = llm.engine
    if reference is not None:
        engine.drafter = TeacherDraft({name: len(ids) for name, ids in prompts.items()}, reference[0])
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    for name, ids in prompts.items():
        engine.add_request(ids, params, request_id=name)
    while engine.has_unfinished():
        engine.step()
    outputs = {name: engine.requests[name].output_token_ids for name in prompts}
    stats = engine.stats_dict()
    del llm, engine
    return outputs, stats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", default="4096,8192")
    p.add_argument("--drafts", default="ngram,repeat")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--fetch-cap", type=float, default=0.05)
    p.add_argument("--miss-policy", default="skip", choices=("skip", "fetch"),
                   help="fetch: every run produces quest's tokens, so drafts are compared on the same contexts")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--working-set", type=int, default=None, help="GPU-resident tokens per request per layer "
                   "(default: the budget)")
    p.add_argument("--host-kv-gb", type=float, default=None, help="host KV store size (default: what the machine "
                   "can spare, capped at 2 GiB on a CPU; set it when other processes hold most of the memory)")
    p.add_argument("--json", default="results/agreement.json")
    args = p.parse_args()
    tokenizer = LLM(args.model, show_progress=False, kv_cache_gb=0.05).tokenizer
    encoded = {name: tokenizer.encode(text) for name, text in long_texts().items()}
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        prompts = {name: ids[:context] for name, ids in encoded.items()}
        for draft in args.drafts.split(","):
            row = measure(args, draft, context, prompts)
            rows.append(row)
            print(f"context {context:5d}  draft {draft:12s}  draft tokens right {row['draft_accuracy']:.3f}  "
                  f"agreement {row['agreement']:.4f}  hit rate "
                  f"{row['hit_rate']:.4f}  ({row['seconds']} s)  per layer "
                  + " ".join(f"{a:.3f}" for a in row["agreement_per_layer"])
                  + (f"  follows quest {row['follows_reference']:.3f}" if "follows_reference" in row else ""),
                  flush=True)
            write(args.json, rows)  # after every row: a long run that fails later keeps what it measured
    print(f"wrote {args.json}")


def write(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
