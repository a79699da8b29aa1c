"""OpenAI response objects for one request: whole, or streamed as SSE `data:` chunks."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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


@dataclass
class Logprobs:
    """OpenAI's `logprobs` object of a run of tokens: chat's `content` list, or completions' four lists
    (whose `text_offset` runs on from one streamed chunk to the next)."""

    token_bytes: Callable[[int], bytes]
    chat: bool
    offset: int = 0

    def __call__(self, events: Sequence[RequestEvent]) -> dict:
        pairs = [(t, lp) for ev in events for t, lp in zip(ev.token_ids, ev.logprobs)]
        if self.chat:
            return {"content": [{**self._token(t, lp), "top_logprobs": [self._token(i, x) for i, x in top]}
                                for t, (lp, top) in pairs]}
        tokens = [self._text(t) for t, _ in pairs]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in pairs],
                "top_logprobs": [{self._text(i): x for i, x in top} for _, (_, top) in pairs], "text_offset": offsets}

    def _text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _token(self, token_id: int, logprob: float) -> dict:
        raw = self.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


@dataclass(frozen=True)
class Shape:
    """Builds OpenAI response objects for one request."""

    request_id: str
    model: str
    chat: bool
    logprobs: Logprobs | None = field(default=None, compare=False)
    """Set when the request asked for logprobs."""

    def _base(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": obj, "created": int(time.time()), "model": self.model}

    @staticmethod
    def usage(ev: RequestEvent) -> dict:
        return {"prompt_tokens": ev.num_prompt_tokens, "completion_tokens": ev.num_output_tokens,
                "total_tokens": ev.num_prompt_tokens + ev.num_output_tokens}

    def whole(self, events: Sequence[RequestEvent]) -> dict:
        text, ev = "".join(e.text for e in events), events[-1]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=self.logprobs(events) if self.logprobs else None, finish_reason=ev.finish_reason)
        sim = {"x_sim": ev.sim} if ev.sim else {}
        return {**self._base(False), "choices": [choice], "usage": self.usage(ev), **sim}

    def chunk(self, ev: RequestEvent | None) -> dict:
        """A stream's chunk of `ev`; None: chat's first chunk, which gives the role."""
        if ev is None:
            return {**self._base(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]}
        if self.chat:
            choice = {"index": 0, "delta": {"content": ev.text} if ev.text else {}}
        else:
            choice = {"index": 0, "text": ev.text}
        choice.update(logprobs=self.logprobs([ev]) if self.logprobs and ev.logprobs else None,
                      finish_reason=ev.finish_reason)
        return {**self._base(True), "choices": [choice]}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream(engine: Engine, events: asyncio.Queue, shape: Shape, include_usage: bool):
    ev = None
    try:
        if shape.chat:
            yield _sse(shape.chunk(None))
        while ev is None or ev.finish_reason is None:
            ev = await events.get()
            err = event_error(ev)
            if err is not None:
                yield _sse(err.body())
                break
            if ev.text or ev.finish_reason or (shape.logprobs and ev.logprobs):
                sim = {"x_sim": ev.sim} if ev.finish_reason and ev.sim else {}
                yield _sse({**shape.chunk(ev), **sim})
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
