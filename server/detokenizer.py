"""Incremental detokenization with stop strings.

Text is decoded over a short window of recent tokens (never the whole output each step) and a
token that ends inside a multi-byte character waits for the next one. Text that could be the
start of a stop string is held back until it is clear it is not.
"""
from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        """All text decoded so far (cut at a stop string once one is seen)."""
        self._emitted = 0
        self.is_stopped = False

    def add(self, token_id: int) -> str:
        """Add one token; returns the text that can be sent to the client now."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release()

    def _release(self) -> str:
        search_from = max(0, self._emitted - self._hold)
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.is_stopped = True
            upto = len(self.text)
        else:
            upto = max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever was held back."""
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta
