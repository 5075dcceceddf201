"""scripts/selection_twin.py --join: runs of the twin at several budgets, joined into one table of top-1 agreement
and KL per rule and budget, printed and plotted (matplotlib)."""
from __future__ import annotations

import json


def join_runs(paths: list[str]) -> dict[str, dict[int, dict]]:
    """Runs at several budgets -> {rule label: {budget: result}}; a later file replaces the same rule and budget."""
    table: dict[str, dict[int, dict]] = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        for r in run["results"]:
            table.setdefault(r["variant"], {})[run["args"]["budget"]] = r
    return table


def print_sweep(table: dict[str, dict[int, dict]]) -> None:
    budgets = sorted({b for row in table.values() for b in row})
    print("top-1 agreement with dense (KL) per budget\n| rule | " + " | ".join(map(str, budgets)) + " |")
    print("| --- |" + " --- |" * len(budgets))
    for label, row in table.items():
        cells = [f"{row[b]['top1_agree']:.2f} ({row[b]['kl']:.5f})" if b in row else "-" for b in budgets]
        print(f"| {label} | " + " | ".join(cells) + " |")


def plot_sweep(table: dict[str, dict[int, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colours = {}
    for label, row in table.items():  # colour: block size; line: score; marker: per layer or per KV head
        score, _, block, *per_head = label.split()
        colour = colours.setdefault(block, f"C{len(colours)}")
        budgets = sorted(row)
        ax.plot(budgets, [row[b]["top1_agree"] for b in budgets], "-" if score == "oracle" else "--", color=colour,
                marker="s" if per_head else "o", markersize=4, fillstyle="none" if per_head else "full", label=label)
    ax.axhline(99, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({b for row in table.values() for b in row}), minor=False)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("budget (tokens per layer)")
    ax.set_ylabel("teacher-forced top-1 agreement with dense (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
