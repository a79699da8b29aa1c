"""/metrics: valid Prometheus text, vLLM-style names, exact token counters; JSON logs with request ids."""
from __future__ import annotations

import io
import json
import logging
import re
import sys

import httpx

from server.logs import JsonFormatter, StderrHandler, request_id_var
from prometheus_client import generate_latest

from server.metrics import ServingMetrics

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_]+="[^"]*",?)*\})? (-?[0-9.e+-]+|\+Inf|NaN)$')
NAMES = ["hetserve:num_requests_running", "hetserve:num_requests_waiting", "hetserve:kv_cache_usage_perc",
         "hetserve:num_preemptions_total", "hetserve:num_kv_moves_total", "hetserve:time_to_first_token_seconds",
         "hetserve:time_per_output_token_seconds", "hetserve:e2e_request_latency_seconds",
         "hetserve:request_queue_time_seconds", "hetserve:step_time_seconds", "hetserve:prompt_tokens_total",
         "hetserve:generation_tokens_total", "hetserve:request_success_total", "hetserve:requests_rejected_total"]


def scrape(url: str) -> tuple[dict[str, float], set[str]]:
    """One /metrics: its samples, and the names its TYPE lines declare."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples, declared = {}, set()
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+", line), line
            if line.startswith("# TYPE "):
                declared.add(line.split()[2])
            continue
        assert SAMPLE.match(line), line
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples, declared


def test_metrics_names_format_and_exact_counters(server):
    before, declared = scrape(server.url)
    for name in NAMES:  # declared even before a sample exists (step_time's parts appear with the first step)
        assert name in declared, name
    body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    usage = r.json()["usage"]
    after, _ = scrape(server.url)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("hetserve:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("hetserve:generation_tokens_total") == 5
    assert delta('hetserve:request_success_total{finished_reason="length"}') == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "time_per_output_token_seconds"):
        assert delta(f"hetserve:{hist}_count") == 1, hist
    assert delta('hetserve:step_time_seconds_count{part="accelerator"}') >= 5
    assert after['hetserve:kv_cache_usage_perc{shard="0"}'] == 0.0
    assert after["hetserve:num_requests_running"] == 0
    assert "hetserve_requests_running" in after  # the first /metrics' names stay


def test_histogram_buckets_are_cumulative():
    metrics = ServingMetrics()
    for v in (0.05, 0.5, 0.7, 3.0):
        metrics.on_first_token(v)
    lines = generate_latest(metrics.registry).decode().splitlines()
    name = "hetserve:time_to_first_token_seconds"
    assert f'{name}_bucket{{le="0.1"}} 1.0' in lines and f'{name}_bucket{{le="1.0"}} 3.0' in lines
    assert f'{name}_bucket{{le="+Inf"}} 4.0' in lines and f"{name}_count 4.0" in lines and f"{name}_sum 4.25" in lines


def test_request_id_is_echoed_and_json_logs_carry_it(server):
    r = httpx.get(server.url + "/v1/models", headers={"x-request-id": "client-id-42"})
    assert r.headers["x-request-id"] == "client-id-42"
    r = httpx.get(server.url + "/v1/models", headers={"x-request-id": "bad id\twith spaces"})
    assert r.headers["x-request-id"].startswith("req-")
    token = request_id_var.set("req-abc")
    try:
        record = logging.LogRecord("hetserve.api", logging.INFO, __file__, 1, "done %s", ("x",), None)
        record.status = 200
        obj = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)
    assert obj["request_id"] == "req-abc" and obj["msg"] == "done x" and obj["status"] == 200 and obj["level"] == "info"


def test_log_handler_writes_to_the_current_stderr(monkeypatch):
    """A server thread that outlives a replaced (and closed) stderr, such as a test's captured one,
    keeps logging to whatever stderr is now."""
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    before, after = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", before)
    handler.emit(logging.LogRecord("hetserve", logging.INFO, __file__, 1, "one", (), None))
    before.close()
    monkeypatch.setattr(sys, "stderr", after)
    handler.emit(logging.LogRecord("hetserve", logging.INFO, __file__, 1, "two", (), None))
    assert after.getvalue() == "two\n"
