"""Chunked prefill against the whole prompt in one chunk, per mode, on the GPU (random weights, bf16): the first
sampled token's top-5 logprobs and the greedy continuation. Later chunks are attended once by the split kernel
(policies/attention.sdpa: the chunk over its prefix and over itself, merged) and once by the masked kernel it
replaced (SPLIT_MIN_QUERIES raised above every chunk). The masked kernel's distance from the whole prompt is the
yardstick: bf16 attention rounds differently over a chunk boundary either way. Retrieval and oasis run once more with
later chunks reading their prefix from host memory (--prefill-keep-tokens 0), against the prefill keep: the same
values, so the same output to the bit.

    PYTHONPATH=. python3 scripts/gpu_chunked_prefill_check.py [--model qwen3-0.6b] [--context 8192] [--chunk 2048]
        [--modes dense,oasis] [--json FILE]
"""
from __future__ import annotations

import argparse
import gc

import torch

import oasiskv.policies.attention as attention
from oasiskv.bench.report import print_table, write_json
from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.engine.logprobs import LogprobSampler
from scripts.gpu_graph_check import prompts_for

TOP, COMPARED = 20, 5  # logprobs recorded; the whole prompt's most likely tokens compared


def run(args, mode: str, chunk: int, split_min: int, keep: int | None = None) -> list[tuple[list[int], dict]]:
    """Per prompt: the greedy tokens and the first token's top-TOP logprobs {token id: logprob}. keep: retrieval's
    and oasis's --prefill-keep-tokens (default: the engine's)."""
    attention.SPLIT_MIN_QUERIES = split_min
    cfg = EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", show_progress=False,
                       kv=KVConfig(mode=mode, budget=args.budget, host_kv_gb=args.host_gb, prefill_keep_tokens=keep),
                       cache=CacheConfig(gpu_memory_gb=args.gpu_gb),
                       scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_model_len=args.context + 64))
    engine = LLMEngine(cfg)  # the engine itself: the offline API needs pydantic, which the GPU machine lacks
    engine.sampler = sampler = LogprobSampler(engine.sampler)
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts_for(args.prompts, args.context)]
    sampler.wanted.update({rid: TOP for rid in ids})
    while engine.has_unfinished():
        engine.step()
    found = [(engine.requests[rid].output_token_ids, dict(sampler.take(rid)[0].top)) for rid in ids]
    del engine, sampler
    gc.collect()
    torch.cuda.empty_cache()
    return found


def compare(whole, other) -> dict:
    """The largest logprob difference over the whole prompt's COMPARED most likely first tokens (inf: one is not in
    the other run's top TOP), and the share of equal greedy tokens."""
    diff, same, total, first = 0.0, 0, 0, None
    for i, ((tokens_w, top_w), (tokens_o, top_o)) in enumerate(zip(whole, other)):
        likely = sorted(top_w.items(), key=lambda item: -item[1])[:COMPARED]
        diff = max(diff, max(abs(lp - top_o.get(t, float("-inf"))) for t, lp in likely))
        for j, (a, b) in enumerate(zip(tokens_w, tokens_o)):
            same, total = same + (a == b), total + 1
            if a != b and first is None:
                first = (i, j)
    return {"max_logprob_diff": round(diff, 4), "tokens_equal": f"{same}/{total}", "first_divergence": str(first)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--modes", default="dense,oasis")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--gpu-gb", type=float, default=24)
    p.add_argument("--host-gb", type=float, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    default_min, rows = attention.SPLIT_MIN_QUERIES, []
    for mode in args.modes.split(","):
        whole = run(args, mode, args.context + 64, default_min)  # every prompt in one chunk
        split = run(args, mode, args.chunk, default_min)
        rows.append({"mode": mode, "later chunks": "split", "against": "whole", **compare(whole, split)})
        rows.append({"mode": mode, "later chunks": "mask", "against": "whole",
                     **compare(whole, run(args, mode, args.chunk, args.context + 1))})
        if mode in ("retrieval", "oasis"):  # the prefix from the GPU's prefill keep (default) or from host memory
            rows.append({"mode": mode, "later chunks": "split, prefix from host", "against": "split",
                         **compare(split, run(args, mode, args.chunk, default_min, keep=0))})
    print_table(rows, ("mode", "later chunks", "against", "max_logprob_diff", "tokens_equal", "first_divergence"))
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows}, torch.device("cuda"))


if __name__ == "__main__":
    main()
