"""GPU check of CUDA-graph replay: every mode must give the same greedy tokens and the same KV counters
with graphs as without (--enforce-eager), and oasis with a perfect draft and no cap must give quest's
tokens. Random-weight model in fp32, so that the comparison is about the machinery. Then the decode
step time with and without graphs, per mode, at a larger batch. Prints a table; exits non-zero on a
mismatch.

    PYTHONPATH=. python scripts/gpu_graph_check.py [--model qwen3-0.6b] [--context 2048] [--steps 64]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.lookahead.teacher import TeacherDraft
from oasiskv.policies.oasis import OasisPolicy


COUNTERS = ("kv_selected_blocks", "kv_hits", "kv_misses", "kv_prefetched_blocks", "kv_fetched_blocks",
            "kv_agree_hits", "kv_agree_total")


def engine_for(args, mode: str, eager: bool, dtype: str, context: int, steps: int, overlap: bool | None = None,
               **kv) -> LLMEngine:
    """overlap: --async-scheduling (default: args.async_scheduling, if the script has it); args.block_score, if
    the script has it and it is set, is the selecting modes' --block-score; args.miss_policy likewise oasis's;
    args.prefill_keep_tokens likewise every mode's."""
    overlap = getattr(args, "async_scheduling", False) if overlap is None else overlap
    if getattr(args, "block_score", None) and mode != "dense":
        kv.setdefault("block_score", args.block_score)
    if getattr(args, "miss_policy", None) and mode == "oasis":
        kv.setdefault("miss_policy", args.miss_policy)
    if getattr(args, "prefill_keep_tokens", None) is not None:
        kv.setdefault("prefill_keep_tokens", args.prefill_keep_tokens)
    chunk = getattr(args, "chunk", None) or 16384  # --max-num-batched-tokens, where the script has --chunk
    cfg = EngineConfig(model=args.model, load_format="dummy", dtype=dtype, show_progress=False, enforce_eager=eager,
                       kv=KVConfig(mode=mode, budget=args.budget, host_kv_gb=args.host_gb, **kv),
                       cache=CacheConfig(gpu_memory_gb=args.gpu_gb),
                       scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_model_len=context + steps + 64,
                                                 async_scheduling=overlap))
    return LLMEngine(cfg)


def generate(engine: LLMEngine, prompts, steps: int, teacher=None):
    if teacher is not None:
        engine.drafter = teacher
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return {str(i): engine.requests[str(i)].output_token_ids for i in range(len(prompts))}, engine.stats_dict()


def prompts_for(batch: int, context: int, stride: int = 37):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32000, (context + stride * i,), generator=gen).tolist() for i in range(batch)]


def same_share(a: dict, b: dict) -> str:
    """Share of equal tokens, and the first divergence (request, index)."""
    pairs = [(rid, i, x == y) for rid in a for i, (x, y) in enumerate(zip(a[rid], b[rid]))]
    first = next(((rid, i) for rid, i, same in pairs if not same), None)
    return f"{sum(same for *_, same in pairs) / max(len(pairs), 1):.3f} (first divergence {first})"


def check(args) -> bool:
    prompts = prompts_for(args.batch, args.context)
    ok, quest_tokens = True, None
    modes = list(filter(None, args.check_modes.split(",")))
    if "oasis" in modes and "quest" not in modes[:modes.index("oasis")]:
        modes.insert(modes.index("oasis"), "quest")  # oasis's teacher draft is quest's tokens
    for mode in modes:
        runs = {}
        for eager in (True, False):
            teacher = None
            kv = {}
            if mode == "oasis":
                teacher = TeacherDraft({str(i): len(p) for i, p in enumerate(prompts)}, quest_tokens)
                kv = {"fetch_cap": 1.0}
            engine = engine_for(args, mode, eager, "float32", args.context, args.steps, **kv)
            runs[eager] = generate(engine, prompts, args.steps, teacher)
            del engine
            torch.cuda.empty_cache()
        (eager_tokens, eager_stats), (graph_tokens, graph_stats) = runs[True], runs[False]
        same_counts = all(eager_stats.get(k) == graph_stats.get(k) for k in COUNTERS)
        line = (f"{mode:10s} graph == eager tokens: {graph_tokens == eager_tokens}  counters equal: {same_counts}  "
                f"replays {graph_stats.get('cuda_graph_replays')} captures {graph_stats.get('cuda_graph_captures')}")
        ok &= graph_tokens == eager_tokens and same_counts
        if mode == "quest":
            quest_tokens = graph_tokens
        if mode == "retrieval":
            line += f"  == quest: {graph_tokens == quest_tokens}"
            ok &= graph_tokens == quest_tokens
        if mode == "oasis":  # the draft rows change the GEMMs' M, so cuBLAS may round differently than quest
            line += (f"  tokens equal to quest: {same_share(graph_tokens, quest_tokens)}  "
                     f"misses {graph_stats.get('kv_misses')} agreement {graph_stats.get('kv_agreement')}")
        if not same_counts:
            line += "\n    eager " + str({k: eager_stats.get(k) for k in COUNTERS})
            line += "\n    graph " + str({k: graph_stats.get(k) for k in COUNTERS})
        print(line, flush=True)
    for draft in filter(None, args.check_drafts.split(",")):
        ok &= check_draft(args, prompts, draft)
    for mode in filter(None, args.check_async.split(",")):
        ok &= check_async(args, prompts, mode)
    return ok


def check_async(args, prompts, mode: str) -> bool:
    """--async-scheduling against the synchronous engine, both replaying graphs (oasis: --draft ngram, drafted on
    the device, at the default cap): the same tokens and counters."""
    (sync_tokens, sync_stats), (async_tokens, async_stats) = generate_twice(
        args, prompts, lambda overlap: engine_for(args, mode, False, "float32", args.context, args.steps, overlap))
    keys = COUNTERS + ("draft_tokens", "draft_tokens_right", "decode_tokens")
    same = sync_tokens == async_tokens and all(sync_stats.get(k) == async_stats.get(k) for k in keys)
    line = (f"{mode:10s} async == sync tokens and counters: {same}  replays {async_stats.get('cuda_graph_replays')} "
            f"(sync {sync_stats.get('cuda_graph_replays')})")
    print(line + ("" if same else counter_lines(keys, sync=sync_stats, async_=async_stats)), flush=True)
    return same


def generate_twice(args, prompts, make_engine) -> list:
    """generate() with make_engine(False), then with make_engine(True), each engine freed after its run."""
    runs = []
    for flag in (False, True):
        engine = make_engine(flag)
        runs.append(generate(engine, prompts, args.steps))
        del engine
        torch.cuda.empty_cache()
    return runs


def counter_lines(keys, **stats) -> str:
    return "".join(f"\n    {name:6s}" + str({k: s.get(k) for k in keys}) for name, s in stats.items())


def check_draft(args, prompts, draft: str) -> bool:
    """Oasis with a real draft source at the default cap: graph and eager steps give the same tokens, counters
    and drafts (for --draft target, the argmax of the draft rows that the captured step computes)."""
    (eager_tokens, eager_stats), (graph_tokens, graph_stats) = generate_twice(
        args, prompts, lambda graph: engine_for(args, "oasis", not graph, "float32", args.context, args.steps,
                                                draft=draft))
    keys = COUNTERS + ("draft_tokens", "draft_tokens_right")
    same = graph_tokens == eager_tokens and all(eager_stats.get(k) == graph_stats.get(k) for k in keys)
    line = (f"oasis, --draft {draft}: graph == eager tokens, counters and drafts: {same}  replays "
            f"{graph_stats.get('cuda_graph_replays')}  draft accuracy {graph_stats.get('draft_accuracy')}  "
            f"agreement {graph_stats.get('kv_agreement')}")
    print(line + ("" if same else counter_lines(keys, eager=eager_stats, graph=graph_stats)), flush=True)
    return same


def time_steps(args) -> list[dict]:
    rows = []
    host_modes = ("oasis", "retrieval")
    variants = [(mode, eager, group, programs, ws, stride) for stride in [int(s) for s in args.time_strides.split(",")]
                for mode in args.time_modes.split(",")
                for eager in ((False, True) if args.time_eager else (False,))
                for group in ([int(g) for g in args.predict_groups.split(",")] if mode == "oasis" else [None])
                for programs in ([int(p) for p in args.prefetch_programs.split(",")] if mode == "oasis" else [None])
                for ws in ([int(w) or None for w in args.working_sets.split(",")] if mode in host_modes else [None])]
    for mode, eager, group, programs, ws, stride in variants:
        prompts = prompts_for(args.time_batch, args.time_context, stride=stride)
        kv = {"fetch_cap": args.fetch_cap} if mode == "oasis" else {}
        kv.update({"working_set": ws} if ws else {})
        if group:
            OasisPolicy.PREDICT_GROUP = group
        if programs is not None:
            OasisPolicy.PREFETCH_PROGRAMS = programs
        total = args.time_steps + args.warmup_steps + args.time_batch + 8  # none finishes while timed
        engine = engine_for(args, mode, eager, "bfloat16", args.time_context, total, **kv)
        params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        while any(len(r.output_token_ids) < 2 for r in engine.requests.values()):
            engine.step()
        for _ in range(args.warmup_steps):  # every graph key seen twice: captured
            engine.step()
        torch.cuda.synchronize()
        replays = engine.stats_dict().get("cuda_graph_replays", 0)
        captures = engine.stats_dict().get("cuda_graph_captures", 0)
        t, n = time.perf_counter(), 0
        while engine.has_unfinished() and n < args.time_steps:
            engine.step()
            n += 1
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / n * 1000
        st = engine.stats_dict()
        row = {"mode": mode, "cuda_graphs": not eager, "predict_group": group, "prefetch_programs": programs,
               "working_set": ws, "prompt_stride": stride,
               "batch": args.time_batch,
               "context": args.time_context,
               "ms_per_step": round(ms, 2), "tok_per_s": round(args.time_batch / ms * 1000, 1),
               **{k: st.get(k) for k in ("kv_prefetch_bytes_per_step", "kv_agreement", "kv_hit_rate",
                                         "cuda_graph_captures")},
               "replays_timed": (st.get("cuda_graph_replays") or 0) - (replays or 0),
               "captures_timed": (st.get("cuda_graph_captures") or 0) - (captures or 0), "steps_timed": n}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del engine
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--gpu-gb", type=float, default=40)
    p.add_argument("--host-gb", type=float, default=8)
    p.add_argument("--time-model", default=None, help="model for the timing part (default: --model)")
    p.add_argument("--time-context", type=int, default=0, help="0: skip the timing part")
    p.add_argument("--time-batch", type=int, default=16)
    p.add_argument("--time-steps", type=int, default=32)
    # a step shape that recurs every block_size steps (no draft opening a block, with staggered positions) is seen
    # eagerly once, then captured the next time: warm up for two periods, or a ~100 ms capture lands in the timing
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--time-eager", action="store_true", help="time each mode with --enforce-eager too")
    p.add_argument("--time-modes", default="quest,oasis,dense,retrieval")
    p.add_argument("--fetch-cap", type=float, default=0.05)
    p.add_argument("--block-score", default=None, help="the selecting modes' --block-score (default: the config's)")
    p.add_argument("--miss-policy", default=None, help="oasis's --miss-policy (default: the config's)")
    p.add_argument("--predict-groups", default="6", help="oasis: layers predicted together, one timing run each")
    p.add_argument("--prefetch-programs", default="16", help="oasis: GPU programs of the prefetch copy (0: one "
                   "per block), one timing run each")
    p.add_argument("--working-sets", default="0", help="retrieval/oasis: --working-set values in tokens (0: the "
                   "budget), one timing run each")
    p.add_argument("--time-strides", default="0", help="prompt i has time-context + i * stride tokens. One prompt is "
                   "prefilled per step while the others decode, so 0 staggers the decode positions (some draft "
                   "opens a block in every step) and 1 aligns them (all drafts open together, once in 16 steps)")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--check-modes", default="dense,quest,retrieval,oasis")
    p.add_argument("--check-async", default="", help="modes to check with --async-scheduling against without "
                   "(graphs replayed in both), e.g. quest,oasis")
    p.add_argument("--check-drafts", default="", help="oasis with these --draft sources too, graph against eager "
                   "(e.g. target,ngram)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ok = True if args.skip_check else check(args)
    print(f"check passed: {ok}", flush=True)
    if args.time_context:
        args.model = args.time_model or args.model
        args.budget = 2048
        rows = time_steps(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
