"""Overload (429), API key, timeouts, and clients that go away: the server stays responsive and
every KV block comes back."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time

import httpx
import pytest

from server.config import ServeConfig
from tests.conftest import RunningServer

KEY_ENV, KEY = "HETSERVE_TEST_API_KEY", "test-key-5f2a"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_NUM_SEQS, MAX_WAITING, TIMEOUT_S = 4, 4, 2.0


def finished(engine, reason: str) -> float:
    """Requests the engine has finished with `reason`, from its metrics."""
    return engine.metrics.value("hetserve:request_success_total", finished_reason=reason)


@pytest.fixture(scope="module")
def guarded():
    """A small server with an API key, a short queue, CORS for one origin."""
    os.environ[KEY_ENV] = KEY
    try:
        srv = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=64 * 2**20, max_num_seqs=MAX_NUM_SEQS,
                                        max_waiting_requests=MAX_WAITING,
                                        api_key_env=KEY_ENV, cors_allow_origins="https://ui.example"))
    finally:
        del os.environ[KEY_ENV]
    yield srv
    srv.close()


def wait_kv_free(srv: RunningServer, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while srv.engine.blocks.used_bytes or srv.engine.num_running or srv.engine.num_waiting:
        assert time.monotonic() < deadline, (srv.engine.blocks.used_bytes, srv.engine.num_running)
        time.sleep(0.05)


def test_api_key_guards_v1_but_not_health_or_metrics(guarded):
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        r = httpx.post(guarded.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(guarded.url + "/v1/models").status_code == 401
    assert httpx.get(guarded.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.post(guarded.url + "/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200


def test_cors_only_for_the_allowed_origin(guarded, server):
    pre = {"origin": "https://ui.example", "access-control-request-method": "POST",
           "access-control-request-headers": "authorization,content-type"}
    r = httpx.options(guarded.url + "/v1/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = httpx.options(guarded.url + "/v1/completions", headers={**pre, "origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/v1/models", headers={"origin": "https://ui.example"})  # default: CORS off
    assert "access-control-allow-origin" not in r.headers


async def _health_probe(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            for path in ("/health", "/metrics"):
                t0 = time.perf_counter()
                r = await client.get(url + path)
                latencies.append(time.perf_counter() - t0)
                assert r.status_code == 200
            await asyncio.sleep(0.05)


async def _burst(url: str, n: int) -> tuple[list[httpx.Response], list[float]]:
    stop, latencies = asyncio.Event(), []
    probe = asyncio.create_task(_health_probe(url, stop, latencies))
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits, headers=AUTH) as client:
        body = {"prompt": "Count to ten:", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        responses = await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(n)))
    stop.set()
    await probe
    return list(responses), latencies


def test_burst_beyond_the_queue_gets_429_and_health_stays_fast(guarded):
    responses, latencies = asyncio.run(_burst(guarded.url, 24))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert 1 <= codes.count(200) <= MAX_NUM_SEQS + MAX_WAITING and codes.count(429) >= 24 - MAX_NUM_SEQS - MAX_WAITING
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 4
    assert latencies and max(latencies) < 1.0, max(latencies)
    metrics = httpx.get(guarded.url + "/metrics").text
    assert f'hetserve:requests_rejected_total{{reason="queue_full"}} {codes.count(429)}' in metrics
    wait_kv_free(guarded)


def test_request_timeout_ends_request_with_408_and_frees_kv(guarded):
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}
    cfg, timeouts_before = guarded.state.cfg, finished(guarded.engine, "timeout")
    guarded.state.cfg = dataclasses.replace(cfg, request_timeout_s=TIMEOUT_S)  # read per request
    try:
        t0 = time.monotonic()
        r = httpx.post(guarded.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
        assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 3
        with httpx.stream("POST", guarded.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=60) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    finally:
        guarded.state.cfg = cfg
    assert chunks[-1]["error"]["type"] == "timeout_error" and len(chunks) > 1
    wait_kv_free(guarded, 2)
    assert finished(guarded.engine, "timeout") == timeouts_before + 2


def test_non_streaming_client_that_leaves_aborts_its_request(server):
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    wait_kv_free(server, 3)  # 2000 tokens would take a minute


async def _stream_one(client: httpx.AsyncClient, url: str, i: int, leave_after: int | None) -> dict:
    """Stream one completion; with leave_after, close the connection after that many chunks."""
    body = {"prompt": f"Item {i % 5}: a short note on", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish, n = [], None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if leave_after is not None and n >= leave_after:
                return {"i": i, "left": True}
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
                n += 1
    return {"i": i, "left": False, "text": "".join(text), "finish": finish}


async def _hundred_streams(url: str) -> list[dict]:
    rng = random.Random(9)
    leaving = set(rng.sample(range(100), 50))
    leave = [rng.randrange(0, 4) if i in leaving else None for i in range(100)]
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=110)) as client:
        return await asyncio.gather(*(_stream_one(client, url, i, leave[i]) for i in range(100)))


def test_hundred_streams_half_disconnect_rest_complete_and_kv_is_freed(server):
    alone = {}
    for k in range(5):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": f"Item {k}: a short note on", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        alone[k] = r.json()["choices"][0]["text"]
    aborted_before = finished(server.engine, "abort")
    results = asyncio.run(_hundred_streams(server.url))
    stayed = [r for r in results if not r["left"]]
    assert len(stayed) == 50
    for r in stayed:
        assert r["finish"] == "length" and r["text"] == alone[r["i"] % 5], r
    wait_kv_free(server, 10)
    assert finished(server.engine, "abort") > aborted_before
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_max_prompt_tokens_limit(guarded):
    cfg = guarded.state.cfg
    guarded.state.cfg = dataclasses.replace(cfg, max_prompt_tokens=8)  # read per request
    try:
        r = httpx.post(guarded.url + "/v1/completions", json={"prompt": list(range(1, 10)), "max_tokens": 1},
                       headers=AUTH, timeout=30)
        ok = httpx.post(guarded.url + "/v1/completions", json={"prompt": list(range(1, 9)), "max_tokens": 1},
                        headers=AUTH, timeout=30)
    finally:
        guarded.state.cfg = cfg
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "at most 8" in r.json()["error"]["message"] and ok.status_code == 200
