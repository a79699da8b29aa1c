"""Serving metrics for /metrics through prometheus_client, names in the spirit of vLLM's.

The engine thread records (`ServingMetrics.on_*`) into counters and histograms of the
ServingMetrics' own CollectorRegistry; `/metrics` renders the app's registry (`metrics_registry`),
whose one collector adds what is read at scrape time: batch and queue sizes, KV cache use, the
scheduler's and block manager's counters, and a simulated backend's clock. No registry is the
process-global default one: tests run several servers in one process, and the warm-up's
numbers are dropped by starting a fresh ServingMetrics.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetcore.backend import StepTimings

if TYPE_CHECKING:
    from server.engine import Engine

PREFIX = "hetserve:"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
GRAMMAR_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0)
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")


class ServingMetrics:
    """Request and step statistics. Written by the engine thread (and by HTTP handlers for rejections),
    read by /metrics; prometheus_client's metrics are thread-safe."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = PREFIX
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per finished request.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token of requests finished by "
                             "stop or length.", buckets=E2E_BUCKETS_S, registry=r)
        self.queue = Histogram(p + "request_queue_time_seconds", "Arrival to first scheduled step.",
                               buckets=E2E_BUCKETS_S, registry=r)
        self.step = Histogram(p + "step_time_seconds", "Engine step time by part (as the backend reports it: "
                              "accelerator, cpu_attn, step = whole step, ...).", ("part",), buckets=STEP_BUCKETS_S,
                              registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Generated tokens.", registry=r)
        self.finished = Counter(p + "request_success_total", "Finished requests by finish reason "
                                "(stop, length, abort, timeout, error).", ("finished_reason",), registry=r)
        self.grammar_compile = Histogram(p + "grammar_compile_seconds", "Compiling a request's grammar "
                                         "(structured outputs), by whether it was cached.", ("cached",),
                                         buckets=GRAMMAR_BUCKETS_S, registry=r)
        self.grammar_mask = Histogram(p + "grammar_mask_seconds", "Filling the token masks of a step's constrained "
                                      "sequences (overlapping the step).", buckets=GRAMMAR_BUCKETS_S, registry=r)
        self.rejected = Counter(p + "requests_rejected_total", "Requests refused with 429 because the queue was "
                                "full.", ("reason",), registry=r)
        for reason in FINISH_REASONS:  # every series from the start, at 0
            self.finished.labels(reason)
        self.rejected.labels("queue_full")

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_scheduled(self, queue_s: float) -> None:
        self.queue.observe(queue_s)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_step(self, timings: StepTimings | None, num_generated: int) -> None:
        self.generation_tokens.inc(num_generated)
        for part, seconds in (timings.parts() if timings is not None else {}).items():
            self.step.labels(part).observe(seconds)

    def on_finish(self, reason: str, e2e_s: float, tpot_s: float | None) -> None:
        self.finished.labels(reason).inc()
        if reason in ("stop", "length"):
            self.e2e.observe(e2e_s)
            if tpot_s is not None:
                self.tpot.observe(tpot_s)

    def on_grammar_compile(self, seconds: float, is_cached: bool) -> None:
        self.grammar_compile.labels(str(is_cached).lower()).observe(seconds)

    def on_grammar_mask(self, seconds: float) -> None:
        self.grammar_mask.observe(seconds)

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def value(self, name: str, **labels: str) -> float:
        """One sample's value now, e.g. value("hetserve:request_success_total", finished_reason="stop"); 0 if none."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def collect(self) -> Iterator[Metric]:
        """The registry's metrics without prometheus_client's `_created` timestamps (not part of these series)."""
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class EngineCollector(Collector):
    """/metrics' collector: values read from the engine at scrape time, then its ServingMetrics."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine, p = self.engine, PREFIX
        blocks = engine.blocks
        yield _gauge(p + "num_requests_running", "Requests in the running batch.", engine.num_running)
        yield _gauge(p + "num_requests_waiting", "Requests queued for the running batch.", engine.num_waiting)
        usage = GaugeMetricFamily(p + "kv_cache_usage_perc", "Share of KV cache blocks in use (0 to 1), per CPU "
                                  "attention worker's shard.", labels=("shard",))
        sizes = blocks.spec.shards or (blocks.spec.num_blocks,)
        for i, (used, n) in enumerate(zip(blocks.shard_used_bytes(), sizes)):
            usage.add_metric((str(i),), used / max(1, n * blocks.spec.bytes_per_block))
        yield usage
        groups = GaugeMetricFamily(p + "kv_cache_group_usage_bytes", "KV cache bytes in use per layer group (layered "
                                   "KV sparsity: 0 holds the full layers, the others the sparse layers' kept rows; "
                                   "one group 0 without).", labels=("group",))
        for i, n in enumerate(blocks.group_used_blocks()):
            groups.add_metric((str(i),), n * blocks.spec.bytes_per_block)
        yield groups
        yield CounterMetricFamily(p + "num_preemptions", "Sequences preempted for KV space (recomputed later).",
                                  engine.scheduler.num_preemptions)
        yield CounterMetricFamily(p + "num_kv_moves", "Sequences whose KV moved from the host's pool to the "
                                  "accelerator's (partial offload).", engine.scheduler.num_moves)
        yield CounterMetricFamily(p + "prefix_cache_queries", "Tokens of admitted sequences looked up in the "
                                  "prefix cache.", blocks.queried_tokens)
        yield CounterMetricFamily(p + "prefix_cache_hits", "Of those, tokens whose KV was found there (not "
                                  "computed).", blocks.hit_tokens)
        sched = engine.scheduler
        method = sched.cfg.speculative.method
        for name, doc, value in (
                ("spec_decode_num_drafts", "Speculative decoding: sequence steps that sent draft tokens.", sched.num_drafts),
                ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens sent.", sched.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
                 sched.num_accepted_tokens)):
            counter = CounterMetricFamily(p + name, doc, labels=("method",))
            counter.add_metric((method,), value)
            yield counter
        yield from engine.metrics.collect()
        # the names the first /metrics had (deploy/README.md)
        yield _gauge("hetserve_requests_running", "Requests in the running batch (older name).", engine.num_running)
        yield _gauge("hetserve_requests_waiting", "Requests queued (older name).", engine.num_waiting)
        clock = engine.clock
        if clock.is_running:  # a simulated backend (--backend sim)
            yield _gauge("hetserve_sim_clock_seconds", "Virtual clock of the simulated backend.", clock.now_s)
            yield CounterMetricFamily("hetserve_sim_steps", "Steps on the virtual clock.", clock.num_steps)
            yield CounterMetricFamily("hetserve_sim_output_tokens", "Tokens generated on the virtual clock.",
                                      clock.num_output_tokens)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def metrics_registry(engine: Engine) -> CollectorRegistry:
    """The app's registry for /metrics: everything the engine reports (EngineCollector)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry
