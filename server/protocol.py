"""OpenAI-compatible request bodies, their validation, and the error shape.

Types are checked by pydantic (422 on a malformed body); values by `check_*` (400 with the
parameter named). Known OpenAI parameters hetserve does not implement are refused with 400
when set to anything but their neutral value, never silently ignored.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

_TYPES = {401: "authentication_error", 404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    """A request that ends in an HTTP error; server/ turns it into OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def render(self) -> bytes:
        """The body as ASCII JSON: safe whatever the message quotes back from the request."""
        return json.dumps(self.body()).encode()


class StreamOptions(BaseModel):
    include_usage: bool = False


def _check_unicode(value: Any, depth: int = 0) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer or UTF-8 encoder takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("strings must be valid Unicode (a lone surrogate escape such as \\ud800 is not)") from None
    elif isinstance(value, dict) and depth < 8:
        for k, v in value.items():
            _check_unicode(k, depth + 1)
            _check_unicode(v, depth + 1)
    elif isinstance(value, list) and depth < 8:
        for v in value:
            _check_unicode(v, depth + 1)


class CommonParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    """Structured outputs (server.structured): {"type": "text" | "json_object" | "json_schema", ...}."""
    guided_json: dict[str, Any] | str | None = None
    """vLLM's: a JSON schema (or its text) the output must match."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """vLLM's: a grammar in Lark or GBNF (llama.cpp's) syntax."""


class CompletionRequest(CommonParams):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None  # known but unimplemented: accepted only at its neutral value (_NEUTRAL)


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant message's earlier tool calls."""
    tool_call_id: str | None = None
    """A tool message's: the call it answers."""
    name: str | None = None


class ChatCompletionRequest(CommonParams):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


MAX_STOP_STRINGS = 8
MAX_LOGPROBS = 20
MAX_CHOICES = 16
MAX_LOGIT_BIAS = 300
MAX_STOP_CHARS = 256
_NEUTRAL = {"suffix": None}
ROLES = ("system", "user", "assistant", "developer", "tool")


def check_common(req: CommonParams) -> None:
    if req.model_extra:
        name = sorted(req.model_extra)[0]
        raise APIError(400, f"unsupported parameter {name!r}", param=name, code="unsupported_parameter")
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name, neutral)
        if value != neutral:
            raise APIError(400, f"parameter {name!r} is not supported (leave it at {neutral!r})", param=name,
                           code="unsupported_parameter")
    if not 0.0 <= req.temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {req.temperature}", param="temperature")
    if not 0.0 < req.top_p <= 1.0:
        raise APIError(400, f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(req, name) <= 2.0:
            raise APIError(400, f"{name} must be in [-2, 2], got {getattr(req, name)}", param=name)
    if not 1 <= req.n <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {req.n}", param="n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and not req.n <= best_of <= MAX_CHOICES:
        raise APIError(400, f"best_of must be in [n, {MAX_CHOICES}] (n is {req.n}), got {best_of}", param="best_of")
    if best_of is not None and best_of > req.n and req.stream:
        raise APIError(400, "best_of > n cannot be streamed (the best are known at the end)", param="best_of")
    if req.top_k < -1:
        raise APIError(400, f"top_k must be -1 (off), 0 (off) or positive, got {req.top_k}", param="top_k")
    if req.max_tokens is not None and req.max_tokens < (0 if getattr(req, "echo", False) else 1):
        raise APIError(400, f"max_tokens must be at least 1 (0 only with echo), got {req.max_tokens}",
                       param="max_tokens")
    stops = stop_list(req)
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
                       param="stop")
    num_logprobs(req)


def num_logprobs(req: CommonParams) -> int | None:
    """How many most likely tokens to return beside each sampled token's logprob; None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        name, n = "top_logprobs", (req.top_logprobs or 0) if req.logprobs else None
    else:
        name, n = "logprobs", getattr(req, "logprobs", None)
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise APIError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {n}", param=name)
    return n


def logit_bias(req: CommonParams, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs: keys token ids in the vocabulary, values in [-100, 100]."""
    pairs = []
    for key, bias in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                           param="logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {bias} for {key}", param="logit_bias")
        pairs.append((int(key), float(bias)))
    if len(pairs) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    return tuple(pairs)


def stop_list(req: CommonParams) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Validated messages as plain {role, content} dicts for the chat template."""
    if req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        if req.max_completion_tokens < 1:
            raise APIError(400, "max_completion_tokens must be at least 1", param="max_completion_tokens")
    if not req.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise APIError(400, f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}", param=f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
            content = "".join(part["text"] for part in content)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "send one prompt per request (batched prompts are not supported)", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompt

