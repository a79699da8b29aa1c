"""OpenAI response objects for one request: whole, or streamed as SSE `data:` chunks."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from starlette.responses import StreamingResponse

from server.engine import Engine, RequestEvent
from server.protocol import APIError


def event_error(ev: RequestEvent) -> APIError | None:
    """The error a finished request ended with, or None when it ended normally (stop, length)."""
    if ev.finish_reason == "timeout":
        return APIError(408, ev.error or "request timed out", code="request_timeout")
    if ev.finish_reason == "abort":
        return APIError(503, ev.error or "request cancelled", code="cancelled")
    if ev.finish_reason == "error":
        return APIError(500, ev.error or "generation failed", code="generation_failed")
    return None


@dataclass(frozen=True)
class Shape:
    """Builds OpenAI response objects for one request."""

    request_id: str
    model: str
    chat: bool

    def _base(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": obj, "created": int(time.time()), "model": self.model}

    @staticmethod
    def usage(ev: RequestEvent) -> dict:
        return {"prompt_tokens": ev.num_prompt_tokens, "completion_tokens": ev.num_output_tokens,
                "total_tokens": ev.num_prompt_tokens + ev.num_output_tokens}

    def whole(self, text: str, ev: RequestEvent) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": ev.finish_reason}
        else:
            choice = {"index": 0, "text": text, "finish_reason": ev.finish_reason, "logprobs": None}
        sim = {"x_sim": ev.sim} if ev.sim else {}
        return {**self._base(False), "choices": [choice], "usage": self.usage(ev), **sim}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return {**self._base(True), "choices": [choice]}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream(engine: Engine, events: asyncio.Queue, shape: Shape, include_usage: bool):
    ev = None
    try:
        if shape.chat:
            yield _sse(shape.chunk(None, None, role=True))
        while ev is None or ev.finish_reason is None:
            ev = await events.get()
            err = event_error(ev)
            if err is not None:
                yield _sse(err.body())
                break
            if ev.text or ev.finish_reason:
                sim = {"x_sim": ev.sim} if ev.finish_reason and ev.sim else {}
                yield _sse({**shape.chunk(ev.text, ev.finish_reason), **sim})
        if include_usage:
            yield _sse({**shape._base(True), "choices": [], "usage": shape.usage(ev)})
        yield "data: [DONE]\n\n"
    finally:
        if ev is None or ev.finish_reason is None:
            engine.abort(shape.request_id)


class EngineStream(StreamingResponse):
    """SSE response whose request is aborted however the response ends, also when the client left
    before the first chunk (then the generator above never starts, so its `finally` never runs).
    Aborting a finished request is a no-op."""

    def __init__(self, engine: Engine, events: asyncio.Queue, shape: Shape, include_usage: bool):
        super().__init__(stream(engine, events, shape, include_usage), media_type="text/event-stream")
        self._engine, self._request_id = engine, shape.request_id

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.abort(self._request_id)
