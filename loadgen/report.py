"""Report of one run: a console table (vLLM's layout), summary.json, requests.csv and plots in --out DIR."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from loadgen.client import RequestRecord
from loadgen.metrics import METRICS, PERCENTILES

CSV_COLUMNS = ("index", "arrival_s", "send_at_s", "done_at_s", "is_success", "error_kind", "num_prompt_tokens",
               "server_prompt_tokens", "server_cached_tokens", "num_expected_output_tokens", "num_output_tokens",
               "ttft_ms", "tpot_ms", "e2e_ms", "num_chunks", "mean_itl_ms", "max_itl_ms", "error")
_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
LAG_WARN_MS = 50.0  # p99 send lag above which the run did not follow its schedule
_UPPER = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def format_summary(s: dict) -> str:
    """The human-readable table printed after a run."""
    lines = [f"{' Serving Benchmark Result ':=^60}"]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    for kind, n in sorted(s["errors_by_kind"].items()):
        row(f"  {kind}:", n)
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"])
    if s.get("prompt_cached_share") is not None:
        row("  from the server's prefix cache:", f"{100 * s['prompt_cached_share']:.1f} %")
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if s.get("request_goodput") is not None:
        row("Request goodput (req/s):", s["request_goodput"])
        row("  SLOs met by (requests):", s["good_requests"])
        lines.append("  SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo_ms"].items()))
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Peak output token throughput (tok/s):", s["max_output_tokens_per_s"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    row("Peak concurrent requests:", s["max_concurrent_requests"])
    if s.get("spec_decode_draft_tokens"):
        row("Speculative draft tokens (accepted):", f"{s['spec_decode_draft_tokens']} "
                                                    f"({100 * s['spec_decode_acceptance_rate']:.1f} %)")
        if s.get("spec_decode_mean_acceptance_length") is not None:
            row("  mean acceptance length (tokens/step):", s["spec_decode_mean_acceptance_length"])
    row("Send lag vs schedule, mean / p99 (ms):", f"{s['mean_send_lag_ms']:.1f} / {s['p99_send_lag_ms']:.1f}")
    for m in METRICS:
        lines.append(f"{' ' + _TITLES[m] + ' ':-^60}")
        row(f"Mean {_UPPER[m]} (ms):", s[f"mean_{m}_ms"])
        row(f"Median {_UPPER[m]} (ms):", s[f"median_{m}_ms"])
        for p in PERCENTILES:
            row(f"P{p} {_UPPER[m]} (ms):", s[f"p{p}_{m}_ms"])
    lines.append("=" * 60)
    if s["p99_send_lag_ms"] > LAG_WARN_MS and s["max_concurrency"] is None:
        lines.append(f"warning: the client sent 1% of requests over {s['p99_send_lag_ms']:.0f} ms late: it could not keep "
                     "the schedule (CPU-bound?), so the offered load was lower than the trace's")
    if s["num_output_len_mismatch"]:
        lines.append(f"note: {s['num_output_len_mismatch']} requests returned a different number of output tokens "
                     "than max_tokens (server ignores ignore_eos?)")
    if s["num_prompt_len_mismatch"]:
        lines.append(f"note: {s['num_prompt_len_mismatch']} requests: the server counted other prompt lengths "
                     "(a different tokenizer than --tokenizer?)")
    return "\n".join(lines)


def _csv_row(r: RequestRecord) -> list:
    itl = r.itl_s
    return [r.index, f"{r.arrival_s:.6f}", f"{r.send_at_s:.6f}", f"{r.done_at_s:.6f}", int(r.is_success), r.error_kind,
            r.num_prompt_tokens, r.server_prompt_tokens, r.server_cached_tokens, r.num_expected_output_tokens,
            r.num_output_tokens, f"{r.ttft_s * 1e3:.3f}", f"{r.tpot_s * 1e3:.3f}", f"{r.e2e_s * 1e3:.3f}",
            len(itl) + r.is_success, f"{sum(itl) / len(itl) * 1e3:.3f}" if itl else "",
            f"{max(itl) * 1e3:.3f}" if itl else "", r.error]


def write_csv(path: Path, records: tuple[RequestRecord, ...]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        w.writerows(_csv_row(r) for r in records)


def read_csv(path: Path) -> list[dict]:
    """requests.csv rows with numeric fields as floats (empty -> None)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        conv = {}
        for k, v in row.items():
            if k in ("error_kind", "error"):
                conv[k] = v
            else:
                conv[k] = float(v) if v != "" else None
        out.append(conv)
    return out


def write_report(out_dir: Path, summary: dict, records: tuple[RequestRecord, ...], config: dict,
                 is_plotting: bool = True) -> list[Path]:
    """summary.json (+ the run's configuration under "config"), requests.csv and PNG plots; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "summary.json", out_dir / "requests.csv"]
    paths[0].write_text(json.dumps({**summary, "config": config}, indent=1))
    write_csv(paths[1], records)
    if is_plotting:
        from loadgen.plots import plot_run

        paths += plot_run(out_dir, records)
    return paths
