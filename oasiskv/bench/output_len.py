"""Throughput against output length: joins `bench throughput --modes` runs made at different --output-len.

Every prompt costs the same prefill in every mode, so the longer the output, the more of a run is decode and
the closer each mode's output ratio to dense comes to its decode ratio. One invocation of the bench measures
one output length; this joins several (one device call each) into one table, JSON and plot:

    python -m oasiskv.bench.output_len out512.json out2048.json out4096.json --json joined.json --plot ratio.png

Runs must share the model and input length. Where two files hold the same mode at the same output length,
the later file's row is kept (a rerun replaces an earlier one) and the table names its file.
"""
from __future__ import annotations

import argparse
import json

from oasiskv.bench.report import add_ratios, print_table

COLUMNS = ("output_len", "mode", "max_concurrency_held", "output_tok_s", "decode_tok_s", "decode_step_ms",
           "output_vs_dense", "decode_vs_dense", "from")


def load_run(path: str) -> dict:
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: cannot read {path}: {e}")
    if run.get("kind") != "modes":
        raise SystemExit(f"error: {path} holds a {run.get('kind')!r} run, not a `bench throughput --modes` run")
    if run.get("partial"):
        print(f"warning: {path} is a partial run (cut short); its finished modes are used")
    return run


def join_runs(paths: list[str]) -> dict:
    """One row per (output length, mode), later files replacing earlier ones; ratios to the dense row of the
    same output length."""
    runs = [load_run(p) for p in paths]
    inputs = {r["workload"]["input_len"] for r in runs}
    models = {r["config"]["model"] for r in runs}
    if len(inputs) > 1 or len(models) > 1:
        raise SystemExit(f"error: the runs differ in input length {sorted(inputs)} or model {sorted(models)}")
    rows: dict[tuple[int, str], dict] = {}
    for path, run in zip(paths, runs):
        for row in run["rows"]:
            if "from" not in row:  # rows joined from a --compare-to file keep that file's name
                row = {**row, "from": path}
            rows[(run["workload"]["output_len"], row["mode"])] = row
    joined = []
    for length in sorted({key[0] for key in rows}):
        group = [dict(rows[key], output_len=length) for key in rows if key[0] == length]
        joined += add_ratios(group)
    return {"kind": "output_len_sweep", "input_len": inputs.pop(), "model": models.pop(), "rows": joined}


def with_ratio_text(row: dict) -> dict:
    """The ratios to two decimals: the shared table format keeps one above 1."""
    text = {k: f"{row[k]:.2f}" for k in ("output_vs_dense", "decode_vs_dense") if row.get(k) is not None}
    return {**row, **text}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m oasiskv.bench.output_len", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="JSON files of `oasiskv bench throughput --modes ... --json`")
    p.add_argument("--json", default=None, help="write the joined rows here")
    p.add_argument("--plot", default=None, help="write a PNG here: output tok/s and the ratio to dense")
    args = p.parse_args(argv)
    result = join_runs(args.runs)
    print(f"{result['model']}, {result['input_len']} tokens in")
    print_table([with_ratio_text(r) for r in result["rows"]], COLUMNS)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        from oasiskv.bench import plots

        plots.plot_output_len(result, args.plot)
        print(f"wrote {args.plot}")
    return result


if __name__ == "__main__":
    main()
