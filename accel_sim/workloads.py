"""Request streams for the simulator: fixed batches (the paper's sweeps) and trace replay.

The trace reader is deliberately small and timing-only (arrival time, prompt and output token
counts); `loadgen/` owns full trace handling against a live endpoint.
"""
from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

from accel_sim.sim import Request

AZURE_CONV_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / \
    "AzureLLMInferenceTrace_conv.csv"


def fixed_batch(batch: int, prompt_tokens: int, output_tokens: int) -> list[Request]:
    """`batch` identical requests all arriving at t = 0."""
    return [Request(i, 0.0, prompt_tokens, output_tokens) for i in range(batch)]


def _seconds(stamp: str) -> float:
    # '2023-11-16 18:15:46.6805900': seven fractional digits, more than %f takes
    head, _, frac = stamp.partition(".")
    t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return t + (float("0." + frac) if frac else 0.0)


def read_trace(path: str | Path, limit: int | None = None, time_scale: float = 1.0) -> list[Request]:
    """Azure LLM inference trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or a BurstGPT CSV
    (Timestamp in seconds, 'Request tokens', 'Response tokens'). Arrivals start at 0 and are
    divided by `time_scale` (2 = twice the request rate). Rows with no output are skipped."""
    reqs: list[Request] = []
    with open(path, newline="") as fh:
        rows = csv.DictReader(fh)
        cols = set(rows.fieldnames or ())
        if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= cols:
            get = lambda r: (_seconds(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))  # noqa: E731
        elif {"Timestamp", "Request tokens", "Response tokens"} <= cols:
            get = lambda r: (float(r["Timestamp"]), int(r["Request tokens"]), int(r["Response tokens"]))  # noqa: E731
        else:
            raise ValueError(f"{path}: unknown trace columns {sorted(cols)}")
        t0 = None
        for row in rows:
            t, prompt, out = get(row)
            if out < 1 or prompt < 1:
                continue
            t0 = t if t0 is None else t0
            reqs.append(Request(len(reqs), (t - t0) / time_scale, prompt, out))
            if limit and len(reqs) >= limit:
                break
    return reqs
