"""PNG plots of the throughput benchmarks (matplotlib, no display needed)."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_modes(result: dict, path: str) -> None:
    """Output and decode tok/s per mode, with the concurrency each held and dense's roofline."""
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["output_tok_s"] for r in rows], 0.4, label="output tok/s (whole run)")
    ax.bar([i + 0.2 for i in x], [r.get("decode_tok_s") or 0 for r in rows], 0.4, label="decode tok/s (pure decode)")
    ax.set_xticks(list(x), [f"{r['mode']}\nconcurrency {r['max_concurrency_held']}" for r in rows])
    dense = next((r for r in rows if r["mode"] == "dense" and r.get("roofline_tok_s")), None)
    top = max([r["output_tok_s"] for r in rows] + [r.get("decode_tok_s") or 0 for r in rows])
    if dense and dense["roofline_tok_s"] <= 5 * top:  # far above the bars it would flatten them: title only
        ax.axhline(dense["roofline_tok_s"], color="gray", linestyle="--",
                   label=f"dense memory roofline ({dense['roofline_tok_s']:.0f} tok/s)")
    w = rows[0]
    ax.set_ylabel("tokens/s")
    roof = f"; dense roofline {dense['roofline_tok_s']:.0f} tok/s" if dense else ""
    ax.set_title(f"throughput per KV mode, {w['input_len']} in / {w['output_len']} out{roof}")
    ax.legend()
    save(fig, path)


def plot_concurrency(result: dict, path: str) -> None:
    """Throughput against concurrency, one line per mode (whole run and pure decode side by side)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    rows = [r for r in result["rows"] if "skipped" not in r]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in pts]
        axes[0].plot(xs, [r["output_tok_s"] for r in pts], marker="o", label=mode)
        axes[1].plot(xs, [r.get("decode_tok_s") or 0 for r in pts], marker="o", label=mode)
    for ax, what in zip(axes, ("output tok/s (whole run, prefill included)", "decode tok/s (pure decode steps)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, path)


def plot_fetch_cap(result: dict, path: str) -> None:
    """Oasis per fetch cap: PCIe GB per step, decode tok/s and agreement."""
    rows = sorted(result["rows"], key=lambda r: r["fetch_cap"])
    caps = [r["fetch_cap"] for r in rows]
    series = (("PCIe GB per decode step", "pcie_gb_per_step"), ("decode tok/s", "decode_tok_s"),
              ("agreement", "agreement"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (label, key) in zip(axes, series):
        ax.plot(caps, [r.get(key) or 0 for r in rows], marker="o")
        ax.set_xscale("log")
        ax.set_xlabel("fetch cap (share of the budget per layer per step)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    save(fig, path)


def plot_output_len(result: dict, path: str) -> None:
    """Output tok/s per mode against output length, and each mode's output and decode ratio to dense."""
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["output_len"])
        xs = [r["output_len"] for r in pts]
        line, = axes[0].plot(xs, [r["output_tok_s"] for r in pts], marker="o", label=mode)
        if mode == "dense":
            continue
        ratio = [(x, r["output_vs_dense"]) for x, r in zip(xs, pts) if r.get("output_vs_dense") is not None]
        decode = [(x, r["decode_vs_dense"]) for x, r in zip(xs, pts) if r.get("decode_vs_dense") is not None]
        if ratio:
            axes[1].plot(*zip(*ratio), marker="o", color=line.get_color(), label=f"{mode}: output")
        if decode:
            axes[1].plot(*zip(*decode), marker="x", linestyle="--", color=line.get_color(), label=f"{mode}: decode")
    axes[0].set_ylabel("output tok/s (whole run, prefill included)")
    axes[1].set_ylabel("throughput / dense's")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"output tokens per request ({result['input_len']} in)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['model']}: every mode at the concurrency it holds")
    save(fig, path)
