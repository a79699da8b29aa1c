"""The table and the plot of e2e_peers rows."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.common import print_table

COLUMNS = ("workload", "concurrency", "config", "repeat", "duration", "output_throughput", "decode_tok_s",
           "mean_decoding", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "peak_rss_mb", "failed")


def table(rows: list[dict]) -> None:
    print_table(rows, list(COLUMNS))


def _invocation(row: dict) -> str:
    """The e2e_peers invocation a row came from: its run directory's parent is named by the start time."""
    return Path(row.get("run_dir", "")).parent.name


def plot(rows: list[dict], path: Path) -> Path:
    """Per (workload, concurrency) cell: output and decode throughput and median TPOT of each config (bars:
    mean over the repeats of the newest invocation, dots: every run, older runs and machines included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["workload"], r["concurrency"]) for r in rows})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    metrics = (("output_throughput", "output tok/s (incl. prefill)"), ("decode_tok_s", "decode tok/s"),
               ("median_tpot_ms", "median TPOT ms (lower is better)"))
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(8, 1.6 * len(cells) * len(configs) / 3), 11))
    width = 0.8 / max(1, len(configs))
    for ax, (key, title) in zip(axes, metrics):
        for j, cfg in enumerate(configs):
            xs, means = [], []
            for i, cell in enumerate(cells):
                mine = [r for r in rows if (r["workload"], r["concurrency"]) == cell and r["config"] == cfg
                        and r.get(key) is not None]
                if mine:
                    x = i + (j - (len(configs) - 1) / 2) * width
                    xs.append(x)
                    newest = max(_invocation(r) for r in mine)
                    means.append(float(np.mean([r[key] for r in mine if _invocation(r) == newest])))
                    ax.plot([x] * len(mine), [r[key] for r in mine], "k.", ms=3)
            ax.bar(xs, means, width, label=cfg)
        ax.set_xticks(range(len(cells)), [f"{w}\nc={c}" for w, c in cells])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_decode(rows: list[dict], path: Path) -> Path:
    """Decode tok/s against concurrency, one line per config (each repeat a dot, the line through the means)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cfg in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == cfg]
        cs = sorted({r["concurrency"] for r in mine})
        means = [float(np.mean([r["decode_tok_s"] for r in mine if r["concurrency"] == c])) for c in cs]
        (line,) = ax.plot(cs, means, "-o", label=cfg)
        ax.plot([r["concurrency"] for r in mine], [r["decode_tok_s"] for r in mine], ".", color=line.get_color())
    ctx = rows[0]["context_tokens"] if rows else 0
    ax.set(xscale="log", yscale="log", xlabel="concurrent sequences", ylabel="decode tok/s",
           title=f"decode at {ctx}-token contexts (shared prompt), 2 cores")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
