"""Async streaming client for OpenAI-compatible /v1/completions and /v1/chat/completions.

Timing follows vLLM's `bench serve` client: the clock starts just before the request is sent; every
SSE chunk is stamped as soon as its line is read, before it is parsed. A chunk counts as output when it
carries non-empty text (completions `text`, chat `delta.content`); role-only, finish-only and usage chunks
are not output (vLLM's chat client would take a leading role chunk as the first token).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

APIS = ("completions", "chat")


@dataclass(frozen=True)
class Endpoint:
    """Where and how requests are sent."""

    base_url: str  # e.g. http://127.0.0.1:8000 (the /v1/... path is added)
    api: str = "completions"  # completions or chat
    model: str | None = None  # the `model` field; None leaves it out
    api_key: str | None = None  # sent as a Bearer token
    timeout_s: float = 3600.0  # per request, whole stream
    is_ignore_eos: bool = True  # send ignore_eos so exactly max_tokens come out (vLLM, hetserve, llama.cpp)
    temperature: float = 0.0

    def __post_init__(self):
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must start with http:// or https://, got {self.base_url!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout_s}")

    @property
    def url(self) -> str:
        root = self.base_url.rstrip("/")
        root = root.removesuffix("/v1")
        return root + ("/v1/completions" if self.api == "completions" else "/v1/chat/completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: when, what, and how many output tokens to force."""

    index: int
    arrival_s: float  # scheduled send time, s after the run's start
    prompt: str
    num_prompt_tokens: int  # as the target tokenizer counts it (see loadgen/prompts.py)
    num_output_tokens: int  # sent as max_tokens (with ignore_eos)


@dataclass(frozen=True)
class RequestRecord:
    """What one request did. Times in s; `*_at_s` are offsets from the run's start."""

    index: int
    arrival_s: float  # scheduled
    send_at_s: float  # when it was sent (later than arrival_s if the client lagged or a concurrency cap held it)
    ttft_s: float  # first output chunk - send; 0 when it failed before one
    itl_s: tuple[float, ...]  # gaps between consecutive output chunks
    e2e_s: float  # last output chunk - send (vLLM's latency)
    done_at_s: float  # when the response ended (or failed)
    num_prompt_tokens: int
    num_expected_output_tokens: int  # max_tokens asked for
    num_output_tokens: int  # usage.completion_tokens, or the tokenizer's count of the text when absent
    server_prompt_tokens: int  # usage.prompt_tokens, -1 when the server sent no usage
    is_success: bool
    error_kind: str = ""  # http_<status>, timeout, connection, stream_error, bad_response, no_output
    error: str = ""
    server_cached_tokens: int = -1  # usage.prompt_tokens_details.cached_tokens (prefix cache), -1 when not sent

    @property
    def tpot_s(self) -> float:
        """(e2e - ttft) / (output tokens - 1); 0 for one-token outputs (vLLM counts these as 0 for goodput)."""
        n = self.num_output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if self.is_success and n > 1 else 0.0


def request_body(ep: Endpoint, spec: RequestSpec) -> dict:
    body: dict = {"max_tokens": spec.num_output_tokens, "temperature": ep.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if ep.api == "completions":
        body["prompt"] = spec.prompt
    else:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    if ep.model:
        body["model"] = ep.model
    if ep.is_ignore_eos:
        body["ignore_eos"] = True
    return body


@dataclass
class _Stream:
    """Mutable state while one response streams in (perf_counter stamps)."""

    first: float = 0.0
    last: float = 0.0
    completion_tokens: int = -1
    prompt_tokens: int = -1
    cached_tokens: int = -1


def _take_chunk(st: _Stream, obj: dict, now: float, is_chat: bool, itl: list[float], text: list[str]) -> None:
    choices = obj.get("choices")
    if choices:
        c = choices[0]
        piece = (c.get("delta") or {}).get("content") if is_chat else c.get("text")
        if piece:
            if st.first == 0.0:
                st.first = now
            else:
                itl.append(now - st.last)
            st.last = now
            text.append(piece)
    usage = obj.get("usage")
    if usage:
        st.completion_tokens = int(usage.get("completion_tokens", -1))
        st.prompt_tokens = int(usage.get("prompt_tokens", -1))
        st.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", -1))


_DONE = ("", "")


def _take_line(raw: bytes, st: _Stream, now: float, is_chat: bool, itl: list[float],
               text: list[str]) -> tuple[str, str] | None:
    """Handle one SSE line; returns (error kind, message) when the stream is over, else None."""
    line = raw.strip()
    if not line.startswith(b"data:"):
        return None  # blank separators, SSE comments (pings), event: lines
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return _DONE
    obj = json.loads(payload)
    if "error" in obj:
        return "stream_error", str(obj["error"])[:300]
    _take_chunk(st, obj, now, is_chat, itl, text)
    return None


async def _read_events(resp: aiohttp.ClientResponse, st: _Stream, is_chat: bool, itl: list[float],
                       text: list[str]) -> tuple[str, str]:
    """Read the SSE body as it arrives. Everything in one read gets one stamp: it reached the client
    together (reading whole buffers, not line by line, keeps the client's cost per token low)."""
    tail = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        lines = (tail + data).split(b"\n")
        tail = lines.pop()  # a partial line, completed by the next read
        for raw in lines:
            end = _take_line(raw, st, now, is_chat, itl, text)
            if end is not None:
                return end
    end = _take_line(tail, st, time.perf_counter(), is_chat, itl, text) if tail.strip() else None
    return end or _DONE


async def send(session: aiohttp.ClientSession, ep: Endpoint, spec: RequestSpec, run_t0: float,
               count_output=None) -> RequestRecord:
    """Send one streaming request and time it. `count_output(text) -> int` counts output tokens when
    the server sends no usage (else the number of output chunks is used). Never raises for HTTP trouble."""
    st, itl, text = _Stream(), [], []
    kind, msg = "", ""
    t_send = time.perf_counter()
    try:
        headers = {**ep.headers(), "X-Request-Id": f"loadgen-{spec.index}"}  # for server logs
        async with session.post(ep.url, json=request_body(ep, spec), headers=headers) as resp:
            if resp.status != 200:
                kind, msg = f"http_{resp.status}", (await resp.text())[:300]
            else:
                kind, msg = await _read_events(resp, st, ep.api == "chat", itl, text)
    except asyncio.TimeoutError:
        kind, msg = "timeout", f"no complete response in {ep.timeout_s:g} s"
    except aiohttp.ClientError as exc:
        kind, msg = "connection", f"{type(exc).__name__}: {exc}"[:300]
    except (ValueError, TypeError, AttributeError) as exc:  # JSON that is not an OpenAI chunk
        kind, msg = "bad_response", f"{type(exc).__name__}: {exc}"[:300]
    t_end = time.perf_counter()
    if not kind and st.first == 0.0:
        kind, msg = "no_output", "the stream ended without an output chunk"
    ok = not kind
    n_out = st.completion_tokens
    if n_out < 0:
        n_out = (count_output("".join(text)) if count_output else len(itl) + 1) if ok else 0
    return RequestRecord(spec.index, spec.arrival_s, t_send - run_t0, st.first - t_send if ok else 0.0,
                         tuple(itl) if ok else (), st.last - t_send if ok else 0.0, t_end - run_t0,
                         spec.num_prompt_tokens, spec.num_output_tokens, n_out if ok else 0, st.prompt_tokens, ok,
                         kind, msg, st.cached_tokens)
