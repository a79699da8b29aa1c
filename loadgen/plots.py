"""PNG plots: latency CDFs and throughput/queue over time for one run; CDFs side by side for `compare`."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from loadgen.client import RequestRecord
from loadgen.metrics import token_times


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def timeline(records: tuple[RequestRecord, ...], bin_s: float | None = None) -> dict[str, np.ndarray]:
    """Per-bin series over the run: t_s [B] (bin starts), completed_req_s, output_tok_s (rates per s),
    in_flight and waiting (sampled at bin centres; waiting = arrived but held by the client)."""
    end = max((r.done_at_s for r in records), default=0.0)
    bin_s = bin_s or max(0.05, end / 200)
    num_bins = int(end // bin_s) + 1
    t = np.arange(num_bins) * bin_s
    done = np.array([r.done_at_s for r in records if r.is_success])
    completed = np.bincount((done // bin_s).astype(np.int64), minlength=num_bins)[:num_bins] / bin_s
    tok = np.zeros(num_bins)
    for r in records:
        times = token_times(r)
        if len(times):
            bins = np.minimum((times // bin_s).astype(np.int64), num_bins - 1)
            np.add.at(tok, bins, r.num_output_tokens / len(times))
    mid = t + bin_s / 2
    send = np.array([r.send_at_s for r in records])
    fin = np.array([r.done_at_s for r in records])
    arr = np.array([r.arrival_s for r in records])
    in_flight = ((send[None, :] <= mid[:, None]) & (mid[:, None] < fin[None, :])).sum(1)
    waiting = ((arr[None, :] <= mid[:, None]) & (mid[:, None] < send[None, :])).sum(1)
    return {"t_s": t, "completed_req_s": completed, "output_tok_s": tok / bin_s, "in_flight": in_flight,
            "waiting": waiting}


def time_unit(values_ms) -> tuple[str, float]:
    """The unit an axis of these latencies reads best in, from the largest: ms below 2 s, s below 2 min,
    min above; returns (unit, milliseconds per unit)."""
    top = max((float(v) for v in values_ms), default=0.0)
    if top < 2e3:
        return "ms", 1.0
    return ("s", 1e3) if top < 120e3 else ("min", 60e3)


def _cdf(ax, values_ms, label: str, ms_per_unit: float = 1.0) -> None:
    v = np.sort(np.asarray(values_ms, dtype=np.float64)) / ms_per_unit
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def _latencies_ms(rows: list[dict]) -> dict[str, list[float]]:
    ok = [r for r in rows if r["is_success"]]
    return {"TTFT": [r["ttft_ms"] for r in ok], "TPOT": [r["tpot_ms"] for r in ok if r["num_output_tokens"] > 1],
            "E2E": [r["e2e_ms"] for r in ok]}


def cdf_figure(runs: dict[str, dict[str, list[float]]], itl_ms: dict[str, list[float]] | None = None):
    """One panel per metric, one line per run, each panel's axis in the unit its values read best in (time_unit)
    with at most six ticks. runs: name -> {"TTFT": [...ms], "TPOT": [...], "E2E": [...]}."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    names = ["TTFT", "TPOT", "E2E"] + (["ITL"] if itl_ms else [])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4))
    for ax, metric in zip(axes, names):
        series = {run: (itl_ms or {}).get(run, []) if metric == "ITL" else lat[metric] for run, lat in runs.items()}
        unit, ms_per_unit = time_unit(v for values in series.values() for v in values)
        for run, values in series.items():
            _cdf(ax, values, run, ms_per_unit)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, min_n_ticks=2))
        ax.ticklabel_format(axis="x", style="plain", useOffset=False)
        ax.set_xlabel(f"{metric} ({unit})")
        ax.set_ylabel("fraction of requests" if metric != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_cdfs(runs: dict[str, dict[str, list[float]]], path: Path,
              itl_ms: dict[str, list[float]] | None = None) -> Path:
    """cdf_figure's panels as a PNG at `path`."""
    fig = cdf_figure(runs, itl_ms)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_timeline(records: tuple[RequestRecord, ...], path: Path) -> Path:
    plt = _pyplot()
    tl = timeline(records)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    a1.plot(tl["t_s"], tl["output_tok_s"], label="output tokens/s", color="tab:blue")
    a1.set_ylabel("output tok/s")
    b1 = a1.twinx()
    b1.plot(tl["t_s"], tl["completed_req_s"], label="completed req/s", color="tab:orange", alpha=0.8)
    b1.set_ylabel("completed req/s")
    a1.set_title("throughput over time")
    a2.plot(tl["t_s"], tl["in_flight"], label="in flight (sent, not done)")
    a2.plot(tl["t_s"], tl["waiting"], label="waiting in client (arrived, not yet sent)")
    a2.set_xlabel("time since start (s)")
    a2.set_ylabel("requests")
    a2.legend(fontsize=8)
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_run(out_dir: Path, records: tuple[RequestRecord, ...]) -> list[Path]:
    """latency_cdf.png and timeline.png in out_dir."""
    rows = [{"is_success": r.is_success, "ttft_ms": r.ttft_s * 1e3, "tpot_ms": r.tpot_s * 1e3, "e2e_ms": r.e2e_s * 1e3,
             "num_output_tokens": r.num_output_tokens} for r in records]
    itl = {"run": [x * 1e3 for r in records for x in r.itl_s]}
    return [plot_cdfs({"run": _latencies_ms(rows)}, out_dir / "latency_cdf.png", itl),
            plot_timeline(records, out_dir / "timeline.png")]


def plot_compare(runs: dict[str, list[dict]], path: Path) -> Path:
    """runs: name -> requests.csv rows (loadgen.report.read_csv)."""
    return plot_cdfs({name: _latencies_ms(rows) for name, rows in runs.items()}, path)
