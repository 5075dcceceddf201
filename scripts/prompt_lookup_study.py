"""Token accuracy of prompt-lookup variants on recorded greedy continuations, offline: quest continues the
agreement texts (scripts/agreement.py) once, then each variant guesses every next token from the context
so far. Variants: the longest earlier match of up to N tokens (latest occurrence, as NgramDraft), or a
majority vote over all earlier occurrences. Also the accuracy over the first --horizon steps only.

    PYTHONPATH=. python scripts/prompt_lookup_study.py [--context 4096] [--steps 256] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

from oasiskv.api import LLM, SamplingParams
from oasiskv.lookahead.ngram import NgramDraft
from scripts.agreement import long_texts


def continuations(context: int, steps: int, budget: int) -> dict[str, tuple[list[int], list[int]]]:
    llm = LLM(None, show_progress=False, kv_mode="quest", kv_budget=budget, max_model_len=context + steps + 16,
              max_num_batched_tokens=8192)
    engine = llm.engine
    prompts = {name: llm.tokenizer.encode(text)[:context] for name, text in long_texts().items()}
    for name, ids in prompts.items():
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), request_id=name)
    while engine.has_unfinished():
        engine.step()
    return {name: (ids, engine.requests[name].output_token_ids) for name, ids in prompts.items()}


def lookup(max_n: int, vote: bool):
    """Brute force: the followers of every earlier occurrence of the longest matching suffix."""
    def guess(ctx: list[int]) -> int:
        for n in range(min(max_n, len(ctx) - 1), 0, -1):
            suffix = ctx[-n:]
            followers = [ctx[end] for end in range(n, len(ctx)) if ctx[end - n:end] == suffix]
            if followers:
                if not vote:
                    return followers[-1]
                counts = Counter(followers)
                return next(x for x in reversed(followers) if counts[x] == max(counts.values()))
        return ctx[-1]
    return guess


def accuracy(guess, runs, horizon: int | None = None) -> float:
    right = total = 0
    for prompt, output in runs.values():
        output = output[:horizon]
        ctx = list(prompt) + output[:1]
        for token in output[1:]:  # the first output token has no draft (the prefill sampled it)
            right += guess(ctx) == token
            total += 1
            ctx.append(token)
    return round(right / total, 4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--horizon", type=int, default=64)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--json", default="results/prompt_lookup_study.json")
    args = p.parse_args()
    runs = continuations(args.context, args.steps, args.budget)
    rows = [{"variant": "NgramDraft (max 3, latest)", "accuracy": accuracy(lambda c: NgramDraft().lookup("r", c), runs),
             f"accuracy_first_{args.horizon}": accuracy(lambda c: NgramDraft().lookup("r", c), runs, args.horizon)}]
    for max_n, vote in [(4, False), (6, False), (8, False), (12, False), (16, False), (3, True), (8, True), (16, True)]:
        rows.append({"variant": f"max {max_n}, {'vote' if vote else 'latest'}",
                     "accuracy": accuracy(lookup(max_n, vote), runs)})
    for row in rows:
        print(row)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
