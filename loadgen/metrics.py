"""Serving metrics with vLLM `bench serve` definitions, over successful requests only:

- TTFT: send -> first output chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with > 1 output token.
- ITL: every gap between consecutive output chunks, all requests pooled.
- E2E (e2el): send -> last output chunk.
- request/output/total-token throughput: completed requests, output tokens, input + output tokens per second
  of benchmark duration (first send to last response end).
- goodput: requests per second meeting every given SLO (ttft, tpot, e2el in ms; a one-token output's TPOT is 0).
Percentiles are numpy's (linear interpolation); an empty metric reads 0, as in vLLM.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from loadgen.client import RequestRecord
from loadgen.runner import RunResult

PERCENTILES = (90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50' (also e2el_ms; the _ms suffix is optional) -> {'ttft': 500.0, 'tpot': 50.0}."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        name = key.strip().removesuffix("_ms")
        if not sep or name not in SLO_KEYS:
            raise ValueError(f"bad SLO {part.strip()!r}: expected NAME_ms=VALUE with NAME in {', '.join(SLO_KEYS)}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {part.strip()!r}: {value!r} is not a number") from None
        if slo[name] <= 0:
            raise ValueError(f"bad SLO {part.strip()!r}: must be > 0 ms")
    return slo


def _stats_ms(name: str, values_s: list[float]) -> dict[str, float]:
    v = np.asarray(values_s or [0.0], dtype=np.float64) * 1e3
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(v, p)) for p in PERCENTILES})
    return out


def token_times(rec: RequestRecord) -> np.ndarray:
    """Arrival times [num_chunks] of a request's output chunks, s from the run's start."""
    if not rec.is_success:
        return np.zeros(0)
    return rec.send_at_s + rec.ttft_s + np.concatenate([[0.0], np.cumsum(rec.itl_s)])


def peak_concurrency(records: tuple[RequestRecord, ...]) -> int:
    """Most requests in flight (sent, response not ended) at any instant."""
    events = sorted([(r.send_at_s, 1) for r in records] + [(r.done_at_s, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def peak_output_tok_s(records: tuple[RequestRecord, ...], bin_s: float = 1.0) -> float:
    """Most output tokens in any bin_s-wide bin (per s); a request's tokens are spread evenly over its chunks."""
    times, weights = [], []
    for r in records:
        t = token_times(r)
        if len(t):
            times.append(t)
            weights.append(np.full(len(t), r.num_output_tokens / len(t)))
    if not times:
        return 0.0
    t, w = np.concatenate(times), np.concatenate(weights)
    counts = np.bincount((t // bin_s).astype(np.int64), weights=w)
    return float(counts.max() / bin_s)


@dataclass(frozen=True)
class Goodput:
    """Requests meeting every SLO."""

    num_good: int
    slo_ms: dict


def goodput(ok: list[RequestRecord], slo_ms: dict[str, float]) -> Goodput:
    value = {"ttft": lambda r: r.ttft_s, "tpot": lambda r: r.tpot_s, "e2el": lambda r: r.e2e_s}
    good = sum(all(value[k](r) * 1e3 <= limit for k, limit in slo_ms.items()) for r in ok)
    return Goodput(good, dict(slo_ms))


def summarize(result: RunResult, slo_ms: dict[str, float] | None = None, rate: float | None = None,
              burstiness: float | None = None) -> dict:
    """The summary.json dict: vLLM `bench serve` result keys plus `failed`, `errors_by_kind` and a few extras."""
    recs = result.records
    ok = [r for r in recs if r.is_success]
    dur = max(result.duration_s, 1e-9)
    n_in = sum(r.num_prompt_tokens for r in ok)
    n_out = sum(r.num_output_tokens for r in ok)
    good = goodput(ok, slo_ms) if slo_ms else None
    cached = [r for r in ok if r.server_cached_tokens >= 0]  # the requests whose server said
    cached_share = sum(r.server_cached_tokens for r in cached) / max(1, sum(r.num_prompt_tokens for r in cached))
    lag = [r.send_at_s - r.arrival_s for r in recs]
    out = {
        "duration": result.duration_s, "completed": len(ok), "failed": len(recs) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": good.num_good / dur if good else None,
        "output_throughput": n_out / dur, "total_token_throughput": (n_in + n_out) / dur,
        "max_output_tokens_per_s": peak_output_tok_s(recs), "max_concurrent_requests": peak_concurrency(recs),
        "max_concurrency": result.max_concurrency, "burstiness": burstiness,
        "request_rate": "inf" if rate is not None and np.isinf(rate) else rate,  # as vLLM writes it
    }
    out.update(_stats_ms("ttft", [r.ttft_s for r in ok]))
    out.update(_stats_ms("tpot", [r.tpot_s for r in ok if r.num_output_tokens > 1]))
    out.update(_stats_ms("itl", [x for r in ok for x in r.itl_s]))
    out.update(_stats_ms("e2el", [r.e2e_s for r in ok]))
    out.update({
        "slo_ms": good.slo_ms if good else None, "good_requests": good.num_good if good else None,
        "errors_by_kind": dict(Counter(r.error_kind for r in recs if not r.is_success)),
        "num_output_len_mismatch": sum(r.num_output_tokens != r.num_expected_output_tokens for r in ok),
        "num_prompt_len_mismatch": sum(0 <= r.server_prompt_tokens != r.num_prompt_tokens for r in ok),
        "prompt_cached_share": cached_share if cached else None,  # of their prompt tokens, from its prefix cache
        "mean_send_lag_ms": float(np.mean(lag)) * 1e3 if lag else 0.0,
        "p99_send_lag_ms": float(np.percentile(lag, 99)) * 1e3 if lag else 0.0,
        "input_lens": [r.num_prompt_tokens for r in recs],
        "output_lens": [r.num_output_tokens for r in recs],
        "ttfts": [r.ttft_s for r in recs],
        "start_times": [r.send_at_s for r in recs],
        "itls": [[round(x, 7) for x in r.itl_s] for r in recs],
        "errors": [r.error for r in recs],
    })
    return out
