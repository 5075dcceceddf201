"""What the common-words task (cwe) gives an answer that aggregates nothing: the first or the last special word of its
prompt, scored as the eval scores a model's output (the first word, whole), and a special sentence drawn at random (the
answer's share of the special sentences, read from each prompt: a third). The samples are the eval's own (same seed
derivation, 40 a context); the special sentences and repeats of each context are printed too.

    PYTHONPATH=. python scripts/cwe_baseline.py [--cache-dir DIR] [--samples 40] [--context 4096,8192]
"""
from __future__ import annotations

import argparse
import re

from oasiskv.evals.haystack import Haystack
from oasiskv.evals.synthetic import score_output
from oasiskv.evals.tasks import Settings, Synthetic
from oasiskv.evals.texts import load_corpus
from oasiskv.models.loader import embedded_default_path
from oasiskv.models.tokenizer import HFTokenizer

SPECIAL = re.compile(r"One of the special words is: ([a-z]+)\.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--context", default="4096,8192")
    args = p.parse_args()
    tokenizer = HFTokenizer.from_gguf(embedded_default_path())
    haystack = Haystack(load_corpus("austen", args.cache_dir), tokenizer)
    for context in (int(c) for c in args.context.split(",")):
        samples = Synthetic("cwe").prepare(haystack, context, Settings(samples=args.samples))
        first = last = share = 0.0
        sizes = set()
        for sample in samples:
            words = SPECIAL.findall(tokenizer.decode(sample.prompt_ids))
            first += score_output("cwe", f" {words[0]}.", sample.answers)
            last += score_output("cwe", f" {words[-1]}.", sample.answers)
            share += words.count(sample.answers[0]) / len(words)
            sizes.add((len(words), words.count(sample.answers[0])))
        n = len(samples)
        said = ", ".join(f"{k} special sentences, {r} of them the answer" for k, r in sorted(sizes))
        print(f"context {context}: first special word {100 * first / n:.1f}, last special word {100 * last / n:.1f}, "
              f"a special sentence at random {100 * share / n:.1f} ({n} samples; {said})")


if __name__ == "__main__":
    main()
