"""The tasks. Each builds its inputs once per context (the same inputs for every mode), runs them on
one engine, and returns its metrics; dense runs first and hands each task a reference (log-prob rows,
output tokens) that the other modes are compared with.

Metrics are in points (percent) where they are shares; `HIGHER_IS_BETTER` orients every drop so that
a positive drop means worse than dense."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from oasiskv.config import SamplingParams
from oasiskv.evals.forced import teacher_forced
from oasiskv.evals.haystack import Haystack
from oasiskv.evals.synthetic import TASKS as SYNTHETIC_TASKS, make_samples, score_output

HIGHER_IS_BETTER = {"ppl": False, "top1_agree": True, "kl": False, "copy_ppl": False, "copy_acc": True,
                    "score": True, "same_tokens": True, "first_divergence": True, "agreement": True}


@dataclass(frozen=True)
class Settings:
    samples: int = 20  # per synthetic task
    windows: int = 8  # perplexity / copy / long-output windows
    scored: int = 256  # teacher-forced tokens per window
    gen_tokens: int = 256  # long-output greedy tokens
    seed: int = 0
    chat: bool = False  # wrap synthetic prompts in the chat template


def rng_for(settings: Settings, task: str, context: int, index: int) -> random.Random:
    return random.Random(f"{settings.seed}/{task}/{context}/{index}")


class Perplexity:
    """Perplexity over the last `scored` tokens of book windows; top-1 agreement with dense and
    KL(dense || mode) at the same positions."""

    name = "ppl"

    def prepare(self, hay: Haystack, context: int, s: Settings):
        return [hay.window_ids(context, rng_for(s, self.name, context, i)) for i in range(s.windows)]

    def run(self, llm, windows, s: Settings, reference=None):
        rows = [r["rows"] for r in reference] if reference else None
        scores = teacher_forced(llm, windows, s.scored, rows, keep_rows=reference is None, desc="perplexity")
        logprobs = [lp for sc in scores for lp in sc.logprobs]
        metrics = {"ppl": math.exp(-sum(logprobs) / len(logprobs))}
        if reference is None:
            metrics.update(top1_agree=100.0, kl=0.0)
            return metrics, [{"rows": sc.rows, "top1": sc.top1} for sc in scores]
        same = [a == b for sc, ref in zip(scores, reference) for a, b in zip(sc.top1, ref["top1"])]
        kls = [k for sc in scores for k in sc.kl]
        metrics.update(top1_agree=100.0 * sum(same) / len(same), kl=sum(kls) / len(kls))
        return metrics, None


class CopyProbe:
    """A passage of half the context fed twice: the second copy is predictable only by attending
    back to the first. Perplexity and top-1 accuracy over the last `scored` tokens."""

    name = "copy"

    def prepare(self, hay: Haystack, context: int, s: Settings):
        half = context // 2
        if s.scored >= half:
            raise ValueError(f"--scored {s.scored} must be below half the context ({half})")
        out = []
        for i in range(max(1, s.windows // 2)):
            passage = hay.window_ids(half, rng_for(s, self.name, context, i))
            out.append(passage + passage)
        return out

    def run(self, llm, windows, s: Settings, reference=None):
        scores = teacher_forced(llm, windows, s.scored, desc="copy probe")
        logprobs = [lp for sc in scores for lp in sc.logprobs]
        truth = [t for w in windows for t in w[-s.scored:]]
        top1 = [t for sc in scores for t in sc.top1]
        acc = 100.0 * sum(a == b for a, b in zip(top1, truth)) / len(truth)
        return {"copy_ppl": math.exp(-sum(logprobs) / len(logprobs)), "copy_acc": acc}, None


class Synthetic:
    """A RULER-style task: greedy answers scored in points (string-match-all; cwe: its first word)."""

    def __init__(self, name: str):
        self.name = name

    def prepare(self, hay: Haystack, context: int, s: Settings):
        seed = rng_for(s, self.name, context, 0).randrange(2 ** 31)
        return make_samples(self.name, hay, context, s.samples, seed, s.chat)

    def run(self, llm, samples, s: Settings, reference=None):
        params = [SamplingParams(temperature=0, max_tokens=x.max_tokens) for x in samples]
        outs = llm.generate([x.prompt_ids for x in samples], params, use_tqdm=True)
        texts = [o.outputs[0].text for o in outs]
        scores = [score_output(self.name, t, x.answers) for t, x in zip(texts, samples)]
        return {"score": 100.0 * sum(scores) / len(scores)}, texts


class LongOutput:
    """Greedy continuation of book windows: share of tokens identical to dense at the same position,
    and the first position where they differ (gen_tokens when they never do)."""

    name = "long_output"

    def prepare(self, hay: Haystack, context: int, s: Settings):
        if s.gen_tokens >= context:
            raise ValueError(f"--gen-tokens {s.gen_tokens} must be below the context {context}")
        return [hay.window_ids(context - s.gen_tokens, rng_for(s, self.name, context, i))
                for i in range(max(1, s.windows // 2))]

    def run(self, llm, prompts, s: Settings, reference=None):
        params = SamplingParams(temperature=0, max_tokens=s.gen_tokens, ignore_eos=True)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=True)]
        if reference is None:
            return {"same_tokens": 100.0, "first_divergence": float(s.gen_tokens)}, outs
        same = [a == b for out, ref in zip(outs, reference) for a, b in zip(out, ref)]
        firsts = [first_difference(out, ref) for out, ref in zip(outs, reference)]
        return {"same_tokens": 100.0 * sum(same) / len(same), "first_divergence": sum(firsts) / len(firsts)}, outs


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


ALL_TASKS = ("ppl", "copy", *SYNTHETIC_TASKS, "long_output")
SYNTHETIC = tuple(SYNTHETIC_TASKS)


def build_task(name: str):
    if name == "ppl":
        return Perplexity()
    if name == "copy":
        return CopyProbe()
    if name == "long_output":
        return LongOutput()
    if name in SYNTHETIC_TASKS:
        return Synthetic(name)
    raise ValueError(f"unknown task {name!r}; choose from {', '.join(ALL_TASKS)}")
