"""Where --draft target goes wrong: per decode step, whether the draft that ran beside it came true, the target's
guess on that draft's row, prompt lookup's match, the draft proposed and the token that followed (greedy oasis
run of the texts of scripts/agreement.py, SmolLM2 on the CPU by default).

    PYTHONPATH=. python scripts/target_draft_study.py [--context 8000] [--steps 128] [--miss-policy skip]
"""
from __future__ import annotations

import argparse
import json

from oasiskv.api import LLM, SamplingParams
from scripts.agreement import long_texts


def record_proposals(engine) -> list[tuple]:
    """(request, position of the token guessed, draft came true, guess, prompt lookup's match, draft) per step."""
    drafter, records = engine.drafter, []
    propose = drafter.propose

    def recording(chunks, captured):
        out = propose(chunks, captured)
        for c in chunks:
            if c.sampled:
                came_true = c.ran_draft is not None and c.ran_draft == c.context[-1]
                records.append((c.request_id, len(c.context), came_true, c.target_guess,
                                drafter.ngram.match(c.request_id, c.context), out[c.request_id]))
        return out

    drafter.propose = recording
    return records


def share(rows, right) -> float | None:
    return round(sum(map(right, rows)) / len(rows), 4) if rows else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--miss-policy", default="skip", choices=("skip", "fetch"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    llm = LLM(args.model, show_progress=False, kv_mode="oasis", kv_budget=2048, fetch_cap=0.05, draft="target",
              miss_policy=args.miss_policy, max_model_len=args.context + args.steps + 16, max_num_batched_tokens=8192)
    engine = llm.engine
    prompts = {name: engine.tokenizer.encode(text)[:args.context] for name, text in long_texts().items()}
    records = record_proposals(engine)
    for name, ids in prompts.items():
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True), request_id=name)
    while engine.has_unfinished():
        engine.step()
    tokens = {n: engine.requests[n].prompt_token_ids + engine.requests[n].output_token_ids for n in prompts}
    rows = [(came, guess, match, draft, tokens[rid][pos]) for rid, pos, came, guess, match, draft in records
            if pos < len(tokens[rid])]
    after_true = [r for r in rows if r[0]]
    after_false = [r for r in rows if not r[0]]
    disagree = [r for r in after_true if r[2] is not None and r[2] != r[1]]
    out = {"context": args.context, "steps": args.steps, "miss_policy": args.miss_policy, "drafts": len(rows),
           "drafts_right": share(rows, lambda r: r[3] == r[4]),
           "after_a_true_draft": len(after_true), "guess_right": share(after_true, lambda r: r[1] == r[4]),
           "after_a_wrong_draft_or_prefill": len(after_false),
           "prompt_lookup_right_there": share(after_false, lambda r: r[3] == r[4]),
           "guess_and_lookup_disagree": len(disagree), "guess_right_there": share(disagree, lambda r: r[1] == r[4]),
           "lookup_right_there": share(disagree, lambda r: r[2] == r[4]),
           "agreement": engine.stats_dict()["kv_agreement"]}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
