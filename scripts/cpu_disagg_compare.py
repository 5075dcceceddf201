"""Single-instance oasis against the disaggregated decode (RemoteOasisPolicy) on the same prompts, on the
CPU: tokens, every decode selection, the counters, and the summaries the decode scores against (checked
against the min/max of the keys in the prefill's host store). Prompts are `bench serve`'s random prompts
drawn from the model's vocabulary ("model") or from the 256 it fell back to without /tokenizer_info
("fallback"), which is what the 2026-11-30 GPU run's disaggregated row got through the proxy.

    PYTHONPATH=. UCX_TLS=tcp python scripts/cpu_disagg_compare.py [--wide] [--single-only] \\
        [--prompts model|fallback|both]

--wide: qwen3-8b's widths (hidden 4096, 32/8 heads of 128, MLP 12288, untied lm_head) with --layers
layers (8 GB in fp32 with 3); default a narrow Qwen3 of the same vocabulary."""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from oasiskv.bench.serve import random_prompts
from oasiskv.config import CacheConfig, DisaggConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
from oasiskv.disagg.decode import DecodeEngine
from oasiskv.disagg.export import PrefillEngine
from oasiskv.engine.engine import LLMEngine

VOCAB = 151936
FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def model_dir(wide: bool, layers: int) -> str:
    cfg = {"model_type": "qwen3", "vocab_size": VOCAB, "num_hidden_layers": layers, "rms_norm_eps": 1e-6,
           "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": False, "eos_token_id": 151645,
           **({"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
               "head_dim": 128} if wide else
              {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 32})}
    path = tempfile.mkdtemp(prefix="oasiskv-qwen3-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def log_selections(engine) -> dict[str, list[list[int]]]:
    """request -> every decode selection (sorted block ids), layer after layer, step after step."""
    policy, log, select = engine.policy, {}, engine.policy.select

    def logged(layer, q, tables):
        counts, padded = select(layer, q, tables)
        for rid, row in zip(policy.meta.decode_request_ids, padded.tolist()):
            log.setdefault(rid, []).append(sorted(b for b in row if b >= 0))
        return counts, padded

    policy.select = logged
    return log


def counters(engine) -> dict:
    s = engine.policy.stats()
    return {k: s[k] for k in ("kv_hit_rate", "kv_agreement", "kv_agreement_per_layer")}


def stored_summaries(kv: torch.Tensor, blocks: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """[layers, blocks, 2, Hkv, D]: min and max of the keys stored in a host store's blocks."""
    keys = kv[:, blocks, 0]
    filled = num_tokens - (len(blocks) - 1) * block_size
    out = torch.stack([keys.amin(2), keys.amax(2)], 2)
    out[:, -1] = torch.stack([keys[:, -1, :filled].amin(1), keys[:, -1, :filled].amax(1)], 1)
    return out


def run(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def compare(config: EngineConfig, prompts: list[list[int]], out_len: int, single_only: bool) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    single = LLMEngine(config)
    single_log = log_selections(single)
    for i, ids in enumerate(prompts):  # one at a time, as the decode instance gets them below
        single.add_request(ids, greedy, str(i))
        run(single)
    print("single instance:", json.dumps(counters(single)))
    if single_only:
        return
    blocks = config.cache.num_kv_blocks
    prefill = PrefillEngine(config, DisaggConfig(role="prefill"))
    decode = DecodeEngine(config, DisaggConfig(role="decode", remote_cache_blocks=4, local_kv_blocks=blocks))
    decode_log, summary_diff = log_selections(decode), 0.0
    for i, ids in enumerate(prompts):
        prefill.add_request(ids, FIRST, str(i), kv_transfer_params={"do_remote_decode": True})
        run(prefill)
        params = prefill.exporter.params_of(str(i))
        decode.add_request(ids, greedy, str(i), kv_transfer_params=params)
        scored = decode.policy.summaries.data[:, decode.requests[str(i)].block_ids]
        reference = stored_summaries(prefill.host.kv, params["remote_block_ids"], len(ids), config.cache.block_size)
        summary_diff = max(summary_diff, (scored - reference).abs().max().item())
        run(decode)
    prefill.exporter.close()
    print("decode instance:", json.dumps(counters(decode)))
    same = sum(a == b for rid in single_log for a, b in zip(single_log[rid], decode_log.get(rid, [])))
    tokens_equal = all(single.requests[r].output_token_ids == decode.requests[r].output_token_ids for r in single_log)
    print(f"tokens equal: {tokens_equal}; selections equal: {same}/{sum(map(len, single_log.values()))}; "
          f"decode summaries vs the prefill's stored keys: max |diff| {summary_diff}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", choices=["model", "fallback", "both"], default="both")
    p.add_argument("--wide", action="store_true")
    p.add_argument("--single-only", action="store_true")
    p.add_argument("--layers", type=int, default=None, help="default 3 with --wide, else 6")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--out", type=int, default=24)
    p.add_argument("--num", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    # the GPU run's proportions: budget 1/8 of the context, sink 1, local 4, ~5% of the budget prefetched per step
    kv = KVConfig(mode="oasis", budget=args.ctx // 8, sink_blocks=1, local_blocks=4, fetch_cap=0.0625, draft="ngram")
    config = EngineConfig(model=model_dir(args.wide, args.layers or (3 if args.wide else 6)), load_format="dummy",
                          dtype="float32", device="cpu", show_progress=False, kv=kv,
                          cache=CacheConfig(num_kv_blocks=(args.ctx // 16 + 8) * args.num),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=args.ctx + 64))
    for vocabulary in ["model", "fallback"] if args.prompts == "both" else [args.prompts]:
        vocab = VOCAB if vocabulary == "model" else 256
        prompts = [ids for ids, _ in random_prompts(args.num, args.ctx, args.out, 0.0, vocab, 0)]
        print(f"== prompts from {vocabulary} vocabulary: ids in [{min(map(min, prompts))}, {max(map(max, prompts))}]")
        compare(config, prompts, args.out, args.single_only)


if __name__ == "__main__":
    main()
