"""`hetserve loadgen compare DIR...`: runs side by side, from each --out directory's summary.json and requests.csv."""
from __future__ import annotations

import json
from pathlib import Path

from loadgen.report import read_csv

COLUMNS = (("completed", "done", "d"), ("failed", "failed", "d"), ("request_throughput", "req/s", ".2f"),
           ("request_goodput", "good/s", ".2f"), ("output_throughput", "out tok/s", ".1f"),
           ("mean_ttft_ms", "TTFT mean", ".1f"), ("median_ttft_ms", "TTFT p50", ".1f"),
           ("p99_ttft_ms", "TTFT p99", ".1f"),
           ("mean_tpot_ms", "TPOT mean", ".1f"), ("p99_tpot_ms", "TPOT p99", ".1f"), ("p99_itl_ms", "ITL p99", ".1f"),
           ("median_e2el_ms", "E2E p50", ".1f"), ("p99_e2el_ms", "E2E p99", ".1f"))


class RunDirError(ValueError):
    """A directory is not a loadgen --out directory."""


def load_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """(summary.json, requests.csv rows) of one run."""
    summary, requests = run_dir / "summary.json", run_dir / "requests.csv"
    if not summary.is_file() or not requests.is_file():
        raise RunDirError(f"{run_dir}: no summary.json and requests.csv (not a `loadgen replay/synth --out` directory)")
    try:
        return json.loads(summary.read_text()), read_csv(requests)
    except (json.JSONDecodeError, ValueError, KeyError) as exc:
        raise RunDirError(f"{run_dir}: unreadable run files: {exc}") from exc


def run_names(dirs: list[Path]) -> list[str]:
    """Directory names, or whole paths where two names collide."""
    names = [d.resolve().name for d in dirs]
    return [str(d) if names.count(n) > 1 else n for d, n in zip(dirs, names)]


def format_table(names: list[str], summaries: list[dict]) -> str:
    width = max(len("run"), *(len(n) for n in names))
    head = ["run".ljust(width)] + [f"{title:>10}" for _, title, _ in COLUMNS]
    lines = ["  ".join(head)]
    for name, s in zip(names, summaries):
        cells = [name.ljust(width)]
        for key, _, fmt in COLUMNS:
            v = s.get(key)
            cells.append(f"{'-' if v is None else format(v, fmt):>10}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def compare(dirs: list[Path], plot_path: Path | None, json_path: Path | None = None) -> str:
    """The comparison table; writes a CDF plot (and a JSON of the table's numbers) when paths are given."""
    if not dirs:
        raise RunDirError("give at least one run directory")
    runs = [load_run(d) for d in dirs]
    names = run_names(dirs)
    table = format_table(names, [s for s, _ in runs])
    if plot_path is not None:
        from loadgen.plots import plot_compare

        plot_compare({n: rows for n, (_, rows) in zip(names, runs)}, plot_path)
    if json_path is not None:
        json_path.write_text(json.dumps({n: {k: s.get(k) for k, _, _ in COLUMNS} for n, (s, _) in zip(names, runs)},
                                        indent=1))
    return table
