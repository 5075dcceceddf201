"""`oasiskv eval`: every mode against its own dense anchor, on real long texts.

Engine flags come from oasiskv.cli.add_engine_args; this module replaces the KV ones that become
lists here (--kv-budget, --fetch-cap, --draft, --block-score, --miss-policy,
--select-per, --summary-tokens, --layer-weights) and --kv-mode (use --modes)."""
from __future__ import annotations

import argparse
import sys
import time

# (full run, --quick) defaults of the flags whose value depends on --quick
# (--quick's budget 512 lets oasis run at the default cap: 0.05 x 512 tokens is one block)
SIZES = {"context": ("4096,8192", "1024"), "kv_budget": ("512,1024,2048", "512"), "samples": (20, 2),
         "windows": (8, 2), "scored": (256, 16), "gen_tokens": (256, 16), "batch": (20, 4)}


def csv(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list: {e}")
    return parse


def add_args(p: argparse.ArgumentParser) -> None:
    from oasiskv.cli import add_engine_args, layer_weights

    add_engine_args(p)
    p.conflict_handler = "resolve"  # the list-valued flags below replace the engine's scalar ones
    from oasiskv.evals.tasks import ALL_TASKS
    from oasiskv.evals.texts import CORPORA

    g = p.add_argument_group("eval")
    g.add_argument("--modes", "--kv-mode", dest="modes", type=csv(str),
                   default=csv(str)("dense,quest,retrieval,oasis,oracle"),
                   help="KV modes to compare with dense (dense always runs as the anchor)")
    g.add_argument("--context", type=csv(int), default=None, help=f"context lengths (default {SIZES['context'][0]}; "
                   f"--quick {SIZES['context'][1]})")
    g.add_argument("--kv-budget", type=csv(int), default=None,
                   help=f"budgets in tokens (default {SIZES['kv_budget'][0]}; --quick {SIZES['kv_budget'][1]})")
    g.add_argument("--fetch-cap", type=csv(float), default=None,
                   help="oasis fetch caps, a sweep: each cap is its own row (oasis@0.01, oasis@0.05, ...)")
    g.add_argument("--draft", type=csv(str), default=None, help="oasis draft sources, e.g. ngram,repeat")
    g.add_argument("--block-score", type=csv(str), default=None,
                   help="block scores of the selecting modes (quest, retrieval, oasis), a sweep: bound,mass; a "
                        "row other than the default names its score (quest+mass)")
    g.add_argument("--miss-policy", type=csv(str), default=None,
                   help="oasis's miss policies, a sweep: skip,fill; a row other than the default names its policy "
                        "(oasis+fill@0.05)")
    g.add_argument("--select-per", type=csv(str), default=None,
                   help="what one selection serves, a sweep: layer,kv-head; a kv-head row names it (quest+kv-head)")
    g.add_argument("--summary-tokens", type=csv(int), default=None,
                   help="tokens per block summary of the scoring modes, a sweep: 16,4; a row other than whole "
                        "blocks names it (quest+sum4)")
    g.add_argument("--layer-weights", type=layer_weights, nargs="+", default=None, metavar="L=W[,L=W...]|none",
                   help="budget weights per layer of the selecting modes (as the engine's flag), a sweep of settings "
                        "separated by spaces, none for one budget in every layer: none 7=2.5,18=2.5; a weighted row "
                        "names its weights (quest+layers(7=2.5,18=2.5))")
    g.add_argument("--shortlist", type=csv(float), default=None,
                   help="the second pass of quest, retrieval and oasis, a sweep of factors of the budget, 0 for "
                        "none: 0,2; a row with one names it (quest+shortlist2)")
    g.add_argument("--tasks", type=csv(str), default=list(ALL_TASKS), help=f"subset of {','.join(ALL_TASKS)}")
    g.add_argument("--corpus", default="austen", choices=CORPORA, help="haystack and perplexity text")
    g.add_argument("--cache-dir", default=None, help="where fetched texts live (default ~/.cache/oasiskv/evals)")
    g.add_argument("--samples", type=int, default=None, help="samples per synthetic task")
    g.add_argument("--windows", type=int, default=None, help="perplexity windows (copy, long output: half)")
    g.add_argument("--scored", type=int, default=None, help="teacher-forced tokens per window")
    g.add_argument("--gen-tokens", type=int, default=None, help="greedy tokens of the long-output task")
    g.add_argument("--batch", type=int, default=None, help="requests run at once")
    g.add_argument("--task-seed", type=int, default=0, help="seed of the task generators")
    g.add_argument("--chat", action="store_true", help="wrap synthetic prompts in the chat template")
    g.add_argument("--json", default=None, help="write the results here (rewritten after each configuration)")
    g.add_argument("--plot", default=None, help="write a PNG of drop against budget here")
    g.add_argument("--save-outputs", default=None, metavar="FILE.jsonl",
                   help="write what each configuration generated (synthetic answers, long outputs), a line a sample")
    g.add_argument("--quick", action="store_true", help="a small run for the CPU (a few minutes)")


def fill_sizes(args: argparse.Namespace) -> None:
    """The sizes not given, from SIZES; every size must be at least 1 (a count of 0 divided by zero late in a run)."""
    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            value = quick if args.quick else full
            setattr(args, name, csv(int)(value) if isinstance(value, str) else value)
        values = getattr(args, name)
        if values == []:
            raise SystemExit(f"error: --{name.replace('_', '-')} lists nothing")
        for v in values if isinstance(values, list) else [values]:
            if v < 1:
                raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1, got {v}")
        if isinstance(values, list):  # a value listed twice would run twice and overwrite its own cells
            setattr(args, name, list(dict.fromkeys(values)))


def check_lists(args: argparse.Namespace) -> None:
    """The listed modes and caps, before the dense anchor runs (a bad one was found after it, or made a row that
    was silently skipped)."""
    from oasiskv.config import KV_MODES
    from oasiskv.evals.tasks import ALL_TASKS

    unknown = [t for t in args.tasks if t not in ALL_TASKS]
    if unknown or not args.tasks:  # before the corpus, which may be fetched first
        raise SystemExit(f"error: --tasks takes tasks among {', '.join(ALL_TASKS)}, got {','.join(args.tasks)!r}")
    args.tasks = list(dict.fromkeys(args.tasks))
    bad = [m for m in args.modes if m not in KV_MODES]
    if bad:
        raise SystemExit(f"error: --modes takes modes among {', '.join(KV_MODES)}, got {bad[0]!r}")
    bad_caps = [c for c in args.fetch_cap or [] if not 0 < c <= 1]
    if bad_caps:
        raise SystemExit(f"error: --fetch-cap must be in (0, 1], got {bad_caps[0]:g}")
    if "long_output" in args.tasks and args.gen_tokens >= min(args.context):  # (found once the model had loaded)
        raise SystemExit(f"error: --gen-tokens {args.gen_tokens} must be below the context {min(args.context)}")
    if args.plot and not set(args.modes) - {"dense"}:
        raise SystemExit("error: --plot draws each mode's drop against dense: give --modes beyond dense")


def base_config(args: argparse.Namespace):
    """The engine configuration of the flags, through oasiskv.cli.engine_config with scalar KV values."""
    from oasiskv.cli import check_draft_model, engine_config
    from oasiskv.config import KVConfig

    defaults = KVConfig()
    scalar = dict(vars(args), kv_mode="dense", kv_budget=args.kv_budget[0])
    for name in ("fetch_cap", "draft", "block_score", "miss_policy", "select_per"):
        values = getattr(args, name)
        scalar[name] = values[0] if values else getattr(defaults, name, None)
    scalar["summary_tokens"] = None  # whole blocks: a row with finer summaries names its size (a listed 16 names none)
    scalar["layer_weights"] = ()  # the weighted rows carry their own; the base serves modes that take none
    scalar["shortlist"] = 0.0  # likewise: only the modes that take one
    config = engine_config(argparse.Namespace(**scalar))
    check_draft_model(config)  # before the dense anchor runs
    return config


def main(args: argparse.Namespace) -> None:
    from oasiskv.evals.harness import expand_variants, run_eval, split_runnable
    from oasiskv.evals.outputs import OutputLog
    from oasiskv.evals.report import plot, table, write_json
    from oasiskv.evals.tasks import Settings
    from oasiskv.evals.texts import load_corpus

    fill_sizes(args)
    check_lists(args)
    settings = Settings(samples=args.samples, windows=args.windows, scored=args.scored, gen_tokens=args.gen_tokens,
                        seed=args.task_seed, chat=args.chat)
    t0 = time.perf_counter()
    try:
        config = base_config(args)
        caps = args.fetch_cap or [config.kv.fetch_cap]  # oasis rows always name their cap (oasis@0.05)
        block_size = config.cache.block_size
        sizes = [None if n == block_size else n for n in args.summary_tokens or []]  # whole blocks: not named
        variants, skipped = split_runnable(expand_variants(args.modes, args.kv_budget, caps, args.draft,
                                                           args.block_score, args.miss_policy, args.select_per,
                                                           sizes, args.layer_weights, args.shortlist),
                                           block_size)
        if skipped and not variants and set(args.modes) - {"dense"}:  # (it ran dense alone and said nothing)
            raise ValueError(f"no configuration but dense can run: {', '.join(v.label for v in skipped)} would "
                             f"fetch nothing (a fetch cap must allow at least one block of the budget)")
        documents = load_corpus(args.corpus, args.cache_dir)
        settings_used = {**{k: v for k, v in vars(args).items() if k != "func"},
                         "skipped": [v.label for v in skipped]}
        save = (lambda rows: write_json(args.json, rows, settings_used)) if args.json else None
        outputs = OutputLog(args.save_outputs) if args.save_outputs else None
        rows = run_eval(config, args.context, variants, args.tasks, settings, documents, args.batch,
                        log=lambda m: print(m, file=sys.stderr, flush=True), checkpoint=save, outputs=outputs)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"error: {e}")
    print(table(rows, [v.label for v in skipped]))
    print(f"{len(variants) + 1} configurations x {len(args.context)} contexts in {time.perf_counter() - t0:.0f} s")
    if args.json:
        print(f"wrote {args.json} (also after each configuration)")
    if args.save_outputs:
        print(f"wrote {args.save_outputs} (outputs, a line a sample)")
    if args.plot and variants:
        plot(args.plot, rows)
        print(f"wrote {args.plot}")
