"""Which block selection would close the synthetic suite's gap to dense? The selection twin on #7's tasks.

scripts/selection_twin.py scores teacher-forced rows; this script runs the eval's RULER-style tasks (the same
samples `oasiskv eval` draws) with greedy answers under each of the twin's rules. As in the engine's quest
mode, the prompt is prefilled densely and every later token is a decode step that attends only to what the
rule selects. Each answer is scored as the eval scores it (every expected string in the text), and compared
with dense's answer token for token.

    OASISKV_EVAL_CACHE=.carry/eval-cache python scripts/twin_tasks.py --context 8192 --budget 2048 \
        --tasks niah_single,niah_multikey,niah_multivalue,vt --samples 10 --scores bound,mass,oracle \
        --block-sizes 16,4 --json twin_tasks.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
from tqdm.auto import tqdm

sys.path.insert(0, ".")
from scripts import selection_twin as twin  # noqa: E402

DEFAULT_TASKS = "niah_single,niah_multikey,niah_multivalue,vt"  # cwe: dense itself fails it (ACCURACY.md)


@torch.inference_mode()
def greedy_answers(model, prompt: list[int], max_tokens: int, rules: list, eos: set[int]) -> list[list[int]]:
    """Per rule (None: dense), greedy tokens after `prompt`: one dense prefill shared by every rule (its first
    token is every rule's), then decode steps under the rule until `max_tokens` or an end-of-sequence token."""
    from transformers import DynamicCache

    dev = model.device
    cache = DynamicCache(config=model.config)
    twin.active = None
    first = int(model(torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True,
                      logits_to_keep=1).logits[0, -1].argmax())
    out = []
    try:
        for rule in rules:
            twin.active = rule
            rule_cache, tokens = copy.deepcopy(cache), [first]
            while len(tokens) < max_tokens and tokens[-1] not in eos:
                logits = model(torch.tensor([[tokens[-1]]], device=dev), past_key_values=rule_cache,
                               use_cache=True).logits
                tokens.append(int(logits[0, -1].argmax()))
            out.append(tokens)
    finally:
        twin.active = None
    return out


def score_rules(labels: list[str], per_task: dict[str, list[list[dict]]]) -> list[dict]:
    """per_task: task -> per sample, per rule (dense first) {"score", "tokens"}. Per rule: each task's score in
    points, the mean over tasks, its drop against dense, and the share of answers identical to dense's."""
    rows = []
    for i, label in enumerate(labels):
        tasks, same = {}, []
        for task, samples in per_task.items():
            tasks[task] = round(100 * sum(s[i]["score"] for s in samples) / len(samples), 2)
            same += [s[i]["tokens"] == s[0]["tokens"] for s in samples]
        rows.append({"rule": label, "tasks": tasks, "mean": round(sum(tasks.values()) / len(tasks), 2),
                     "same_answers": round(100 * sum(same) / len(same), 2)})
    for row in rows:
        row["drop"] = round(rows[0]["mean"] - row["mean"], 2)
    return rows


def join_runs(paths: list[str]) -> list[dict]:
    """One table from runs over different tasks (say, one process per task) with the same rules."""
    labels, per_task = None, {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        mine = [r["rule"] for r in run["results"]]
        if labels not in (None, mine):
            raise SystemExit(f"error: {path} has other rules than the runs before it")
        labels = mine
        per_task.update(run["per_task"])
    return score_rules(labels, per_task)


def print_table(rows: list[dict]) -> None:
    tasks = list(rows[0]["tasks"])
    print(f"{'rule':34} " + " ".join(f"{t:>15}" for t in tasks) + f" {'mean':>6} {'drop':>6} {'same answers':>12}")
    for r in rows:
        print(f"{r['rule']:34} " + " ".join(f"{r['tasks'][t]:>15}" for t in tasks)
              + f" {r['mean']:>6} {r['drop']:>6} {r['same_answers']:>12}")


def samples_for(path: str, args) -> tuple[dict[str, list], object]:
    """The eval's own samples per task (oasiskv/evals/tasks.py, Synthetic.prepare, with its seeds) and the haystack."""
    from oasiskv.evals.haystack import Haystack
    from oasiskv.evals.tasks import Settings, Synthetic
    from oasiskv.evals.texts import load_corpus
    from oasiskv.models.tokenizer import HFTokenizer

    hay = Haystack(load_corpus(args.corpus), HFTokenizer.from_gguf(path))
    settings = Settings(samples=args.samples, seed=args.task_seed, chat=args.chat)
    return {task: Synthetic(task).prepare(hay, args.context, settings) for task in args.tasks.split(",")}, hay


def config_eos(config) -> list:
    eos = getattr(config, "eos_token_id", None)
    return [] if eos is None else eos if isinstance(eos, list) else [eos]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF; default: the engine's (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--tasks", default=DEFAULT_TASKS)
    p.add_argument("--samples", type=int, default=10, help="per task")
    p.add_argument("--task-seed", type=int, default=0, help="the eval's --task-seed")
    p.add_argument("--chat", action="store_true", help="the eval's --chat")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--block-sizes", default="16")
    p.add_argument("--scores", default="bound,mass,oracle", help="any of bound, mass, oracle")
    p.add_argument("--summary-tokens", default="", help="as scripts/selection_twin.py's")
    p.add_argument("--per-kv-head", action=argparse.BooleanOptionalAction, default=True,
                   help="also one selection per KV head (default: yes)")
    p.add_argument("--combine", default="sum", help="as scripts/selection_twin.py's")
    twin.add_layer_arguments(p)
    p.add_argument("--corpus", default="austen")
    p.add_argument("--json", default=None)
    p.add_argument("--join", nargs="+", default=None, metavar="RUN.json",
                   help="print one table of runs made on different tasks with the same rules, instead of running")
    args = p.parse_args()
    if args.join:
        print_table(join_runs(args.join))
        return
    from oasiskv.evals.synthetic import score_output
    from oasiskv.models.loader import embedded_default_path

    path = args.model or embedded_default_path()
    rules = twin.parse_rules(args)
    model = twin.load_model(path, getattr(torch, args.dtype))
    rules = twin.with_layer_variants(rules, args, model.config.num_hidden_layers)
    samples, hay = samples_for(path, args)
    eos = set(hay.tokenizer.eos_token_ids) | {int(e) for e in config_eos(model.config)}
    t0 = time.perf_counter()
    per_task = {}
    for task, items in samples.items():
        per_task[task] = []
        for x in tqdm(items, desc=task):
            answers = greedy_answers(model, x.prompt_ids, x.max_tokens, [None, *rules], eos)
            per_task[task].append([{"tokens": a, "score": score_output(task, hay.tokenizer.decode(a), x.answers)}
                                   for a in answers])
    rows = score_rules(["dense", *(r.label for r in rules)], per_task)
    print(f"\n{args.samples} samples a task, context {args.context}, budget {args.budget}, "
          f"{time.perf_counter() - t0:.0f} s")
    print_table(rows)
    if args.json:
        texts = {t: [[hay.tokenizer.decode(r["tokens"]) for r in s] for s in v] for t, v in per_task.items()}
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows, "answers": texts, "per_task": per_task}, f)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
