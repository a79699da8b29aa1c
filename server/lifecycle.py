"""Graceful shutdown: on SIGTERM (or Ctrl-C) stop taking work, let in-flight requests finish
within the grace period, cancel the rest cleanly, then let uvicorn close the connections.

    SIGTERM -> is_draining (new /v1/* get 503, /health 503 draining)
            -> wait until the engine holds no request, at most shutdown_grace_s
            -> abort the rest (streams get an error chunk, others 503) -> uvicorn exits
    a second signal exits at once
"""
from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from server.api import ServerState

log = logging.getLogger("hetserve")


async def drain(state: ServerState, grace_s: float) -> None:
    engine = state.engine
    state.is_draining = True

    def busy() -> int:
        return engine.num_running + engine.num_waiting

    log.info("shutting down: %d requests in flight, up to %.0f s to finish; new requests get 503", busy(), grace_s)
    deadline = time.monotonic() + grace_s
    while busy() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if busy():
        log.warning("shutdown grace period over: cancelling %d requests", busy())
        engine.abort_all("server shutting down: the request was cancelled after the shutdown grace period")
        deadline = time.monotonic() + 5
        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # the last events reach their responses before uvicorn closes connections


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains (see module doc) instead of closing at once.
    It does not re-raise the signal afterwards, so the process exits 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float):
        super().__init__(config)
        self.state, self.grace_s = state, grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_draining = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._is_draining or self._loop is None or not self.started:
            self.should_exit = True
            self.force_exit = self._is_draining
            return
        self._is_draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def run() -> None:
            await drain(self.state, self.grace_s)
            self.should_exit = True

        self._drain_task = asyncio.ensure_future(run())
