"""GPU check of tensor parallelism (NCCL): the CPU test's scenario (tests/test_tensor_parallel.py: a
random Qwen3-shaped model in fp32, three requests with an abort, a rejected request and a late
arrival) with --tensor-parallel-size N on N GPUs against one GPU, in dense, quest and oasis. Tokens and
rank 0's selection counters must be equal. Then the same on qwen3-0.6b (dummy weights, fp32) at a
longer context, where the Triton kernels and the fetch machinery run at real sizes. Prints one line per
case and exits non-zero on a mismatch.

    python scripts/gpu_tp_check.py [--tp 2] [--context 4096] [--kv-cache-gb 8] [--host-kv-gb 4]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_tensor_parallel import drive, engine  # noqa: E402  (the CPU test's scenario)

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig  # noqa: E402
from oasiskv.engine.engine import LLMEngine  # noqa: E402


def tiny_case(mode: str, tp: int) -> bool:
    model = {"num_key_value_heads": 1} if mode == "quest" else {}
    with tempfile.TemporaryDirectory() as d:
        print(f"tiny qwen3 {mode:6s}: one process, then tp{tp} ...", flush=True)
        want = drive(engine(Path(d), mode, 1, **model))
        t0 = time.perf_counter()
        e = engine(Path(d), mode, tp, **model)
        got = drive(e)
        stats = e.stats_dict()
        e.close()
    ok = got == want
    print(f"tiny qwen3 {mode:6s} tp{tp}: {'EQUAL' if ok else 'DIFFERENT'} tokens and counters {got[1]} "
          f"({time.perf_counter() - t0:.1f} s; score combines {stats.get('tp_score_combines', 0)})", flush=True)
    return ok


def real_case(mode: str, tp: int, context: int, kv_gb: float, host_gb: float) -> bool:
    kv = KVConfig(mode=mode, budget=512, **({"fetch_cap": 0.25, "host_kv_gb": host_gb} if mode == "oasis" else {}))
    outs = []
    for size in (1, tp):
        e = LLMEngine(EngineConfig(model="qwen3-0.6b", load_format="dummy", dtype="float32", show_progress=False,
                                   tensor_parallel_size=size, kv=kv, cache=CacheConfig(kv_cache_gb=kv_gb),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=context)))
        gen = torch.Generator().manual_seed(0)
        for i in range(4):
            e.add_request(torch.randint(0, 32000, (context - 64 * i,), generator=gen).tolist(),
                          SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), request_id=str(i))
        done = {}
        while e.has_unfinished():
            done.update({r.request_id: r.output_token_ids for r in e.step()})
        stats = e.stats_dict()
        outs.append((done, stats.get("kv_selected_blocks"), stats.get("kv_prefetched_blocks")))
        e.close()
    same = sum(a == b for a, b in zip(outs[0][0].values(), outs[1][0].values()))
    ok = outs[0] == outs[1]
    print(f"qwen3-0.6b {mode:6s} tp{tp} at {context} tokens: {'EQUAL' if ok else 'DIFFERENT'} "
          f"({same}/4 requests equal; selected/prefetched blocks {outs[0][1:]} vs {outs[1][1:]})", flush=True)
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--kv-cache-gb", type=float, default=8.0)
    p.add_argument("--host-kv-gb", type=float, default=4.0)
    args = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    results = [tiny_case(mode, args.tp) for mode in ("dense", "quest", "oasis")]
    results += [real_case(mode, args.tp, args.context, args.kv_cache_gb, args.host_kv_gb)
                for mode in ("dense", "quest", "oasis")]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
