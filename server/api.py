"""FastAPI app: OpenAI-compatible completions and chat completions, models, health.

Handlers validate, tokenize, and submit to the engine; events come back from the engine thread
through an asyncio queue and are returned whole or streamed as SSE `data:` chunks.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from server.backend import SamplingParams
from server.engine import Engine, EngineRequest, RequestEvent
from server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, CommonParams, chat_messages, check_common,
                             completion_prompt, stop_list)


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    max_model_len: int
    created: int = 0


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="hetserve", version="0.1.0")
    engine, tok = state.engine, state.engine.tokenizer
    state.created = state.created or int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "malformed request body"))
        return _error_response(APIError(422, message, param=where, code=first.get("type")))

    @app.get("/health")
    async def health() -> JSONResponse:
        status = engine.health()
        return JSONResponse({"status": status}, status_code=503 if status == "down" else 200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        """Prometheus text format; the hetserve_sim_* series appear when the backend simulates timing."""
        lines = [f"hetserve_requests_running {engine.num_running}", f"hetserve_requests_waiting {engine.num_waiting}"]
        if engine.sim_steps:
            lines += [f"hetserve_sim_clock_seconds {engine.sim_clock_s:.6f}",
                      f"hetserve_sim_steps_total {engine.sim_steps}",
                      f"hetserve_sim_output_tokens_total {engine.sim_output_tokens}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "hetserve", "max_model_len": state.max_model_len}]}

    def limits(body: CommonParams, prompt_ids: list[int], max_tokens: int | None) -> int:
        check_common(body)
        if body.model is not None and body.model != state.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")
        n, room = len(prompt_ids), state.max_model_len - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"prompt has {n} tokens; the context holds {state.max_model_len} including at least "
                                "one generated token", param="prompt", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                                f"({state.max_model_len}); ask for at most {room}", param="max_tokens",
                           code="context_length_exceeded")
        kv_tokens = engine.blocks.spec.num_blocks * engine.blocks.spec.block_size
        if n + 1 > kv_tokens:
            raise APIError(400, f"prompt has {n} tokens; the KV cache holds {kv_tokens}", param="prompt")
        return max_tokens if max_tokens is not None else room

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        else:
            ids = list(prompt)
            if any(not 0 <= t < tok.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {tok.vocab_size})", param="prompt")
        max_tokens = limits(body, ids, body.max_tokens if "max_tokens" in body.model_fields_set else 16)
        return await _run(body, ids, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        messages = chat_messages(body)
        ids = tok.apply_chat_template(messages)
        max_tokens = limits(body, ids, body.max_completion_tokens or body.max_tokens)
        return await _run(body, ids, max_tokens, chat=True)

    async def _run(body: CommonParams, ids: list[int], max_tokens: int, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[RequestEvent] = asyncio.Queue()
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                                  seed=body.seed if body.seed is not None else random.getrandbits(63))
        engine.submit(EngineRequest(request_id, ids, sampling, max_tokens,
                                    on_event=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                                    stop=tuple(stop_list(body)), ignore_eos=body.ignore_eos))
        shape = _Shape(request_id, state.model_name, chat)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(engine, events, shape, include_usage), media_type="text/event-stream")
        try:
            text, ev = [], None
            while ev is None or ev.finish_reason is None:
                ev = await events.get()
                text.append(ev.text)
        finally:
            if ev is None or ev.finish_reason is None:
                engine.abort(request_id)
        if ev.finish_reason == "error":
            raise APIError(500, ev.error or "generation failed")
        return shape.whole("".join(text), ev)

    return app


@dataclass(frozen=True)
class _Shape:
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


async def _stream(engine: Engine, events: asyncio.Queue, shape: _Shape, include_usage: bool):
    ev = None
    try:
        if shape.chat:
            yield _sse(shape.chunk(None, None, role=True))
        while ev is None or ev.finish_reason is None:
            ev = await events.get()
            if ev.finish_reason == "error":
                yield _sse(APIError(500, ev.error or "generation failed").body())
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
