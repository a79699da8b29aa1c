"""Request streams for the simulator: fixed batches (the paper's sweeps) and trace replay.

Traces are read by `loadgen.traces`; the simulator keeps only arrival time and token counts.
"""
from __future__ import annotations

from pathlib import Path

from accel_sim.sim import Request
from hetcore import data as hetcore_data
from loadgen import traces

AZURE_CONV_TRACE = hetcore_data.AZURE_CONV_TRACE
"""Default trace of `hetserve sim replay`: the Azure conversation trace, bundled with the package."""


def fixed_batch(batch: int, prompt_tokens: int, output_tokens: int) -> list[Request]:
    """`batch` identical requests all arriving at t = 0."""
    return [Request(i, 0.0, prompt_tokens, output_tokens) for i in range(batch)]


def read_trace(path: str | Path, limit: int | None = None, time_scale: float = 1.0) -> list[Request]:
    """Azure LLM inference trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or a BurstGPT CSV
    (Timestamp in seconds, 'Request tokens', 'Response tokens'), read by loadgen.traces (the format
    is told by the header). Arrivals start at 0 and are divided by `time_scale` (2 = twice the
    request rate). Rows without prompt or output tokens are skipped."""
    trace = traces.read_trace(path, traces.detect_format(path))
    rows = trace.requests[:limit] if limit else trace.requests
    return [Request(i, r.arrival_s / time_scale, r.num_prompt_tokens, r.num_output_tokens) for i, r in enumerate(rows)]


def fresh(reqs: list[Request]) -> list[Request]:
    """Unsimulated copies of `reqs` (simulate() writes its results into the requests it is given)."""
    return [Request(r.req_id, r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs]
