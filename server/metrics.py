"""Serving metrics in the Prometheus text format (0.0.4), names in the spirit of vLLM's.

The engine thread records (`ServingMetrics.on_*`); `/metrics` renders. Pure Python and small,
so no client library and no process-global registry (tests run several servers in one process).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from hetcore.backend import StepTimings

PREFIX = "hetserve:"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)] + ([extra] if extra else [])
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if isinstance(x, float) else str(x)


@dataclass
class Counter:
    name: str
    help: str
    label_names: tuple[str, ...] = ()
    values: dict[tuple[str, ...], float] = field(default_factory=dict)

    def inc(self, amount: float = 1, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0) + amount

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        values = self.values or ({} if self.label_names else {(): 0})
        out += [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in sorted(values.items())]
        return out


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    label_names: tuple[str, ...] = ()
    series: dict[tuple[str, ...], list] = field(default_factory=dict)
    """labels -> [per-bucket counts (not cumulative), sum, count]"""

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [[0] * len(self.buckets), 0.0, 0]
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                s[0][i] += 1
                break
        s[1] += value
        s[2] += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        series = self.series or ({} if self.label_names else {(): [[0] * len(self.buckets), 0.0, 0]})
        for key, (counts, total, n) in sorted(series.items()):
            cumulative = 0
            for upper, c in zip(self.buckets, counts):
                cumulative += c
                le = 'le="' + _num(upper) + '"'
                out.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {cumulative}")
            inf = 'le="+Inf"'
            out.append(f"{self.name}_bucket{_labels(self.label_names, key, inf)} {n}")
            out.append(f"{self.name}_sum{_labels(self.label_names, key)} {_num(total)}")
            out.append(f"{self.name}_count{_labels(self.label_names, key)} {n}")
        return out


def gauge(name: str, help: str, values: dict[tuple[str, ...], float], label_names: tuple[str, ...] = ()) -> list[str]:
    """A gauge read at scrape time."""
    out = [f"# HELP {name} {help}", f"# TYPE {name} gauge"]
    return out + [f"{name}{_labels(label_names, k)} {_num(v)}" for k, v in sorted(values.items())]


class ServingMetrics:
    """Request and step statistics. Written by the engine thread, read by /metrics: one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        p = PREFIX
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first generated token.", LATENCY_BUCKETS_S)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per finished request.", LATENCY_BUCKETS_S)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token of requests finished by "
                             "stop or length.", E2E_BUCKETS_S)
        self.queue = Histogram(p + "request_queue_time_seconds", "Arrival to first scheduled step.", E2E_BUCKETS_S)
        self.step = Histogram(p + "step_time_seconds", "Engine step time by part (as the backend reports it: "
                              "accelerator, cpu_attn, step = whole step, ...).", STEP_BUCKETS_S, ("part",))
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Generated tokens.")
        self.finished = Counter(p + "request_success_total", "Finished requests by finish reason "
                                "(stop, length, abort, timeout, error).", ("finished_reason",))
        self.rejected = Counter(p + "requests_rejected_total", "Requests refused with 429 because the queue was "
                                "full.", ("reason",))
        for reason in ("stop", "length", "abort", "timeout", "error"):
            self.finished.inc(0, reason)
        self.rejected.inc(0, "queue_full")

    def on_arrival(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens.inc(num_prompt_tokens)

    def on_scheduled(self, queue_s: float) -> None:
        with self._lock:
            self.queue.observe(queue_s)

    def on_first_token(self, ttft_s: float) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)

    def on_step(self, timings: StepTimings | None, num_generated: int) -> None:
        with self._lock:
            self.generation_tokens.inc(num_generated)
            for part, seconds in (timings.parts() if timings is not None else {}).items():
                self.step.observe(seconds, part)

    def on_finish(self, reason: str, e2e_s: float, tpot_s: float | None) -> None:
        with self._lock:
            self.finished.inc(1, reason)
            if reason in ("stop", "length"):
                self.e2e.observe(e2e_s)
                if tpot_s is not None:
                    self.tpot.observe(tpot_s)

    def on_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected.inc(1, reason)

    def render(self) -> list[str]:
        with self._lock:
            out: list[str] = []
            for m in (self.ttft, self.tpot, self.e2e, self.queue, self.step, self.prompt_tokens,
                      self.generation_tokens, self.finished, self.rejected):
                out += m.render()
            return out
