"""The server's front door, as plain ASGI middleware (streams pass through untouched):

    request id -> access log -> 503 while draining -> API key -> body size limit -> the app

A request id comes from the client's `X-Request-Id` (when short and printable) or is made
here; it is echoed in the response header and carried by every log line about the request.
"""
from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from server.logs import request_id_var
from server.protocol import APIError

log = logging.getLogger("hetserve.access")
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,64}")


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None
    """Bearer token required outside `exempt_paths`; None: no key."""
    exempt_paths: tuple[str, ...]
    """Paths answered without the key (health checks, Prometheus)."""
    max_body_bytes: int
    """Bodies beyond this get 413 before any parsing."""


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def send_error(send: Callable, err: APIError) -> None:
    body = err.render()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app, cfg: GuardConfig, is_draining: Callable[[], bool]):
        self.app, self.cfg, self.is_draining = app, cfg, is_draining

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client_id = _header(scope, b"x-request-id")
        request_id = client_id if client_id and _CLIENT_ID.fullmatch(client_id) else "req-" + uuid.uuid4().hex[:16]
        token = request_id_var.set(request_id)
        t0, status = time.perf_counter(), [0]

        async def send_tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            err = self._refusal(scope)
            if err is not None:
                return await send_error(send_tagged, err)
            await self._with_body_limit(scope, receive, send_tagged)
        finally:
            if scope["path"] not in ("/health", "/metrics") or status[0] >= 400:
                log.info("%s %s %d %.1f ms", scope["method"], scope["path"], status[0],
                         (time.perf_counter() - t0) * 1e3, extra={"status": status[0], "path": scope["path"]})
            request_id_var.reset(token)

    def _refusal(self, scope: dict) -> APIError | None:
        path = scope["path"]
        if self.is_draining() and path.startswith("/v1/"):
            return APIError(503, "the server is shutting down; retry on another replica", code="shutting_down")
        if self.cfg.api_key is None or path in self.cfg.exempt_paths or scope["method"] == "OPTIONS":
            return None
        auth = _header(scope, b"authorization") or ""
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.cfg.api_key.encode()):
            return APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None

    async def _with_body_limit(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Read the whole body (at most max_body_bytes) before the app sees it, then replay it."""
        limit = self.cfg.max_body_bytes
        too_big = APIError(413, f"request body exceeds {limit} bytes (the server's max_body_bytes)",
                           code="request_too_large")
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await send_error(send, too_big)
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > limit:
                return await send_error(send, too_big)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the client's disconnect, which streams and handlers watch for

        await self.app(scope, replay, send)

