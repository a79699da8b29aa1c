"""The Ray executor (real Ray, a local cluster): a model actor and two CPU attention actors give
the same greedy text as the local executor, and survive a CPU attention actor being killed."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.config import ServeConfig
from tests.conftest import RunningServer

pytest.importorskip("ray")


def body(i: int, max_tokens: int = 32) -> dict:
    return {"prompt": f"Request {i}. Tell me about the history of the number {i * 37}.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


def complete(url: str, i: int, max_tokens: int = 32) -> str:
    r = httpx.post(url + "/v1/completions", json=body(i, max_tokens), timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream(url: str, i: int, max_tokens: int, first_token: threading.Event) -> tuple[str, str | None]:
    """(text, error message or None) of a streamed completion."""
    text, error = "", None
    with httpx.stream("POST", url + "/v1/completions", json={**body(i, max_tokens), "stream": True}, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
            else:
                text += event["choices"][0]["text"]
                first_token.set()
    return text, error


@pytest.fixture(scope="module")
def ray_server():
    srv = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=512 * 2**20, max_num_seqs=64, executor="ray",
                                    ray_cpu_actors=2, ray_microbatches=2,  # the pipelined path, the harder one
                                    cpu_linear_dtype="float32"))  # as the local `server` it is compared with
    yield srv
    srv.close()


def test_ray_executor_matches_local_token_for_token(server, ray_server):
    assert ray_server.engine.blocks.num_shards == 2
    with ThreadPoolExecutor(6) as pool:
        ray_texts = list(pool.map(lambda i: complete(ray_server.url, i), range(6)))
    local_texts = [complete(server.url, i) for i in range(6)]
    assert ray_texts == local_texts
    lps = [httpx.post(url + "/v1/completions", json={**body(1, 8), "logprobs": 2}, timeout=600).json()["choices"][0]
           ["logprobs"] for url in (ray_server.url, server.url)]  # the model actor returns them too
    assert lps[0]["tokens"] == lps[1]["tokens"] and len(lps[0]["tokens"]) == 8
    assert lps[0]["token_logprobs"] == pytest.approx(lps[1]["token_logprobs"], abs=1e-3)
    assert all(len(top) == 2 for top in lps[0]["top_logprobs"])
    penalized = {**body(2), "frequency_penalty": 1.5}  # the model actor needs each request's outputs for them
    texts = [httpx.post(url + "/v1/completions", json=penalized, timeout=600).json()["choices"][0]["text"]
             for url in (ray_server.url, server.url)]
    assert texts[0] == texts[1] and texts[0] != local_texts[2]
    echo = {"prompt": body(3)["prompt"] * 40, "max_tokens": 0, "echo": True, "logprobs": 1}  # scored over 2 actors
    scored = [httpx.post(url + "/v1/completions", json=echo, timeout=600).json()["choices"][0]["logprobs"]
              for url in (ray_server.url, server.url)]
    assert len(scored[0]["tokens"]) > 512 and scored[0]["tokens"] == scored[1]["tokens"]
    assert scored[0]["token_logprobs"][1:] == pytest.approx(scored[1]["token_logprobs"][1:], abs=1e-3)
    # n choices: 1 and 2 take choice 0's prompt blocks in the step that computes them; the step splits in two
    # micro-batches, choice 0 in the first, so each layer's KV is written by one before the other reads it
    fan = {**body(4, 8), "prompt": body(4)["prompt"] * 4, "n": 3}
    hits = ray_server.engine.blocks.hit_tokens
    choices = [httpx.post(url + "/v1/completions", json=fan, timeout=600).json()["choices"]
               for url in (ray_server.url, server.url)]
    assert [c["text"] for c in choices[0]] == [c["text"] for c in choices[1]] == [choices[1][0]["text"]] * 3
    assert ray_server.engine.blocks.hit_tokens - hits >= 2 * 48
    assert all(b == 0 for b in ray_server.engine.blocks.shard_used_bytes())


def test_killed_cpu_actor_requests_recompute_or_fail_cleanly(server, ray_server):
    import ray

    expected = [complete(server.url, i, 48) for i in range(6)]
    backend = ray_server.engine.backend
    started = [threading.Event() for _ in range(6)]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, ray_server.url, i, 48, started[i]) for i in range(6)]
        assert all(e.wait(120) for e in started)
        ray.kill(backend.cpu_actors[1], no_restart=False)  # a crash: Ray restarts it
        results = [f.result(timeout=300) for f in futures]
    for (text, error), want in zip(results, expected):
        assert error is not None or text == want, (text, want)
        assert error is None or "worker" in error
    assert complete(ray_server.url, 7) == complete(server.url, 7)  # later requests succeed
    deadline = time.monotonic() + 120
    while httpx.get(ray_server.url + "/health").json()["status"] != "ok":
        assert time.monotonic() < deadline, "the killed actor did not come back"
        time.sleep(0.5)
    assert ray_server.engine.scheduler.num_preemptions > 0
    with ThreadPoolExecutor(4) as pool:  # both shards serve again
        assert list(pool.map(lambda i: complete(ray_server.url, i), range(4))) == \
            [complete(server.url, i) for i in range(4)]


def kill_model_actor_mid_stream(srv, num_streams: int) -> None:
    """Kill the model actor (Ray restarts it) while num_streams streams decode: each must end with its error."""
    import ray

    started = [threading.Event() for _ in range(num_streams)]
    with ThreadPoolExecutor(num_streams) as pool:
        futures = [pool.submit(stream, srv.url, i, 400, started[i]) for i in range(num_streams)]
        assert all(e.wait(120) for e in started)
        ray.kill(srv.engine.backend.model_actor, no_restart=False)
        results = [f.result(timeout=300) for f in futures]
    for text, error in results:
        assert error is not None and "accelerator worker" in error, (text, error)


def test_killed_model_actor_fails_requests_and_comes_back(server, ray_server):
    """The accelerator worker dies mid-stream: every in-flight stream ends with a clear error,
    /health says down (503) until Ray has restarted it, then requests succeed again."""
    kill_model_actor_mid_stream(ray_server, 4)
    r = httpx.get(ray_server.url + "/health", timeout=5)
    assert (r.status_code, r.json()["status"]) == (503, "down")
    backend = ray_server.engine.backend
    deadline = time.monotonic() + 10  # the failed sequences' frees wait for the restarted worker
    while len(backend._unsent_frees) < 4 and backend.model_down:
        assert time.monotonic() < deadline, backend._unsent_frees
        time.sleep(0.05)
    deadline = time.monotonic() + 180
    while httpx.get(ray_server.url + "/health", timeout=5).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the accelerator worker did not come back"
        time.sleep(0.5)
    assert complete(ray_server.url, 3) == complete(server.url, 3)
    assert backend._unsent_frees == ()  # delivered with the first step after the restart
    assert all(b == 0 for b in ray_server.engine.blocks.shard_used_bytes())
