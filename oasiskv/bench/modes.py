"""`oasiskv bench throughput --modes dense,quest,retrieval,oasis`: every mode in one invocation, one engine
per mode (freed before the next is built), each at the largest concurrency it holds, on the same seeded
random prompts. Also the two sweeps (concurrency per mode, fetch cap in oasis mode)."""
from __future__ import annotations

import dataclasses
import gc
import json
import sys
import traceback

import torch

from oasiskv.bench import plots
from oasiskv.bench.ceilings import memory_copy_gbps
from oasiskv.bench.report import (add_ratios, device_label, print_cap_table, print_modes_table, print_sweep_table, sig,
                                  write_json)
from oasiskv.bench.step_profile import format_profile, profile_step
from oasiskv.bench.workload import add_roofline, max_concurrency, run_workload, warm_up, workload_prompts
from oasiskv.config import KV_MODES, EngineConfig
from oasiskv.engine.engine import pick_device


def parse_list(text: str, kind, name: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {name} must be a comma-separated list of {kind.__name__}s, got {text!r}")
    if not values:
        raise SystemExit(f"error: {name} is empty")
    return values


def parse_modes(text: str) -> list[str]:
    modes = parse_list(text, str, "--modes")
    bad = [m for m in modes if m not in KV_MODES]
    if bad or len(set(modes)) != len(modes):
        raise SystemExit(f"error: --modes takes distinct modes among {', '.join(KV_MODES)}; got {text!r}")
    return modes


def mode_config(config: EngineConfig, mode: str, **kv_changes) -> EngineConfig:
    return config.replace(kv=config.kv.for_mode(mode, **kv_changes))


def with_engine(config: EngineConfig, measure):
    """Builds one engine, returns measure(engine) (plain data), and frees the engine's GPU and host memory
    before returning, so that the next mode finds the memory this one used."""
    from oasiskv.engine.engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except (ValueError, MemoryError) as e:
        raise SystemExit(f"error: {config.kv.mode}: {e}")
    try:
        result = measure(engine)
        result_info = {"kv": engine.kv_description, "weights_gb": sig(engine.weights_bytes() / 1e9)}
    except Exception:
        # shown before the cleanup: after a device fault, freeing the CUDA cache can kill the process
        # before the exception is ever printed
        print(f"error: {config.kv.mode}: the run failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            print(f"{config.kv.mode} engine freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB of GPU memory "
                  "still allocated")
    return result, result_info


def measure_mode(engine, args, hbm_gbps: float, concurrency: int | None = None, num_prompts: int | None = None) -> dict:
    """The workload at `concurrency` (default: the most the mode holds); optionally the step profile."""
    held = max_concurrency(engine, args.input_len, args.output_len)
    concurrency = min(concurrency or held, held)
    warm_up(engine, args.input_len, args.warmup_steps, args.prompt_seed, batch=concurrency)
    try:
        prompts = workload_prompts(engine, num_prompts or args.num_prompts or concurrency, args.input_len,
                                   args.prompt_seed, getattr(args, "prompt_corpus", None))
    except ValueError as e:
        raise SystemExit(f"error: --prompt-corpus {args.prompt_corpus}: {e}")
    ranks = engine.config.tensor_parallel_size  # (the bytes are all GPUs', the ceiling one GPU's)
    row = add_roofline(run_workload(engine, prompts, args.output_len, concurrency), hbm_gbps * ranks)
    row["max_concurrency"] = held
    if engine.policy.name == "oasis":
        row["miss_policy"] = engine.config.kv.miss_policy
    row["async_scheduling"] = engine.async_scheduling
    if getattr(args, "profile_step", False):
        row["step_profile"] = profile_step(engine, concurrency, args.input_len, args.profile_steps, args.prompt_seed)
        print(format_profile(row["mode"], row["step_profile"]))
    return row


def hbm_ceiling(args, config: EngineConfig) -> float:
    if args.hbm_gbps:
        return args.hbm_gbps
    gbps = memory_copy_gbps(pick_device(config.device))
    print(f"memory copy ceiling (measured, read + write counted): {gbps:.0f} GB/s")
    return gbps


def check_runs(args, config: EngineConfig) -> None:
    """Each engine's KV settings, checked before the first one runs: a mode or cap that a later engine refuses
    would otherwise stop the run after minutes of measuring the others."""
    if args.sweep_fetch_cap:
        kvs = [config.kv.for_mode("oasis", fetch_cap=cap) for cap in parse_list(args.sweep_fetch_cap, float,
                                                                                "--sweep-fetch-cap")]
    else:
        kvs = [config.kv.for_mode(mode) for mode in parse_modes(args.modes or config.kv.mode)]
    for kv in kvs:
        try:
            kv.validate(config.cache.block_size, num_layers=sys.maxsize)
        except ValueError as e:
            raise SystemExit(f"error: {kv.mode}: {e}") from None
    if args.sweep_concurrency and args.num_prompts is not None:  # (taken, ignored, and written to the JSON)
        raise SystemExit("error: --num-prompts does not apply to --sweep-concurrency: each point runs as many "
                         "prompts as its concurrency")
    if args.sweep_concurrency and min(parse_list(args.sweep_concurrency, int, "--sweep-concurrency")) < 1:
        raise SystemExit(f"error: --sweep-concurrency takes counts of at least 1, got {args.sweep_concurrency!r}")


def run_modes(args, config: EngineConfig) -> dict:
    modes = parse_modes(args.modes)
    earlier = earlier_rows(args, config, "modes", "mode", modes)  # a wrong path fails before the measuring
    hbm = hbm_ceiling(args, config)
    rows = []
    for mode in modes:
        row, info = with_engine(mode_config(config, mode), lambda e: measure_mode(e, args, hbm))
        rows.append({**row, **info})
        save_progress(args, config, {"kind": "modes", "hbm_gbps": round(hbm, 1), "rows": rows})
    rows = add_ratios(earlier + rows)
    print_modes_table(rows)
    result = {"kind": "modes", "hbm_gbps": round(hbm, 1), "rows": rows}
    finish(args, config, result, plots.plot_modes)
    return result


def earlier_rows(args, config: EngineConfig, kind: str, key: str, present: list) -> list[dict]:
    """Rows of an earlier run of the same kind (--compare-to) whose `key` (mode, fetch cap) this run does
    not measure: a benchmark split over several invocations joins into one table, JSON and plot. A run of another
    model or workload is refused (its ratios to this run's rows would compare different work)."""
    path = args.compare_to
    if not path:
        return []
    try:
        with open(path) as f:
            earlier = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: cannot read --compare-to {path}: {e}")
    if earlier.get("kind") != kind:
        raise SystemExit(f"error: --compare-to {path} holds a {earlier.get('kind')!r} run, not {kind!r}")
    work, conf = earlier.get("workload", {}), earlier.get("config", {})
    theirs = {"input_len": work.get("input_len"), "output_len": work.get("output_len"),
              "num_prompts": work.get("num_prompts"), "prompt_seed": work.get("prompt_seed"),
              "prompt_corpus": work.get("prompt_corpus"), "model": conf.get("model"),
              "load_format": conf.get("load_format"), "dtype": conf.get("dtype"), "device": earlier.get("device")}
    ours = {"input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
            "prompt_seed": args.prompt_seed, "prompt_corpus": getattr(args, "prompt_corpus", None),
            "model": config.model, "load_format": config.load_format, "dtype": config.dtype,
            "device": device_label(pick_device(config.device))}
    differ = {k: (theirs[k], ours[k]) for k in ours if theirs[k] != ours[k]}
    if differ:
        said = ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in differ.items())
        raise SystemExit(f"error: --compare-to {path} measured another run ({said}): its ratios to this run's rows "
                         "would compare different work or hardware")
    return [{**r, "from": path} for r in earlier["rows"] if r[key] not in present]


def run_concurrency_sweep(args, config: EngineConfig) -> dict:
    """Throughput against concurrency, one engine per mode; points above what a mode holds are skipped
    and the most it holds is measured too (where it saturates)."""
    levels = parse_list(args.sweep_concurrency, int, "--sweep-concurrency")
    hbm = hbm_ceiling(args, config)
    modes = parse_modes(args.modes or config.kv.mode)
    rows = earlier_rows(args, config, "concurrency_sweep", "mode", modes)
    for mode in modes:
        points, info = with_engine(mode_config(config, mode), lambda e: sweep_points(e, args, hbm, levels))
        rows += [{**p, **info} for p in points]
        save_progress(args, config, {"kind": "concurrency_sweep", "hbm_gbps": round(hbm, 1), "levels": levels,
                                     "rows": rows})
    print_sweep_table(rows)
    result = {"kind": "concurrency_sweep", "hbm_gbps": round(hbm, 1), "levels": levels, "rows": rows}
    finish(args, config, result, plots.plot_concurrency)
    return result


def sweep_points(engine, args, hbm: float, levels: list[int]) -> list[dict]:
    held = max_concurrency(engine, args.input_len, args.output_len)
    todo = sorted({c for c in levels if c <= held} | ({held} if max(levels) > held else set()))
    points = [measure_mode(engine, args, hbm, concurrency=c, num_prompts=c) for c in todo]
    skipped = [{"mode": engine.policy.name, "concurrency": c, "max_concurrency": held,
                "skipped": f"holds at most {held} requests of {args.input_len + args.output_len} tokens"}
               for c in levels if c > held]
    return points + skipped


def run_fetch_cap_sweep(args, config: EngineConfig) -> dict:
    """Oasis at each fetch cap: PCIe traffic per step, throughput and agreement (the paper's ablation)."""
    caps = parse_list(args.sweep_fetch_cap, float, "--sweep-fetch-cap")
    hbm = hbm_ceiling(args, config)
    rows = earlier_rows(args, config, "fetch_cap_sweep", "fetch_cap", caps)
    for cap in caps:
        row, info = with_engine(mode_config(config, "oasis", fetch_cap=cap), lambda e: measure_mode(e, args, hbm))
        rows.append({"fetch_cap": cap, **row, **info})
        save_progress(args, config, {"kind": "fetch_cap_sweep", "hbm_gbps": round(hbm, 1), "rows": rows})
    print_cap_table(rows)
    result = {"kind": "fetch_cap_sweep", "hbm_gbps": round(hbm, 1), "rows": rows}
    finish(args, config, result, plots.plot_fetch_cap)
    return result


def save_progress(args, config: EngineConfig, partial: dict) -> None:
    """The rows measured so far, written to --json after each engine: a run cut short (a device call's time
    limit) keeps them. The finished run overwrites the file."""
    finish(args, config, {**partial, "partial": True}, plot=None)


def finish(args, config: EngineConfig, result: dict, plot) -> None:
    result.update(workload={"input_len": args.input_len, "output_len": args.output_len,
                            "num_prompts": args.num_prompts, "prompt_seed": args.prompt_seed,
                            "prompt_corpus": getattr(args, "prompt_corpus", None)},
                  config=dataclasses.asdict(config))
    write_json(args.json or args.out, result, pick_device(config.device))  # (--out's default without --json)
    if args.plot and plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
