"""The sampled tokens' log-probabilities of dense, quest and retrieval with the budget above the context, with and
without preemption (a pool of 14 blocks and 32-token steps force it), each against dense without preemption:
whether the tokens are the same, and the largest log-probability difference per prompt. SmolLM2, CPU (fp32).

    PYTHONPATH=. python scripts/preemption_logprobs.py
"""
from __future__ import annotations

from tests.test_sparse_modes import generate_with_logprobs

TIGHT = dict(num_kv_blocks=14, max_num_batched_tokens=32)


def main() -> None:
    tokens, logprobs, _ = generate_with_logprobs("dense", 2048, kv_cache_gb=0.2)
    runs = [("dense, preempted", "dense", TIGHT), ("quest, preempted", "quest", TIGHT),
            ("retrieval, preempted", "retrieval", TIGHT),
            ("quest, no preemption", "quest", dict(kv_cache_gb=0.2, max_num_batched_tokens=32))]
    for name, mode, kwargs in runs:
        toks, lps, engine = generate_with_logprobs(mode, 2048, **kwargs)
        worst = [max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(lps, logprobs)]
        print(f"{name}: {engine.stats.preemptions} preemptions, tokens as dense's: {toks == tokens}, "
              f"largest |d logprob| per prompt: {', '.join(f'{w:.2e}' for w in worst)}")


if __name__ == "__main__":
    main()
