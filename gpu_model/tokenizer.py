"""Tokenizer and chat template, both taken from the model's own files."""
from __future__ import annotations

from pathlib import Path


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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """messages: [{"role", "content"}] -> prompt token ids ending with the assistant turn's opening."""
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._tok.encode(text, add_special_tokens=False)
