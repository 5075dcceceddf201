"""The results: a table of each mode's value and drop against dense, a JSON file, a plot of drop
against budget. A drop is oriented so that positive means worse than dense."""
from __future__ import annotations

import json
from collections import defaultdict

from oasiskv.evals.tasks import HIGHER_IS_BETTER

PLOTTED = (("ppl", "top1_agree"), ("ppl", "kl"), ("copy", "copy_acc"), ("synthetic", "mean_score"),
           ("long_output", "same_tokens"), ("lookahead", "agreement"))
UNANCHORED = {("lookahead", "agreement")}  # dense predicts nothing: plotted as values, not drops


def drop(r: dict) -> float | None:
    if r["dense"] is None or r["mode"] == "dense" or r["metric"] == "seconds":
        return None
    diff = r["value"] - r["dense"]
    return (-diff if HIGHER_IS_BETTER.get(r["metric"], True) else diff) + 0.0  # + 0.0: no "-0.00"


def plotted(r: dict) -> float | None:
    """What a row's point is in the plot: its drop against dense, or its value where dense has none."""
    if (r["task"], r["metric"]) in UNANCHORED:
        return None if r["mode"] == "dense" else r["value"]
    return drop(r)


def with_drops(rows: list[dict]) -> list[dict]:
    return [{**r, "drop": drop(r)} for r in rows]


def context_label(context: int) -> str:
    """4096 -> 4K, 1536 -> 1.5K, 512 -> 512 (context // 1024 named 512 "0K", and 1024 and 1536 both "1K")."""
    return f"{context / 1024:g}K" if context >= 1024 else str(context)


def fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric == "kl":
        return f"{round(value, 4) + 0.0:.4f}"
    if metric == "seconds":
        return f"{value:.0f}s"
    # rounded first: 99.999 is 100.0 as 100 is, and -0.001 is 0.00 (it printed "-0.00")
    return f"{round(value, 2) + 0.0:.2f}" if abs(round(value, 2)) < 100 else f"{round(value, 1) + 0.0:.1f}"


def table(rows: list[dict], skipped: list[str] = ()) -> str:
    """Per context: per task metric, dense's absolute value, then one line per mode series (quest,
    oasis@0.05, ...) with one column per budget: value, and the drop against dense in parentheses."""
    out = []
    for context in sorted({r["context"] for r in rows}):
        mine = [r for r in rows if r["context"] == context]
        budgets = sorted({r["budget"] for r in mine if r["budget"] is not None})
        head = ["metric", "dense", "mode"] + [f"budget {b}" for b in budgets]
        out.append(f"context {context} tokens: value (drop vs dense; positive = worse)")
        out += aligned([head] + metric_lines(mine, budgets))
        out.append("")
    if skipped:
        out.append("not run (fetch cap x budget below one block): " + ", ".join(skipped))
    return "\n".join(out)


def metric_lines(rows: list[dict], budgets: list[int]) -> list[list[str]]:
    dense, cells = {}, defaultdict(dict)
    for r in rows:
        name = f"{r['task']}.{r['metric']}"
        if r["mode"] == "dense":
            dense[name] = fmt(r["metric"], r["value"])
            continue
        d = drop(r)
        cells[name, r["series"]][r["budget"]] = fmt(r["metric"], r["value"]) + (
            f" ({fmt(r['metric'], d)})" if d is not None else "")
    names = list(dict.fromkeys(f"{r['task']}.{r['metric']}" for r in rows))
    series = list(dict.fromkeys(r["series"] for r in rows if r["mode"] != "dense"))
    lines = []
    for name in names:
        mine = [x for x in series if (name, x) in cells] or [""]
        for i, x in enumerate(mine):
            first = [name, dense.get(name, "-")] if i == 0 else ["", ""]
            lines.append(first + [x] + [cells.get((name, x), {}).get(b, "") for b in budgets])
    return lines


def aligned(lines: list[list[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]


def write_json(path: str, rows: list[dict], config: dict) -> None:
    with open(path, "w") as f:
        json.dump({"config": config, "results": with_drops(rows)}, f, indent=1)


def plot(path: str, rows: list[dict]) -> None:
    """Drop against budget, one panel per plotted metric, one line per mode series and context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PLOTTED if any((r["task"], r["metric"]) == p and plotted(r) is not None for r in rows)]
    if not panels:
        raise ValueError("nothing to plot: no mode besides dense was run")
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (task, metric) in zip(axes.flat, panels):
        lines = defaultdict(list)
        for r in rows:
            if (r["task"], r["metric"]) == (task, metric) and plotted(r) is not None:
                lines[(r["series"], r["context"])].append((r["budget"], plotted(r)))
        for (name, context), points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{name} {context_label(context)}")
        anchored = (task, metric) not in UNANCHORED
        if anchored:
            ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{task}: {metric} drop vs dense" if anchored else f"{task}: {metric}")
        ax.set_xlabel("KV budget (tokens)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """`python -m oasiskv.evals.report RESULTS.json [--plot FILE.png]`: the table (and plot) of a
    saved run, e.g. one stopped early (its JSON holds every configuration that finished)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("json")
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    with open(args.json) as f:
        saved = json.load(f)
    print(table(saved["results"], saved["config"].get("skipped", [])))
    if args.plot:
        plot(args.plot, saved["results"])
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
