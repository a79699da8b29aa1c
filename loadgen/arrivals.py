"""Arrival schedules: a trace's own timestamps (rescaled in time or to a target rate), and synthetic
workloads with Poisson or gamma (bursty) arrivals and BurstGPT-style Zipf token lengths."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from loadgen.traces import TraceRequest

LENGTH_DISTS = ("zipf", "uniform", "fixed")


def rescale(requests: tuple[TraceRequest, ...], time_scale: float = 1.0,
            rate: float | None = None) -> tuple[TraceRequest, ...]:
    """Multiply every inter-arrival gap by `time_scale`, or (with `rate`) by the factor that makes the
    mean rate over the trace `rate` requests/s. Order and relative burstiness are kept."""
    if rate is not None and time_scale != 1.0:
        raise ValueError("give either a time scale or a rate, not both")
    if time_scale < 0 or not math.isfinite(time_scale):
        raise ValueError(f"time scale must be finite and >= 0, got {time_scale}")
    if rate is not None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        span_s = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
        # n requests over span s is a mean rate of (n - 1) / span (the first arrives at 0)
        time_scale = 0.0 if span_s == 0 or math.isinf(rate) else (len(requests) - 1) / (span_s * rate)
    return tuple(replace(r, arrival_s=r.arrival_s * time_scale) for r in requests)


def gamma_arrivals(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Arrival times [num_requests] in s: gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean
    rate is `rate`; burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular (as vLLM's bench serve).
    rate = inf sends everything at 0 s."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=num_requests)
    gaps[0] = 0.0  # the first request starts the run
    return np.cumsum(gaps)


@dataclass(frozen=True)
class LengthDist:
    """How many tokens a synthetic request has: zipf (BurstGPT's fit), uniform, or fixed, in [min, max]."""

    kind: str = "zipf"
    min_tokens: int = 1
    max_tokens: int = 1024
    zipf_s: float = 1.0  # p(k) ~ (k - min + 1)^-s on [min, max]; BurstGPT fits request/response lengths with Zipf

    def __post_init__(self):
        if self.kind not in LENGTH_DISTS:
            raise ValueError(f"length distribution must be one of {', '.join(LENGTH_DISTS)}, got {self.kind!r}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min <= max tokens, got [{self.min_tokens}, {self.max_tokens}]")
        if self.zipf_s < 0:
            raise ValueError(f"zipf exponent must be >= 0, got {self.zipf_s}")

    def sample(self, num: int, rng: np.random.Generator) -> np.ndarray:
        """[num] token counts."""
        lo, hi = self.min_tokens, self.max_tokens
        if self.kind == "fixed" or lo == hi:
            return np.full(num, hi if self.kind == "fixed" else lo, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(lo, hi + 1, size=num)
        ranks = np.arange(1, hi - lo + 2, dtype=np.float64)
        p = ranks ** -self.zipf_s
        return lo + rng.choice(len(ranks), size=num, p=p / p.sum())


def synth_requests(num_requests: int, rate: float, burstiness: float, prompt: LengthDist, output: LengthDist,
                   seed: int = 0) -> tuple[TraceRequest, ...]:
    """A synthetic workload: gamma/Poisson arrivals and independently drawn prompt and output lengths."""
    if num_requests < 1:
        raise ValueError(f"need at least 1 request, got {num_requests}")
    rng = np.random.default_rng(seed + 1)
    t = gamma_arrivals(num_requests, rate, burstiness, seed)
    n_in, n_out = prompt.sample(num_requests, rng), output.sample(num_requests, rng)
    return tuple(TraceRequest(float(t[i]), int(n_in[i]), int(n_out[i]), line=i + 1) for i in range(num_requests))


def clip_lengths(requests: tuple[TraceRequest, ...], max_prompt_tokens: int | None,
                 max_output_tokens: int | None) -> tuple[TraceRequest, ...]:
    """Cap prompt and output lengths (a trace's contexts may exceed the model's)."""
    def cap(n: int, limit: int | None) -> int:
        return n if limit is None else min(n, limit)

    return tuple(replace(r, num_prompt_tokens=cap(r.num_prompt_tokens, max_prompt_tokens),
                         num_output_tokens=cap(r.num_output_tokens, max_output_tokens)) for r in requests)
