"""GPU check of the oasis machinery (copy stream, events, zero-copy gathers): with a perfect draft and
no fetch cap, oasis must give quest's greedy tokens; retrieval must too. Random-weight model, fp32 so
that the comparison is about the KV machinery, not bf16 rounding. Prints one line per mode and
exits non-zero on a mismatch.

    python scripts/gpu_oasis_check.py [--model qwen3-0.6b] [--context 2048] [--steps 64] [--batch 4]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.lookahead.base import DraftSource


class TeacherDraft(DraftSource):
    """Drafts the token a reference run produced next (a perfect draft)."""

    name = "teacher"

    def __init__(self, prompt_len: dict[str, int], outputs: dict[str, list[int]]):
        self.prompt_len, self.outputs = prompt_len, outputs

    def propose(self, chunks, captured):
        out = {}
        for c in chunks:
            if c.sampled:
                i = len(c.context) - self.prompt_len[c.request_id]
                ref = self.outputs[c.request_id]
                out[c.request_id] = ref[i] if i < len(ref) else c.context[-1]
        return out


def run(args, mode: str, prompts, teacher=None, **kv):
    cfg = EngineConfig(model=args.model, load_format="dummy", dtype="float32", show_progress=False,
                       kv=KVConfig(mode=mode, budget=args.budget, host_kv_gb=8, **kv),
                       cache=CacheConfig(gpu_memory_gb=40),
                       scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_model_len=args.context + args.steps + 64))
    engine = LLMEngine(cfg)
    if teacher is not None:
        engine.drafter = teacher
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    out = {str(i): engine.requests[str(i)].output_token_ids for i in range(len(prompts))}
    return out, engine.stats_dict(), time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--budget", type=int, default=512)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (args.context + 37 * i,), generator=gen).tolist() for i in range(args.batch)]
    quest, _, t_q = run(args, "quest", prompts)
    print(f"quest      {t_q:.1f}s")
    ok = True
    retrieval, _, t_r = run(args, "retrieval", prompts)
    print(f"retrieval  {t_r:.1f}s  equal to quest: {retrieval == quest}")
    ok &= retrieval == quest
    teacher = TeacherDraft({str(i): len(pr) for i, pr in enumerate(prompts)}, quest)
    for cap, policy in ((1.0, "skip"), (0.05, "fetch")):
        oasis, stats, t_o = run(args, "oasis", prompts, teacher, fetch_cap=cap, miss_policy=policy)
        keys = ("kv_agreement", "kv_hit_rate", "kv_misses", "kv_prefetched_blocks", "kv_max_prefetched_blocks",
                "kv_fetch_cap_blocks", "kv_time_prefetch_s", "kv_time_prefetch_exposed_s")
        print(f"oasis cap {cap} miss {policy}  {t_o:.1f}s  equal to quest: {oasis == quest}  "
              + " ".join(f"{k}={stats.get(k)}" for k in keys))
        ok &= oasis == quest
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
