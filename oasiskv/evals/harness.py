"""Runs the tasks on dense and on every mode variant, context by context. A variant is an engine
configuration: a KV mode, a budget and (oasis) a fetch cap and a draft source; a mode the engine
does not know is passed through to KVConfig, whose validate() says what is wrong."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import time
from dataclasses import dataclass

import torch

from oasiskv.config import SHORTLIST_MODES, EngineConfig, KVConfig
from oasiskv.evals.haystack import Haystack
from oasiskv.evals.tasks import SYNTHETIC, Settings, build_task

LOOKAHEAD_MODES = ("oasis",)  # modes that take a fetch cap, a draft source and a miss policy
SCORING_MODES = ("quest", "retrieval", "oasis")  # modes that rank blocks by their summaries (--block-score)
SELECTING_MODES = SCORING_MODES + ("oracle",)  # modes that select blocks (--select-per)


@dataclass(frozen=True)
class Variant:
    mode: str
    budget: int | None = None
    fetch_cap: float | None = None
    draft: str | None = None
    block_score: str | None = None
    miss_policy: str | None = None
    select_per: str | None = None
    summary_tokens: int | None = None
    layer_weights: tuple[tuple[int, float], ...] | None = None
    shortlist: float | None = None

    @property
    def series(self) -> str:
        """The variant without its budget: a row of the table, a line of the plot (oasis@0.05, quest+mass,
        oasis+mass+fill@0.05, quest+kv-head, quest+sum4, quest+layers(7=2.5,18=2.5)). The default block score, miss
        policy and selection, whole-block summaries and one budget in every layer are not named."""
        text = self.mode
        for value, default in ((self.block_score, KVConfig.block_score), (self.miss_policy, KVConfig.miss_policy),
                               (self.select_per, KVConfig.select_per)):
            text += f"+{value}" if value not in (None, default) else ""
        text += f"+sum{self.summary_tokens}" if self.summary_tokens is not None else ""
        if self.layer_weights:
            text += "+layers(" + ",".join(f"{layer}={w:g}" for layer, w in self.layer_weights) + ")"
        text += f"+shortlist{self.shortlist:g}" if self.shortlist else ""
        text += f"@{self.fetch_cap:g}" if self.fetch_cap is not None else ""
        return text + (f" {self.draft}" if self.draft else "")

    @property
    def label(self) -> str:
        return self.series if self.mode == "dense" else f"{self.series} budget={self.budget}"


DENSE = Variant("dense")


def expand_variants(modes: list[str], budgets: list[int], caps: list[float] | None, drafts: list[str] | None,
                    block_scores: list[str] | None = None, miss_policies: list[str] | None = None,
                    select_per: list[str] | None = None, summary_tokens: list[int] | None = None,
                    layer_weights: list[tuple] | None = None, shortlists: list[float] | None = None) -> list[Variant]:
    """Every non-dense mode at every budget; lookahead modes also at every cap, draft source and miss policy,
    the modes that score blocks at every block score and summary size, those that select at every
    --select-per and --layer-weights, quest, retrieval and oasis at every --shortlist."""
    out = []
    for mode in dict.fromkeys(modes):
        if mode == "dense":
            continue
        scores = list(dict.fromkeys(block_scores or [None])) if mode in SCORING_MODES else [None]
        sizes = list(dict.fromkeys(summary_tokens or [None])) if mode in SCORING_MODES else [None]
        scopes = list(dict.fromkeys(select_per or [None])) if mode in SELECTING_MODES else [None]
        weightings = list(dict.fromkeys(layer_weights or [None])) if mode in SELECTING_MODES else [None]
        factors = list(dict.fromkeys(shortlists or [None])) if mode in SHORTLIST_MODES else [None]
        for scope, size, score, weights, factor, budget in itertools.product(scopes, sizes, scores, weightings,
                                                                              factors, budgets):
            shared = dict(block_score=score, select_per=scope, summary_tokens=size, layer_weights=weights or None,
                          shortlist=factor or None)
            if mode in LOOKAHEAD_MODES:
                out += [Variant(mode, budget, c, d, miss_policy=m, **shared)
                        for m in dict.fromkeys(miss_policies or [None])
                        for c in caps or [None] for d in drafts or [None]]
            else:
                out.append(Variant(mode, budget, **shared))
    return out


def split_runnable(variants: list[Variant], block_size: int) -> tuple[list[Variant], list[Variant]]:
    """(runnable, skipped): a fetch cap below one block at a budget fetches nothing, so that point
    of a cap x budget sweep is skipped (e.g. cap 0.01 at budgets below 1600 tokens of 16-token blocks)."""
    def fetches(v: Variant) -> bool:
        return v.fetch_cap is None or KVConfig(budget=v.budget, fetch_cap=v.fetch_cap).fetch_blocks(block_size) >= 1
    return [v for v in variants if fetches(v)], [v for v in variants if not fetches(v)]


def variant_config(base: EngineConfig, v: Variant) -> EngineConfig:
    changes = {}
    for name in ("budget", "fetch_cap", "draft", "block_score", "miss_policy", "select_per", "summary_tokens",
                 "layer_weights", "shortlist"):
        if getattr(v, name) is not None:
            changes[name] = getattr(v, name)
    missing = [n for n in changes if n not in {f.name for f in dataclasses.fields(KVConfig)}]
    if missing:
        raise ValueError(f"this engine's KVConfig has no field {missing[0]!r} (mode {v.mode} not available yet?)")
    from oasiskv.models.loader import model_config_of

    kv = base.kv.for_mode(v.mode, **changes)
    kv.validate(base.cache.block_size, model_config_of(base.model).num_layers)  # before any weights load
    return base.replace(kv=kv)


def sized_config(base: EngineConfig, context: int, batch: int) -> EngineConfig:
    """Room for `batch` requests of `context` tokens and no more: a pool sized for the work keeps
    the CPU runs fast and never preempts (a preempted request would recompute by prefill)."""
    per_request = -(-context // base.cache.block_size) + 2
    cache = base.cache if base.cache.num_kv_blocks else dataclasses.replace(base.cache,
                                                                           num_kv_blocks=batch * per_request)
    sched = dataclasses.replace(base.scheduler, max_num_seqs=batch)
    return base.replace(cache=cache, scheduler=sched, show_progress=False)


_LOADED: dict[str, object] = {}  # models loaded under shared_weights, kept for the process


@contextlib.contextmanager
def shared_weights():
    """Loads each model once per process for all the engines built inside: the engine calls
    oasiskv.engine.engine.load_model, whose result (weights, tokenizer) is read-only, so engines of
    different KV modes can share it."""
    import oasiskv.engine.engine as engine_module

    original = engine_module.load_model

    def load_once(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in _LOADED:
            _LOADED[key] = original(*args, **kwargs)
        return _LOADED[key]

    engine_module.load_model = load_once
    try:
        yield
    finally:
        engine_module.load_model = original


def build_llm(config: EngineConfig):
    from oasiskv.api import LLM

    return LLM.from_config(config)


def release(llm) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_eval(base: EngineConfig, contexts: list[int], variants: list[Variant], task_names: list[str],
             settings: Settings, documents: list[str], batch: int, log=print, checkpoint=None,
             outputs=None) -> list[dict]:
    """Rows of {context, variant, series, mode, budget, fetch_cap, draft, task, metric, value, dense};
    checkpoint(rows so far), if given, is called after each configuration (partial results survive), and
    outputs (an evals.outputs.OutputLog) is given each configuration's generated outputs."""
    tasks = [build_task(n) for n in task_names]
    check_contexts(base, contexts)
    for v in variants:
        variant_config(base, v)  # fail before any work on a mode or flag the engine does not accept
    rows = []
    with shared_weights():
        for context in contexts:
            config = sized_config(base, context, batch)
            llm = build_llm(variant_config(config, DENSE))
            hay = Haystack(documents, llm.tokenizer)
            inputs = {t.name: t.prepare(hay, context, settings) for t in tasks}
            dense, references = run_variant(llm, DENSE, tasks, inputs, settings, None, context, log)
            if outputs:
                outputs.write(context, DENSE.label, inputs, references, None, llm.tokenizer.decode)
            release(llm)
            rows += dense
            if checkpoint:
                checkpoint(rows)
            dense_values = {(r["task"], r["metric"]): r["value"] for r in dense}
            for v in variants:
                llm = build_llm(variant_config(config, v))
                found, produced = run_variant(llm, v, tasks, inputs, settings, references, context, log)
                if outputs:
                    outputs.write(context, v.label, inputs, produced, references, llm.tokenizer.decode)
                release(llm)
                for r in found:
                    r["dense"] = dense_values.get((r["task"], r["metric"]))
                rows += found
                if checkpoint:
                    checkpoint(rows)
    return rows


def check_contexts(base: EngineConfig, contexts: list[int]) -> None:
    """Every context within the model's length (--max-model-len, else the model's own), before any weights load
    (a pool is sized for the contexts asked for)."""
    from oasiskv.models.loader import model_config_of

    limit = base.scheduler.max_model_len or model_config_of(base.model).max_position_embeddings
    too_long = [c for c in contexts if c > limit]
    if too_long:
        raise ValueError(f"--context {too_long[0]} is longer than the model's {limit} tokens")


def run_variant(llm, v: Variant, tasks, inputs, settings, references, context, log):
    rows, produced = [], {}
    t0 = time.perf_counter()
    for t in tasks:
        log(f"[eval] context {context} | {v.label} | {t.name}")
        reference = references[t.name] if references else None
        metrics, produced[t.name] = t.run(llm, inputs[t.name], settings, reference)
        log(f"[eval]   " + ", ".join(f"{m} {value:.4g}" for m, value in metrics.items()))
        rows += [row(context, v, t.name, m, value) for m, value in metrics.items()]
    scores = [r["value"] for r in rows if r["task"] in SYNTHETIC]
    if scores:
        rows.append(row(context, v, "synthetic", "mean_score", sum(scores) / len(scores)))
    stats = llm.engine.stats_dict()
    # lookahead modes: block agreement of the prediction, per layer too (None where no block was judged: a budget
    # at the context attends to every block and predicts nothing)
    if stats.get("kv_agreement") is not None:
        r = row(context, v, "lookahead", "agreement", 100.0 * stats["kv_agreement"])
        r["per_layer"] = [None if a is None else 100.0 * a for a in stats.get("kv_agreement_per_layer", [])]
        rows.append(r)
    rows.append(row(context, v, "run", "seconds", time.perf_counter() - t0))
    return rows, produced


def row(context: int, v: Variant, task: str, metric: str, value: float) -> dict:
    return {"context": context, "variant": v.label, "series": v.series, **dataclasses.asdict(v), "task": task,
            "metric": metric, "value": float(value), "dense": float(value) if v.mode == "dense" else None}
