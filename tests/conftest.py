"""Shared fixtures: a real hetserve server (real model, real HTTP) running in this process."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from hetcore.openmp import limit_spinning

limit_spinning()  # before torch and Numba load OpenMP (the servers below run in this process)

from server.config import ServeConfig  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"


def wait_healthy(proc, url: str, log_path: Path, timeout_s: float) -> None:
    """Until GET /health answers 200; fails with the log's tail if `proc` exits or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """The daemon's real parts (engine thread + uvicorn) on a free loopback port."""

    def __init__(self, cfg: ServeConfig):
        import uvicorn

        from server.api import ServerState, create_app
        from server.launch import start_engine, warm_up

        self.engine, self.model_name, max_model_len = start_engine(cfg)
        warm_up(self.engine, cfg.lsh_config())
        self.port = free_port()
        self.state = ServerState(self.engine, self.model_name, max_model_len, cfg=cfg)
        app = create_app(self.state)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.engine.stop()


@pytest.fixture(scope="session")
def server():
    """Default model, exact fp32 KV and fp32 linears (so greedy output can be compared with HF
    transformers; the bf16 linears of `cpu_linear_dtype` auto are tested in test_model.py)."""
    srv = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=512 * 2**20, max_num_seqs=64,
                                    cpu_linear_dtype="float32"))
    yield srv
    srv.close()
