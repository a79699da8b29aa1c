"""The Ray executor without CPU attention actors (`--ray-cpu-actors 0`, the default): one backend actor
holds the model and the KV, steps come over the token-checked step channel. Real Ray, a local cluster."""
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server import channel
from server.config import ServeConfig
from tests.conftest import RunningServer
from tests.test_ray import body, complete, kill_model_actor_mid_stream

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def one_process_server():
    srv = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, max_num_seqs=16, executor="ray",
                                    cpu_linear_dtype="float32"))  # as the local `server` it is compared with
    yield srv
    srv.close()


def test_one_process_ray_matches_local_token_for_token(server, one_process_server):
    assert one_process_server.engine.backend.cpu_actors == []
    with ThreadPoolExecutor(4) as pool:
        ray_texts = list(pool.map(lambda i: complete(one_process_server.url, i), range(4)))
    assert ray_texts == [complete(server.url, i) for i in range(4)]
    lps = [httpx.post(url + "/v1/completions", json={**body(1, 8), "logprobs": 2}, timeout=600).json()["choices"][0]
           ["logprobs"] for url in (one_process_server.url, server.url)]
    assert lps[0]["tokens"] == lps[1]["tokens"]
    assert lps[0]["token_logprobs"] == pytest.approx(lps[1]["token_logprobs"], abs=1e-3)
    assert httpx.get(one_process_server.url + "/health").json()["status"] == "ok"


def test_step_channel_admits_only_the_token_and_carries_objects():
    for sent, admitted in ((b"secret-token-16b", True), (bytes(16), False), (b"short", False)):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(sent)
            if len(sent) < 16:
                a.shutdown(socket.SHUT_WR)  # a peer that stops early
            assert channel.admit(b, b"secret-token-16b", timeout_s=5) is admitted
            if admitted:
                assert a.recv(1) == b"\x01"  # connect() waits for it
                step = {"chunks": [1, 2, 3], "error": ValueError("bad")}
                channel.send_object(a, step)
                got = channel.recv_object(b)
                assert got["chunks"] == [1, 2, 3] and isinstance(got["error"], ValueError)


def test_connect_is_refused_without_the_token():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = listener.getsockname()[:2]
        with ThreadPoolExecutor(1) as pool:
            for token, admitted in ((b"secret-token-16b", True), (b"wrong-token-16by", False)):
                def accept_one():
                    conn, _ = listener.accept()
                    with conn:
                        ok = channel.admit(conn, b"secret-token-16b", timeout_s=5)
                        if ok:
                            channel.send_object(conn, "hello")
                        return ok
                verdict = pool.submit(accept_one)
                if admitted:
                    with channel.connect(address, 5, token) as sock:
                        assert channel.recv_object(sock) == "hello"
                else:
                    with pytest.raises(channel.ChannelClosed):
                        channel.connect(address, 5, token)
                assert verdict.result(timeout=10) is admitted


def test_broken_step_connection_to_a_live_actor_reconnects(server, one_process_server):
    """The connection breaks while the actor lives (its step loop is busy in serve_steps, so no Ray call
    reaches it): the server reconnects to the same actor, without a restart, and serves again."""
    backend = one_process_server.engine.backend
    serving = backend._serving
    backend._step_sock.shutdown(socket.SHUT_RDWR)
    r = httpx.post(one_process_server.url + "/v1/completions", json=body(0, 4), timeout=120)
    assert r.status_code in (200, 500, 503), r.text  # the request that met the broken connection may fail
    deadline = time.monotonic() + 30
    while httpx.get(one_process_server.url + "/health", timeout=5).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the step channel did not reconnect"
        time.sleep(0.2)
    assert complete(one_process_server.url, 2) == complete(server.url, 2)
    assert backend._serving is serving  # the same actor: reconnected, not restarted


def test_killed_backend_actor_fails_requests_and_comes_back(server, one_process_server):
    """The actor dies mid-stream: every in-flight stream ends with a clear error, /health says down until Ray
    has restarted it (KV and all), then requests succeed again with the same text."""
    kill_model_actor_mid_stream(one_process_server, 3)
    deadline = time.monotonic() + 180
    while httpx.get(one_process_server.url + "/health", timeout=5).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the backend actor did not come back"
        time.sleep(0.5)
    assert complete(one_process_server.url, 3) == complete(server.url, 3)
    assert one_process_server.engine.backend._unsent_frees == ()
    assert all(b == 0 for b in one_process_server.engine.blocks.shard_used_bytes())
