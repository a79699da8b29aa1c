"""FastAPI app: OpenAI-compatible completions and chat completions, models, health, metrics; /tokenize and
/detokenize (server.tokenizer_routes).

Handlers validate, tokenize (off the event loop), compile a requested grammar (server.structured,
server.grammar), admit (bounded queue, else 429) and submit to the engine; events come back from the engine thread through an asyncio queue and are returned
whole or streamed as SSE `data:` chunks (server.responses). server.guard sits in front: request
ids, API key, body size limit, 503 while draining.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from hetcore.backend import SamplingParams
from server.config import ServeConfig
from server.engine import Engine
from server.request import EngineRequest, RequestEvent
from server.grammar import Grammar, GrammarCompiler, GrammarError, GrammarSpec
from server.guard import Guard, GuardConfig
from server.metrics import metrics_registry
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CommonParams,
    CompletionRequest,
    chat_messages,
    check_common,
    completion_prompt,
    logit_bias,
    num_logprobs,
    stop_list,
)
from server.responses import EngineStream, Logprobs, Shape, abort_unfinished, event_error
from server.structured import Tools, prompt_messages, request_grammar, tool_setup
from server.tokenizer_routes import install_tokenizer_routes

log = logging.getLogger("hetserve.api")


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    max_model_len: int
    created: int = 0
    cfg: ServeConfig = field(default_factory=ServeConfig)
    """Limits, API key source, CORS. Queue length and request timeout are read per request; the guard's
    settings (key, body limit, CORS) when the app is made."""
    is_draining: bool = False
    """Set on SIGTERM (server.lifecycle): /v1/* answers 503, /health 503 draining."""


def _error_response(err: APIError) -> Response:
    return Response(err.render(), status_code=err.status, media_type="application/json", headers=err.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> Response:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, err: RequestValidationError) -> Response:
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":  # loc is ("body", offset): not a parameter
            at = first.get("loc", (None, "?"))[-1]
            reason = first.get("ctx", {}).get("error", "JSON decode error")
            return _error_response(APIError(400, f"request body is not valid JSON: {reason} (at character {at})",
                                            code="json_invalid"))
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "malformed request body"))
        return _error_response(APIError(422, message, param=where, code=first.get("type")))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> Response:
        # unknown routes, wrong methods, and bodies FastAPI cannot decode (bad UTF-8, nesting too deep)
        message = "request body is not valid UTF-8 JSON" if err.status_code == 400 else str(err.detail)
        return _error_response(APIError(err.status_code, message, headers=dict(err.headers or {})))


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="hetserve", version="0.1.0")
    engine, tok, cfg = state.engine, state.engine.tokenizer, state.cfg
    state.created = state.created or int(time.time())
    _install_error_handlers(app)
    app.add_middleware(Guard, cfg=GuardConfig(cfg.api_key(), cfg.csv("auth_exempt_paths"), cfg.max_body_bytes),
                       is_draining=lambda: state.is_draining)
    if cfg.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.csv("cors_allow_origins")),
                           allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"])

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "draining" if state.is_draining else engine.health()
        return JSONResponse({"status": status}, status_code=503 if status in ("down", "draining") else 200)

    registry = metrics_registry(engine)
    grammars = GrammarCompiler(tok.hf, tok.eos_token_ids,
                               on_compile=lambda s, cached: engine.metrics.on_grammar_compile(s, cached))
    install_tokenizer_routes(app, state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "hetserve", "max_model_len": state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(tok.encode, prompt)
        else:
            ids = list(prompt)
            if any(not 0 <= t < tok.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {tok.vocab_size})", param="prompt")
        max_tokens = _limits(state, body, ids, body.max_tokens if "max_tokens" in body.model_fields_set else 16)
        echo = (prompt if isinstance(prompt, str) else await asyncio.to_thread(tok.decode, ids)) if body.echo else None
        grammar = await _compile(grammars, request_grammar(body))
        return await _run(body, ids, max_tokens, request, chat=False, echo=echo, grammar=grammar)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        tools = tool_setup(body)
        spec = request_grammar(body, tools)
        messages = prompt_messages(chat_messages(body), tools, tok.renders_tools)
        defs = list(tools.definitions) if tools is not None and tok.renders_tools else None
        ids = await asyncio.to_thread(tok.apply_chat_template, messages, defs)
        max_tokens = _limits(state, body, ids, body.max_completion_tokens or body.max_tokens)
        grammar = await _compile(grammars, spec)
        return await _run(body, ids, max_tokens, request, chat=True, grammar=grammar, tools=tools)

    async def _run(body: CommonParams, ids: list[int], max_tokens: int, request: Request, chat: bool,
                   echo: str | None = None, grammar: Grammar | None = None, tools: Tools | None = None):
        """echo: the prompt's text, when a completion request echoes it (and its logprobs, with logprobs).
        grammar: what every choice's output must match; tools: chat's, when the model may call them."""
        logprobs, bias = num_logprobs(body), logit_bias(body, tok.vocab_size)
        total = getattr(body, "best_of", None) or body.n  # completions' best_of: candidates, of which n are returned
        _admit(state, total)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, RequestEvent]] = asyncio.Queue()
        prompt_ids = tuple(ids) if echo is not None else ()
        shape = Shape(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, state.model_name, chat, total,
                      tuple(Logprobs(tok.token_bytes, chat, prompt_ids) for _ in range(total))
                      if logprobs is not None else (), echo, tools=tools)
        seed = body.seed if body.seed is not None else random.getrandbits(63)
        arrival, timeout_s = time.monotonic(), state.cfg.request_timeout_s
        ranked = 0 if logprobs is None and total > body.n else logprobs  # best_of ranks by the tokens' logprobs
        for i, request_id in enumerate(shape.engine_ids):  # choice i draws from seed + i
            sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                                      seed=(seed + i) % 2**63, logprobs=ranked,
                                      prompt_logprobs=logprobs if prompt_ids else None,
                                      presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                      logit_bias=bias)
            engine.submit(EngineRequest(request_id, ids, sampling, max_tokens,
                                        on_event=lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, ev)),
                                        stop=tuple(stop_list(body)), ignore_eos=body.ignore_eos, grammar=grammar,
                                        arrival_s=arrival,
                                        deadline_s=arrival + timeout_s if timeout_s else None))
        log.debug("submitted %s: %d prompt tokens, max_tokens %d, n %d", shape.request_id, len(ids), max_tokens,
                  body.n, extra={"completion_id": shape.request_id, "num_prompt_tokens": len(ids)})
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EngineStream(engine, events, shape, include_usage)
        done = await _collect(engine, events, request, shape)
        for evs in done:
            err = event_error(evs[-1])
            if err is not None:
                raise err
        if total == body.n:
            return shape.whole(done)
        best = sorted(done, key=_mean_logprob, reverse=True)[: body.n]
        return {**shape.whole(best), "usage": shape.usage([evs[-1] for evs in done])}  # every candidate's tokens

    return app


async def _compile(grammars: GrammarCompiler, spec: GrammarSpec | None) -> Grammar | None:
    """The request's grammar, compiled off the event loop (cached); 400 with the reason when it does not compile."""
    if spec is None:
        return None
    try:
        return await asyncio.to_thread(grammars.compile, spec)
    except GrammarError as exc:
        raise APIError(400, f"{spec.param}: {exc}", param=spec.param, code="invalid_grammar") from None


def _mean_logprob(events: list[RequestEvent]) -> float:
    """best_of's ranking: a completion's mean log-probability per token (OpenAI's)."""
    lps = [lp[0] for ev in events for lp in ev.logprobs]
    return sum(lps) / len(lps) if lps else float("-inf")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _limits(state: ServerState, body: CommonParams, prompt_ids: list[int], max_tokens: int | None) -> int:
    """Checks the request against the model and the server's limits; returns max_tokens to use."""
    check_common(body)
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    max_prompt = min(state.cfg.max_prompt_tokens or state.max_model_len, state.max_model_len - 1)
    n, room = len(prompt_ids), state.max_model_len - len(prompt_ids)
    if n > max_prompt:
        raise APIError(400, f"prompt has {n} tokens; this server takes at most {max_prompt} (the context holds "
                            f"{state.max_model_len} including at least one generated token)", param="prompt",
                       code="context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                            f"({state.max_model_len}); ask for at most {room}", param="max_tokens",
                       code="context_length_exceeded")
    most = state.engine.blocks.max_seq_tokens
    if n + 1 > most:
        raise APIError(400, f"prompt has {n} tokens; the KV cache holds at most {most} of a sequence", param="prompt")
    return max_tokens if max_tokens is not None else room


def _admit(state: ServerState, n: int = 1) -> None:
    """Bounded queue: beyond max_num_seqs running plus max_waiting_requests queued, 429 (a request of n
    choices takes n places)."""
    engine, max_waiting = state.engine, state.cfg.max_waiting_requests
    if engine.num_running + engine.num_waiting + n > engine.scheduler.cfg.max_num_seqs + max_waiting:
        engine.metrics.on_rejected("queue_full")
        raise APIError(429, f"the server is at capacity ({engine.num_waiting} requests queued, at most "
                            f"{max_waiting}); retry shortly", code="queue_full", headers={"Retry-After": "1"})


async def _collect(engine: Engine, events: asyncio.Queue, request: Request, shape: Shape) -> list[list[RequestEvent]]:
    """Each choice's events up to its last; a client that disconnects first aborts the request (its KV is freed)."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    done: list[list[RequestEvent]] = [[] for _ in range(shape.n)]
    last: dict[int, RequestEvent] = {}
    try:
        while len(last) < shape.n or any(ev.finish_reason is None for ev in last.values()):
            get = asyncio.ensure_future(events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise APIError(499, "client disconnected; request aborted", code="client_disconnected")
            i, last[i] = get.result()
            done[i].append(last[i])
    finally:
        gone.cancel()
        abort_unfinished(engine, shape, last)
    return done
