"""Tokenizer and chat template, both taken from the model's own files."""
from __future__ import annotations

import re
from pathlib import Path


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) characters for bytes: printable ones stand for themselves, the other
    68 bytes for chr(256), chr(257), ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    for i, b in enumerate(b for b in range(256) if b not in table.values()):
        table[chr(256 + i)] = b
    return table


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class Tokenizer:
    def __init__(self, model_dir: Path, eos_token_ids: tuple[int, ...]):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        ids = set(eos_token_ids)
        if self._tok.eos_token_id is not None:
            ids.add(self._tok.eos_token_id)
        self.eos_token_ids = frozenset(ids)
        self.vocab_size = len(self._tok)
        self.has_chat_template = bool(self._tok.chat_template)
        decoder = getattr(getattr(self._tok, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character, for some); special tokens as written."""
        piece = self._tok.convert_ids_to_tokens(token_id)
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m[1], 16)])
        return piece.replace("\u2581", " ").encode()

    @property
    def hf(self):
        """The Hugging Face tokenizer itself (for a grammar engine's view of the vocabulary)."""
        return self._tok

    @property
    def renders_tools(self) -> bool:
        """The chat template lays out a request's tools itself (it reads its `tools` variable)."""
        return "tools" in (self._tok.chat_template or "")

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """messages: [{"role", "content"}] -> prompt token ids ending with the assistant turn's opening.
        tools: OpenAI's function definitions, for a template that renders them."""
        text = self._tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return self._tok.encode(text, add_special_tokens=False)
