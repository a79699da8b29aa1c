"""The workloads, sent to a running server with `hetserve loadgen` (a subprocess, exactly as a user runs
it), and the metrics read back from its summary.json and requests.csv."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.report import read_csv

ROOT = Path(__file__).resolve().parents[2]
AZURE_CONV = ROOT.parent / "shared" / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    """long: every prompt of `context_tokens - output_tokens` tokens, all sent at once, `concurrency` in flight;
    trace: the Azure conversation trace's first `num_trace_requests` rows, gaps rescaled to a mean of `rate_rps`."""
    context_tokens: int
    """Each server is sized for `concurrency` sequences of this many tokens (prompt + output)."""
    num_trace_requests: int = 0
    rate_rps: float = 0.0

    def prompt_tokens(self, output_tokens: int) -> int:
        return self.context_tokens - output_tokens


WORKLOADS = {w.name: w for w in (
    Workload("chat-256", "long", 384),  # a 256-token prompt and 128 output tokens
    Workload("long-4k", "long", 4096),
    Workload("long-8k", "long", 8192),
    # the trace's own pace (~2 requests/s, 720-token prompts on average) is more than 2 cores can prefill: its
    # first 40 rows keep their relative gaps (bursts) at a mean of 0.5 requests/s
    Workload("azure-conv", "trace", 8192, num_trace_requests=40, rate_rps=0.5),
)}


def loadgen_command(w: Workload, url: str, concurrency: int, output_tokens: int, out_dir: Path) -> list[str]:
    exe = str(Path(sys.executable).parent / "hetserve")
    common = ["--endpoint", url, "--out", str(out_dir), "--no-plots", "--no-progress", "--seed", "0",
              "--max-concurrency", str(concurrency)]
    if w.kind == "long":
        p = w.prompt_tokens(output_tokens)
        return [exe, "loadgen", "synth", "--num-requests", str(max(concurrency, 2)), "--rate", "inf",
                "--prompt-dist", "fixed", "--prompt-tokens", str(p), str(p),
                "--output-dist", "fixed", "--output-tokens", str(output_tokens), str(output_tokens), *common]
    return [exe, "loadgen", "replay", str(AZURE_CONV), "--trace-format", "azure",
            "--max-requests", str(w.num_trace_requests), "--rate", str(w.rate_rps),
            "--max-prompt-tokens", str(w.context_tokens - output_tokens), "--max-output-tokens", str(output_tokens),
            *common]


def run_loadgen(cmd: list[str], out_dir: Path) -> dict:
    """Runs loadgen; returns the metrics of the run (raises if it could not run at all)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "loadgen.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if not (out_dir / "summary.json").is_file():
        raise RuntimeError(f"loadgen exited with {rc} and no summary; see {out_dir / 'loadgen.log'}")
    return metrics(json.loads((out_dir / "summary.json").read_text()), read_csv(out_dir / "requests.csv"))


def metrics(summary: dict, rows: list[dict]) -> dict:
    """vLLM bench-serve numbers plus the decode phase's throughput.

    decode_tok_s: output tokens after each request's first, over the time in which at least one request
    was decoding (the union of every request's first-to-last-token interval; prefills of later requests
    run inside it on every server, so it is a lower bound on pure decode speed). mean_decoding: the mean
    number of requests decoding over that time."""
    ok = [r for r in rows if r["is_success"]]
    first = np.array([r["send_at_s"] + r["ttft_ms"] / 1e3 for r in ok])
    last = np.array([r["send_at_s"] + r["e2e_ms"] / 1e3 for r in ok])
    num_decoded = sum(r["num_output_tokens"] - 1 for r in ok)
    span_s = _union_s(first, last)
    keys = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "num_output_len_mismatch", "num_prompt_len_mismatch")
    out = {k: summary.get(k) for k in keys}
    out["decode_tok_s"] = num_decoded / span_s if span_s > 0 else None
    out["mean_decoding"] = float((last - first).sum() / span_s) if span_s > 0 else None
    return out


def _union_s(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of the union of the intervals [starts[i], ends[i]]."""
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted(zip(starts.tolist(), ends.tolist())):
        if cur_end is None or a > cur_end:
            total += 0.0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    return total + (0.0 if cur_end is None else cur_end - cur_start)
