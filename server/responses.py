"""OpenAI response objects for one request: whole, or streamed as SSE `data:` chunks."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from starlette.responses import StreamingResponse

from server.engine import Engine
from server.request import RequestEvent
from server.protocol import APIError
from server.structured import ToolCallStream, Tools, tool_message


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
    prompt_ids: tuple[int, ...] = ()
    """Completions' echo: the prompt's tokens, listed before the first token (the first with no logprob)."""
    offset: int = 0

    def __call__(self, events: Sequence[RequestEvent]) -> dict:
        pairs = []
        for ev in events:
            if ev.prompt_logprobs and self.prompt_ids:
                pairs += [(self.prompt_ids[0], None), *zip(self.prompt_ids[1:], ev.prompt_logprobs)]
            pairs += zip(ev.token_ids, ev.logprobs)
        if self.chat:
            return {"content": [{**self._token(t, lp), "top_logprobs": [self._token(i, x) for i, x in top]}
                                for t, (lp, top) in pairs]}
        tokens = [self._text(t) for t, _ in pairs]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp[0] for _, lp in pairs],
                "top_logprobs": [None if lp is None else {self._text(i): x for i, x in lp[1]} for _, lp in pairs],
                "text_offset": offsets}

    def _text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _token(self, token_id: int, logprob: float) -> dict:
        return {"token": self._text(token_id), "logprob": logprob, "bytes": list(self.token_bytes(token_id))}


@dataclass(frozen=True)
class Shape:
    """Builds OpenAI response objects for one request, of `n` choices (each an engine request of its own)."""

    request_id: str
    model: str
    chat: bool
    n: int = 1
    logprobs: tuple[Logprobs, ...] = field(default=(), compare=False)
    """One per choice, when the request asked for logprobs."""
    echo: str | None = None
    """Completions' echo: the prompt's text, put before each choice's text."""
    _echoed: set[int] = field(default_factory=set, compare=False)
    """Choices whose stream has sent `echo`."""
    tools: Tools | None = None
    """Chat's tools, when the model may call them: its output becomes `tool_calls`."""
    _tool_streams: dict[int, ToolCallStream] = field(default_factory=dict, compare=False)

    def call_ids(self, i: int) -> str:
        """The prefix of choice i's tool call ids."""
        return f"call_{self.request_id[-16:]}_{i}_"

    @property
    def engine_ids(self) -> list[str]:
        """The engine's request id of each choice."""
        return [self.request_id] if self.n == 1 else [f"{self.request_id}-{i}" for i in range(self.n)]

    def _base(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": obj, "created": int(time.time()), "model": self.model}

    @staticmethod
    def usage(last: Sequence[RequestEvent]) -> dict:
        """From each choice's last event: the prompt counted once (its cached tokens as the first choice
        found them), every choice's outputs."""
        prompt, completion = last[0].num_prompt_tokens, sum(ev.num_output_tokens for ev in last)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": last[0].num_cached_tokens}}

    def whole(self, events: Sequence[Sequence[RequestEvent]]) -> dict:
        """events: each choice's events, its last with its finish_reason."""
        choices = []
        for i, evs in enumerate(events):
            text, reason = (self.echo or "") + "".join(e.text for e in evs), evs[-1].finish_reason
            if self.tools is not None:
                message, reason = tool_message(self.tools, text, reason, self.call_ids(i))
                choice = {"index": i, "message": message}
            else:
                choice = {"index": i, "message": {"role": "assistant", "content": text}} if self.chat else \
                    {"index": i, "text": text}
            choice.update(logprobs=self.logprobs[i](evs) if self.logprobs else None, finish_reason=reason)
            if evs[-1].stop_reason:
                choice["stop_reason"] = evs[-1].stop_reason
            choices.append(choice)
        last = [evs[-1] for evs in events]
        sim = {"x_sim": last[0].sim} if last[0].sim else {}
        return {**self._base(False), "choices": choices, "usage": self.usage(last), **sim}

    def shows_logprobs(self, ev: RequestEvent) -> bool:
        """The request asked for logprobs and `ev` has some: its tokens', or the prompt's (echo)."""
        return bool(self.logprobs) and bool(ev.logprobs or ev.prompt_logprobs)

    def chunk(self, i: int, ev: RequestEvent | None) -> dict:
        """A stream's chunk of choice i's `ev`; None: chat's first chunk of a choice, which gives the role."""
        if ev is None:
            return {**self._base(True), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]}
        reason = ev.finish_reason
        if self.tools is not None:
            calls = self._tool_streams.setdefault(i, ToolCallStream(self.tools, self.call_ids(i)))
            delta = calls.delta(ev.text)
            last, reason = calls.finish(reason)
            choice = {"index": i, "delta": {**delta, **last}}
        elif self.chat:
            choice = {"index": i, "delta": {"content": ev.text} if ev.text else {}}
        elif self.echo is not None and i not in self._echoed:
            self._echoed.add(i)
            choice = {"index": i, "text": self.echo + ev.text}
        else:
            choice = {"index": i, "text": ev.text}
        choice.update(logprobs=self.logprobs[i]([ev]) if self.shows_logprobs(ev) else None, finish_reason=reason)
        if ev.stop_reason:
            choice["stop_reason"] = ev.stop_reason
        return {**self._base(True), "choices": [choice]}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def abort_unfinished(engine: Engine, shape: Shape, last: dict[int, RequestEvent]) -> None:
    for i, request_id in enumerate(shape.engine_ids):
        if i not in last or last[i].finish_reason is None:
            engine.abort(request_id)


async def stream(engine: Engine, events: asyncio.Queue, shape: Shape, include_usage: bool):
    """events: (choice, event) pairs of the request's choices."""
    last: dict[int, RequestEvent] = {}
    try:
        if shape.chat:
            for i in range(shape.n):
                yield _sse(shape.chunk(i, None))
        while len(last) < shape.n or any(ev.finish_reason is None for ev in last.values()):
            i, ev = await events.get()
            last[i] = ev
            err = event_error(ev)
            if err is not None:
                yield _sse(err.body())
                break
            if ev.text or ev.finish_reason or shape.shows_logprobs(ev):
                sim = {"x_sim": ev.sim} if ev.finish_reason and ev.sim else {}
                yield _sse({**shape.chunk(i, ev), **sim})
        if include_usage and len(last) == shape.n:
            yield _sse({**shape._base(True), "choices": [], "usage": shape.usage([last[i] for i in range(shape.n)])})
        yield "data: [DONE]\n\n"
    finally:
        abort_unfinished(engine, shape, last)


class EngineStream(StreamingResponse):
    """SSE response whose request is aborted however the response ends, also when the client left
    before the first chunk (then the generator above never starts, so its `finally` never runs).
    Aborting a finished request is a no-op."""

    def __init__(self, engine: Engine, events: asyncio.Queue, shape: Shape, include_usage: bool):
        super().__init__(stream(engine, events, shape, include_usage), media_type="text/event-stream")
        self._engine, self._shape = engine, shape

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for request_id in self._shape.engine_ids:
                self._engine.abort(request_id)
