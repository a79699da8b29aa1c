"""The load generator's own limits: how many requests/s it sustains and what it adds to each token's timing.

    python -m benchmarks.bench_loadgen [--requests 5000] [--rates 500 1000] [--output-tokens 16]

The endpoint is loadgen/fake_server.py in a separate process (asyncio, no model, a chunk per token), so
what is measured is the client: aiohttp streaming, SSE parsing, per-chunk stamps, bookkeeping.
- max: --requests requests at once (rate inf) with at most --concurrency in flight; completed req/s.
- open-loop: each of --rates requests/s (Poisson) for --requests requests; the schedule's own rate, the
  achieved req/s and how late requests were sent against their schedule (send lag): the client keeps up
  when achieved matches scheduled and the lag stays small.
- per-token overhead: the server stamps each chunk as it writes it (time.perf_counter, one monotonic
  clock for both processes); the client's stamp minus the server's is what the client adds to a token's
  timing (loopback + event loop + parsing). Measured alone (1 request, --itl-ms between chunks) and under
  the open-loop load. Client CPU per token is process CPU time over the run / chunks received.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

from benchmarks.common import machine, print_table, wait_healthy, write_json
from loadgen.arrivals import gamma_arrivals
from loadgen.client import Endpoint, RequestSpec
from loadgen.metrics import summarize, token_times
from loadgen.runner import RunResult, run_requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _specs(arrivals: np.ndarray, num_output_tokens: int) -> list[RequestSpec]:
    return [RequestSpec(i, float(t), "a short prompt of a few words", 6, num_output_tokens)
            for i, t in enumerate(arrivals)]


def _start_fake(port: int, itl_ms: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "loadgen.fake_server", "--port", str(port), "--itl-ms", str(itl_ms)],
                            stdout=subprocess.DEVNULL)
    try:
        wait_healthy_models(f"http://127.0.0.1:{port}", proc)
    except BaseException:
        proc.kill()
        raise
    return proc


def wait_healthy_models(url: str, proc: subprocess.Popen) -> None:
    """The fake endpoint has no /health; wait for /v1/models."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        try:
            if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.05)
    wait_healthy(url, proc, timeout_s=0.1)  # raises with the reason


def _run(url: str, specs: list[RequestSpec], concurrency: int | None) -> tuple[RunResult, float, dict]:
    """Run, returning (result, client CPU s, server send stamps by request id)."""
    cpu0 = time.process_time()
    res = asyncio.run(run_requests(specs, Endpoint(url, model="fake"), concurrency, show_progress=False))
    cpu = time.process_time() - cpu0
    stamps = httpx.get(url + "/stamps", timeout=30).json()
    return res, cpu, stamps


def _delivery_delay_us(res: RunResult, stamps: dict) -> np.ndarray:
    """Client stamp - server send stamp, per output chunk [num_chunks] in microseconds."""
    out = []
    for r in res.records:
        sent = np.asarray(stamps.get(f"loadgen-{r.index}", []))
        got = res.started_at_perf_s + token_times(r)
        if len(sent) == len(got) and len(got):
            out.append(got - sent)
    return np.concatenate(out) * 1e6 if out else np.zeros(0)


def _row(name: str, res: RunResult, cpu_s: float, stamps: dict) -> dict:
    s = summarize(res)
    chunks = sum(len(token_times(r)) for r in res.records)
    delay = _delivery_delay_us(res, stamps)
    last = max(r.arrival_s for r in res.records)
    return {"scenario": name, "requests": len(res.records), "failed": s["failed"], "duration_s": s["duration"],
            "scheduled_req_s": (len(res.records) - 1) / last if last > 0 else None,
            "req_s": s["request_throughput"], "out_tok_s": s["output_throughput"],
            "send_lag_mean_ms": s["mean_send_lag_ms"], "send_lag_p99_ms": s["p99_send_lag_ms"],
            "token_delay_p50_us": float(np.median(delay)) if len(delay) else None,
            "token_delay_p99_us": float(np.percentile(delay, 99)) if len(delay) else None,
            "cpu_us_per_token": cpu_s / max(chunks, 1) * 1e6, "cpu_us_per_request": cpu_s / len(res.records) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000, help="requests per throughput scenario (default: 5000)")
    ap.add_argument("--rates", type=float, nargs="+", default=[500.0, 1000.0],
                    help="open-loop target rates, req/s (default: 500 1000)")
    ap.add_argument("--concurrency", type=int, default=64, help="in-flight cap of the max scenario (default: 64)")
    ap.add_argument("--output-tokens", type=int, default=16, help="chunks per response (default: 16)")
    ap.add_argument("--itl-ms", type=float, default=1.0, help="gap between chunks in the alone scenario (default: 1)")
    ap.add_argument("--out", default="loadgen.json", help="file name under benchmarks/results/")
    args = ap.parse_args()

    rows = []
    port = free_port()
    proc = _start_fake(port, 0.0)
    url = f"http://127.0.0.1:{port}"
    try:
        _run(url, _specs(np.zeros(200), args.output_tokens), args.concurrency)  # warm-up (connections, imports)
        res, cpu, st = _run(url, _specs(np.zeros(args.requests), args.output_tokens), args.concurrency)
        rows.append(_row(f"max (cap {args.concurrency})", res, cpu, st))
        for rate in args.rates:
            arrivals = gamma_arrivals(args.requests, rate, 1.0, seed=0)
            res, cpu, st = _run(url, _specs(arrivals, args.output_tokens), None)
            rows.append(_row(f"open-loop {rate:g} req/s", res, cpu, st))
    finally:
        proc.kill()
    port = free_port()
    proc = _start_fake(port, args.itl_ms)
    url = f"http://127.0.0.1:{port}"
    try:
        _run(url, _specs(np.zeros(1), 200), 1)
        res, cpu, st = _run(url, _specs(np.arange(20) * 0.3, 200), 1)
        rows.append(_row(f"alone, 200 chunks {args.itl_ms:g} ms apart", res, cpu, st))
    finally:
        proc.kill()

    cols = ["scenario", "requests", "failed", "scheduled_req_s", "req_s", "out_tok_s", "send_lag_mean_ms",
            "send_lag_p99_ms", "token_delay_p50_us", "token_delay_p99_us", "cpu_us_per_token", "cpu_us_per_request"]
    print_table(rows, cols)
    path = write_json(args.out, {"machine": machine(), "args": vars(args), "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
