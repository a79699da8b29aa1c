"""A request as the engine takes it (EngineRequest) and what it sends back as it runs (RequestEvent)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hetcore.backend import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class RequestEvent:
    """What a request produced since its last event."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    """None while running; then stop, length, abort, timeout or error."""
    error: str | None = None
    sim: dict | None = None
    """Simulated timing (seconds on the backend's virtual clock), when the backend reports one."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """Each of `token_ids`' logprobs when the request asked for them; none for an end-of-sequence token."""
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    """When the request asked for them (sampling.prompt_logprobs), in its first event that carries a token or
    ends it without an error: those of its prompt tokens from the second on."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    stop_reason: str | None = None
    """With finish_reason, what the client should know of why it ended, when finish_reason alone does not say
    (a grammar that max_tokens cut short); sent as the choice's `stop_reason`, as vLLM names the field."""


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    on_event: Callable[[RequestEvent], None]
    """Called on the engine thread; must not block."""
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    arrival_s: float = field(default_factory=time.monotonic)
    grammar: Any = None
    """A compiled grammar (server.grammar.Grammar) its output must match (structured outputs); None: free text."""
    deadline_s: float | None = None
    """time.monotonic() by which the request must finish; past it the engine ends it with finish_reason timeout."""
