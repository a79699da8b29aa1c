"""POST /tokenize and POST /detokenize, in vLLM's shapes: the served model's tokenizer and chat template
without generating anything (clients count tokens, check a prompt's length, or build token prompts)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from server.protocol import APIError, ChatMessage

if TYPE_CHECKING:
    from server.api import ServerState


class TokenizeRequest(BaseModel):
    """A prompt (as completions take it) or messages (as chat takes them); not both."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt (as completions encode it), false for messages (the template has them)."""
    add_generation_prompt: bool = True
    """Messages: end with the assistant turn's opening, as chat completions do."""
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def _tokenize(tok, body: TokenizeRequest) -> list[int]:
    hf = tok.hf
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give prompt or messages", param="prompt")
    if body.prompt is not None:
        return hf.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                 "".join(p.get("text", "") for p in m.content or ())} for m in body.messages or ()]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt)
    return hf.encode(text, add_special_tokens=bool(body.add_special_tokens))


def install_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    tok = state.engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(state, body.model)
        ids = await asyncio.to_thread(_tokenize, tok, body)
        strs = [tok.token_bytes(t).decode("utf-8", errors="replace") for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(state, body.model)
        if any(not 0 <= t < tok.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {tok.vocab_size})", param="tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}
