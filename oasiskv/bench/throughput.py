"""Decode throughput at a fixed context length and batch size, with the memory roofline beside it.

Per decode step the engine must read every weight once and every cached K/V byte of every running
request once; bytes / (HBM bandwidth) is the floor on step time. We report achieved bytes/s against
the measured copy ceiling of the H200 (4.2 TB/s, shared/DESIGN.md) and write JSON.

With --modes (or a sweep) the side-by-side benchmark of bench/modes.py runs instead: every mode in one
invocation at the concurrency it holds, as `vllm bench throughput` measures it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from oasiskv.bench.workload import decode_weight_bytes, exposed_wait, graph_replays, kv_bytes_read, kv_deltas
from oasiskv.config import BenchConfig, EngineConfig, SamplingParams

HBM_GBPS = 4200.0


def add_bench_args(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    g = p.add_argument_group("benchmark")
    g.add_argument("--input-len", type=int, default=d.input_len)
    g.add_argument("--output-len", type=int, default=d.output_len)
    g.add_argument("--batch-sizes", default=d.batch_sizes,
                   help="single mode (--kv-mode): comma-separated; 'max' is the most requests of this length the "
                        "KV memory holds at once")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help="decode steps run before timing (kernel compiles)")
    g.add_argument("--hbm-gbps", type=float, default=d.hbm_gbps,
                   help="memory bandwidth of the roofline (default: a device-to-device copy measured now; "
                        f"single-mode runs: {HBM_GBPS:.0f})")
    g.add_argument("--out", default="results/bench_throughput.json",
                   help="the JSON (default: %(default)s, under the current directory; --json overrides it)")
    m = p.add_argument_group("every mode side by side (vllm bench throughput's numbers)")
    m.add_argument("--modes", default=None, help="comma-separated KV modes, e.g. dense,quest,retrieval,oasis: each "
                                                  "runs at the largest concurrency it holds")
    m.add_argument("--num-prompts", type=int, default=d.num_prompts, help="default: one per request held at once")
    m.add_argument("--prompt-seed", type=int, default=d.prompt_seed)
    m.add_argument("--prompt-corpus", default=d.prompt_corpus,
                   help="prompts are windows of this text corpus (austen, mobydick, bible, stdlib, sample; see "
                        "`oasiskv eval`), tokenized by the model, instead of random tokens: a trained model's "
                        "attention on real text (hit rate, agreement). Fetched corpora are cached under "
                        "$OASISKV_EVAL_CACHE")
    m.add_argument("--sweep-concurrency", default=None, help="e.g. 1,8,16,32,64: throughput against concurrency "
                                                              "for each of --modes (or --kv-mode)")
    m.add_argument("--sweep-fetch-cap", default=None, help="e.g. 0.01,0.02,0.05,0.1,1: oasis at each fetch cap")
    m.add_argument("--compare-to", default=None, help="JSON of an earlier run of the same kind: its other modes "
                                                      "(fetch caps) join the table, the ratios to dense and the plot")
    m.add_argument("--profile-step", action="store_true",
                   help="per-phase breakdown of a decode step at each mode's concurrency (synchronising timers)")
    m.add_argument("--profile-steps", type=int, default=d.profile_steps)
    m.add_argument("--json", default=None, help="write the results here")
    m.add_argument("--plot", default=None, help="write a PNG here")


def run_from_args(args: argparse.Namespace, config: EngineConfig):
    """--modes or a sweep: the side-by-side benchmark (bench/modes.py); otherwise one mode at fixed batches."""
    from oasiskv.bench import modes

    if args.input_len < 1 or args.output_len < 1:
        raise SystemExit(f"error: --input-len and --output-len must be at least 1, got {args.input_len} and "
                         f"{args.output_len}")
    if not (args.modes or args.sweep_concurrency or args.sweep_fetch_cap):
        batch_sizes(args.batch_sizes)  # a bad value fails before the weights load
    if args.sweep_concurrency and args.sweep_fetch_cap:
        raise SystemExit("error: run --sweep-concurrency and --sweep-fetch-cap in separate invocations")
    check_flags(args, config)
    if args.sweep_concurrency:
        return modes.run_concurrency_sweep(args, config)
    if args.sweep_fetch_cap:
        return modes.run_fetch_cap_sweep(args, config)
    if args.modes:
        return modes.run_modes(args, config)
    return run_single_mode(args, config)


def check_flags(args: argparse.Namespace, config: EngineConfig) -> None:
    """What the run would otherwise find wrong only after the weights load or after minutes of measuring."""
    from oasiskv.bench import modes
    from oasiskv.cli import check_draft_model, check_output_path
    from oasiskv.engine.engine import pick_device, pick_dtype
    from oasiskv.evals.texts import CORPORA
    from oasiskv.models.loader import model_config_of

    for flag, value in (("--num-prompts", args.num_prompts), ("--profile-steps", args.profile_steps)):
        if value is not None and value < 1:
            raise SystemExit(f"error: {flag} must be at least 1, got {value}")
    check_draft_model(config)
    try:
        pick_dtype(config.dtype, pick_device(config.device))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.hbm_gbps is not None and not args.hbm_gbps > 0:
        raise SystemExit(f"error: --hbm-gbps must be above 0, got {args.hbm_gbps}")
    if args.warmup_steps < 0:
        raise SystemExit(f"error: --warmup-steps must be at least 0, got {args.warmup_steps}")
    if args.prompt_corpus is not None and args.prompt_corpus not in CORPORA:
        raise SystemExit(f"error: --prompt-corpus must be one of {', '.join(CORPORA)}, got {args.prompt_corpus!r}")
    try:
        context = config.scheduler.max_model_len or model_config_of(config.model).max_position_embeddings
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if args.input_len + args.output_len > context:
        raise SystemExit(f"error: --input-len + --output-len ({args.input_len + args.output_len}) is longer than the "
                         f"model's {context} tokens")
    if args.modes or args.sweep_concurrency or args.sweep_fetch_cap:
        modes.check_runs(args, config)
    else:
        single = [flag for flag, given in (("--plot", args.plot), ("--compare-to", args.compare_to),
                                           ("--profile-step", args.profile_step),
                                           ("--prompt-corpus", args.prompt_corpus)) if given]
        if single:  # (they were taken and ignored)
            raise SystemExit(f"error: {single[0]} applies to --modes or a sweep; a single mode (--kv-mode) runs "
                             f"random prompts at --batch-sizes and prints its table")
    if not args.json:  # (the CLI checked --json already)
        check_output_path(args.out, "--out")


def batch_sizes(text: str) -> list[int | str]:
    """--batch-sizes "1,8,max" -> [1, 8, "max"]."""
    try:
        sizes = [b if b == "max" else int(b) for b in text.split(",")]
    except ValueError:
        raise SystemExit(f"error: --batch-sizes takes comma-separated counts or 'max', got {text!r}") from None
    if any(b != "max" and b < 1 for b in sizes):
        raise SystemExit(f"error: --batch-sizes must be at least 1, got {text!r}")
    return sizes


def run_single_mode(args: argparse.Namespace, config: EngineConfig) -> list[dict]:
    from oasiskv.engine.engine import LLMEngine
    from oasiskv.models.loader import model_config_of

    sched = config.scheduler
    context = sched.max_model_len or model_config_of(config.model).max_position_embeddings  # (check_flags: fits)
    # room for the decode tail each request grows while the others prefill, within the model's context
    config = config.replace(scheduler=dataclasses.replace(
        sched, max_num_seqs=max(sched.max_num_seqs, 1024),
        max_model_len=sched.max_model_len or min(args.input_len + args.output_len + 4096, context)))
    try:
        engine = LLMEngine(config)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    fit = 1
    for _ in range(3):  # the decode tail each request grows while the others prefill depends on the batch
        fit = engine.max_concurrency(request_tokens(engine, fit, args.input_len, args.output_len, args.warmup_steps))
    batches = [fit if b == "max" else b for b in batch_sizes(args.batch_sizes)]
    rows = [bench_one(engine, b, args.input_len, args.output_len, args.hbm_gbps or HBM_GBPS, args.warmup_steps)
            for b in batches]
    print_table(rows, engine)
    out = args.json or args.out  # --json names the file as it does for --modes
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": engine.model_source, "device": device_name(engine.device), "dtype": str(engine.dtype),
                   "kv_pool_blocks": engine.pool.num_blocks, "rows": rows}, f, indent=2)
    print(f"wrote {out}")
    return rows


def bench_one(engine, batch: int, input_len: int, output_len: int, hbm_gbps: float, warmup: int) -> dict:
    """Prefills `batch` requests, then times `output_len` decode steps with all of them running.
    Requests get enough max_tokens that none finishes while the others are still prefilling."""
    gen = torch.Generator().manual_seed(batch)
    vocab = min(engine.model_config.vocab_size, 32000)
    max_tokens = request_tokens(engine, batch, input_len, output_len, warmup) - input_len
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(torch.randint(0, vocab, (input_len,), generator=gen).tolist(), params)
           for _ in range(batch)]
    reqs = [engine.requests[i] for i in ids]
    t0 = time.perf_counter()
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    prefill_s = time.perf_counter() - t0
    if engine.scheduler.waiting or any(r.finished for r in reqs):
        raise RuntimeError(f"batch {batch} does not fit the KV memory at once; lower the batch or raise memory")
    for _ in range(warmup):
        engine.step()
    ranks = engine.config.tensor_parallel_size  # every rank reads its weights; rank 0 counts its KV copies
    weights = decode_weight_bytes(engine) * ranks
    bytes_read, decode_s = 0, 0.0
    # steps replayed from a CUDA graph, apart: a graph key first seen inside the timed window (oasis: a
    # draft opening a block) adds an eager step and a capture, which cost far more than a replay
    replays, replay_s = 0, 0.0
    before = engine.kv_stats()
    # the window holds the device time of exactly its steps: the warm-up's step still in flight (async scheduling)
    # ends before it, and its last step's end is waited for inside it (each step() waits for the one before)
    wait_for_device(engine)
    for i in range(output_len):
        kv_bytes = sum(kv_bytes_read(engine, r.num_tokens) for r in reqs)
        replays0 = graph_replays(engine)
        t = time.perf_counter()
        engine.step()
        if i == output_len - 1:
            wait_for_device(engine)
        dt = time.perf_counter() - t
        decode_s += dt
        bytes_read += weights + kv_bytes
        if graph_replays(engine) > replays0:
            replays, replay_s = replays + 1, replay_s + dt
    steps = output_len
    if any(r.finished for r in reqs):
        raise RuntimeError("a request finished inside the timed window")
    kv = kv_deltas(before, engine.kv_stats())
    pcie = kv.get("kv_bytes_gathered", 0)
    for i in ids:
        engine.abort(i)
        engine.pop_finished(i)
    tokens = steps * batch
    return {
        "mode": engine.policy.name, "tp": ranks, "batch": batch, "context": input_len, "decode_steps": steps,
        "prefill_s": round(prefill_s, 3),
        "decode_s": round(decode_s, 4), "decode_tok_s": round(tokens / decode_s, 1),
        "step_ms": round(1000 * decode_s / steps, 3), "replay_steps": replays,
        "replay_step_ms": round(1000 * replay_s / replays, 3) if replays else None,
        "bytes_per_step_gb": round(bytes_read / steps / 1e9, 3),
        "achieved_gbps": round(bytes_read / decode_s / 1e9, 1),
        "pcie_gb_per_step": round(pcie / steps / 1e9, 4), "pcie_gbps": round(pcie / decode_s / 1e9, 2),
        "roofline_pct": round(100 * bytes_read / decode_s / 1e9 / (hbm_gbps * ranks), 1),
        **lookahead_columns(kv, steps, decode_s, eager_steps=steps - replays),
    }


def wait_for_device(engine) -> None:
    """Until the device has run every step launched (async scheduling leaves the last one in flight)."""
    if engine.in_flight is not None:
        engine.in_flight.read()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def lookahead_columns(kv: dict, steps: int, decode_s: float, eager_steps: int) -> dict:
    """Oasis: what the timed window prefetched, how well the prediction agreed, what stayed exposed (timed
    in eager steps only: see workload.exposed_wait)."""
    if "kv_prefetch_bytes" not in kv:
        return {}
    ratio = lambda a, b: round(a / b, 4) if b else None  # noqa: E731
    return {
        "prefetch_gb_per_step": round(kv["kv_prefetch_bytes"] / steps / 1e9, 4),
        "prefetch_gbps": round(kv["kv_prefetch_bytes"] / decode_s / 1e9, 2),
        "agreement": ratio(kv["kv_agree_hits"], kv["kv_agree_total"]),
        "hit_rate": ratio(kv["kv_hits"], kv["kv_selected_blocks"]),
        "misses_per_step": round(kv["kv_misses"] / steps, 1),
        "prefetch_ms_per_step": round(1000 * kv.get("kv_time_prefetch_s", 0) / steps, 3),
        **exposed_wait(kv, eager_steps),
    }


def request_tokens(engine, batch: int, input_len: int, output_len: int, warmup: int) -> int:
    """Prompt plus the most tokens a request may generate in bench_one."""
    prefill_steps = batch + -(-batch * input_len // engine.scheduler.cfg.max_num_batched_tokens)
    return input_len + prefill_steps + warmup + output_len + 1


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def print_table(rows: list[dict], engine) -> None:
    print(f"\n{engine.kv_description}; stats {engine.stats_dict()}")
    print(f"model {engine.model_source}  device {device_name(engine.device)}  dtype {engine.dtype}  "
          f"KV pool {engine.pool.num_blocks} blocks ({engine.pool.nbytes / 2**30:.1f} GiB)")
    cols = ["mode", "batch", "context", "decode_steps", "prefill_s", "step_ms", "decode_tok_s", "bytes_per_step_gb",
            "achieved_gbps", "roofline_pct", "pcie_gb_per_step"]
    extra = [c for c in ("replay_steps", "replay_step_ms") if any(r.get("replay_steps") for r in rows)]
    extra += [c for c in ("prefetch_gb_per_step", "agreement", "hit_rate", "prefetch_exposed_ms_per_eager_step")
              if any(c in r for r in rows)]
    cols += extra
    print(" ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print(" ".join(f"{r.get(c, ''):>16}" for c in cols))
