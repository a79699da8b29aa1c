"""SIGTERM on a real `hetserve serve` process with requests in flight: new work gets 503, a short
request finishes, long ones are cancelled cleanly after the grace period, the process exits 0."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import free_port, wait_healthy

GRACE_S = 4.0


def _stream(url: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    out["chunks"] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["chunks"].append(line[6:])
                started.set()


def _post(url: str, out: dict) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
    out["response"] = httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_sigterm_drains_then_cancels_and_exits_zero(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "hetserve", "serve", "--port", str(port), "--kv-format", "fp32",
           "--kv-cache-bytes", "64MiB", "--max-num-seqs", "8", "--shutdown-grace-s", str(GRACE_S),
           "--log-format", "json"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url, log_path, timeout_s=180)
        short, long, whole = {}, {}, {}
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream, args=(url, 6, short, started[0])),
                   threading.Thread(target=_stream, args=(url, 3000, long, started[1])),
                   threading.Thread(target=_post, args=(url, whole))]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "draining"}
        t_term = time.monotonic()
        assert proc.wait(timeout=GRACE_S + 20) == 0
        assert time.monotonic() - t_term < GRACE_S + 10
        for t in threads:
            t.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert short["chunks"][-1] == "[DONE]" and json.loads(short["chunks"][-2])["choices"][0]["finish_reason"] == "length"
    err = json.loads(long["chunks"][-2])["error"]
    assert long["chunks"][-1] == "[DONE]" and "shutting down" in err["message"] and err["code"] == "cancelled"
    assert whole["response"].status_code == 503 and "shutting down" in whole["response"].json()["error"]["message"]
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert any(rec["msg"].startswith("shutting down") for rec in lines)
    assert any(rec.get("request_id") and rec.get("path") == "/v1/completions" for rec in lines)


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ray_executor_runs_at_normal_priority_and_stops_every_process(tmp_path, stop):
    """`hetserve serve --executor ray`: the actors run at the server's own nice level (Ray's default 15 let
    the API process preempt them), and Ctrl-C (SIGINT to the whole process group, as a terminal sends it)
    or SIGTERM to the server alone (as `kill`, systemd or Kubernetes send it) stops every process the
    daemon started, Ray's agents included, and the server exits 0."""
    import os

    import psutil

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "hetserve", "serve", "--executor", "ray", "--port", str(port), "--kv-format", "fp32",
           "--kv-cache-bytes", "64MiB", "--max-num-seqs", "4", "--shutdown-grace-s", "2"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, url, log_path, timeout_s=300)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        started = psutil.Process(proc.pid).children(recursive=True)
        actors = [p for p in started if p.name().startswith("ray::") or "ModelActor" in " ".join(p.cmdline())
                  or "AttentionActor" in " ".join(p.cmdline())]
        assert actors, [p.cmdline() for p in started]
        assert {p.nice() for p in actors} == {psutil.Process(proc.pid).nice()}
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        gone, alive = psutil.wait_procs(started, timeout=10)
        assert not alive, [(p.pid, p.cmdline()) for p in alive if p.is_running()]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_engine_closes_its_backend_on_the_thread_that_built_it():
    """A backend may own processes that die with the thread that started them (Ray spawns its local
    cluster with PR_SET_PDEATHSIG): Engine.stop() lets the engine thread close the backend before it
    exits, not the caller after the join."""
    from server.config import ServeConfig
    from server.launch import start_engine

    engine, _, _ = start_engine(ServeConfig(kv_format="fp32", kv_cache_bytes=16 * 2**20, max_num_seqs=2))
    closed_on, close = [], engine.backend.close

    def recording_close() -> None:
        closed_on.append(threading.current_thread().name)
        close()

    engine.backend.close = recording_close
    engine.stop()
    engine.stop()  # a second stop does not close it again
    assert closed_on == ["hetserve-engine"]
