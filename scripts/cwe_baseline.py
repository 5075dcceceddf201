"""What the common-words task (cwe) gives an answer that aggregates nothing: the first or the last word of its list,
scored as the eval scores a model's output. The samples are the eval's own (same seed derivation, 40 a context).

    PYTHONPATH=. python scripts/cwe_baseline.py [--cache-dir DIR] [--samples 40] [--context 4096,8192]
"""
from __future__ import annotations

import argparse

from oasiskv.evals.haystack import Haystack
from oasiskv.evals.synthetic import string_match_all
from oasiskv.evals.tasks import Settings, Synthetic
from oasiskv.evals.texts import load_corpus
from oasiskv.models.loader import embedded_default_path
from oasiskv.models.tokenizer import HFTokenizer


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
        first = last = 0.0
        for sample in samples:
            words = tokenizer.decode(sample.prompt_ids).split("\n\n")[1].split(", ")
            first += string_match_all(f'{words[0]}"', sample.answers)
            last += string_match_all(f'{words[-1]}"', sample.answers)
        n = len(samples)
        print(f"context {context}: first listed word {100 * first / n:.1f}, last listed word {100 * last / n:.1f} "
              f"({n} samples)")


if __name__ == "__main__":
    main()
