"""Keeping the server's resident memory close to what it holds (glibc malloc; a no-op elsewhere).

glibc serves an allocation above its mmap threshold (128 KiB at start) with its own mapping, returned
to the OS on free, but raises that threshold to the size of each such block that is freed (up to 32
MiB). After the first few MB-sized arrays, the steps' working arrays (dequantized context, LSH
tables rebuilt on every merge, kernel scratch: 0.1-10 MB each, a new size almost every step) land in
malloc's heaps, and a freed one stays resident while anything allocated after it lives: at 4
sequences of 4k tokens the server held 5.8-8 GB for ~2 GB of live data. The engine (and the Ray
executor's actors) hand the free pages back at most once per TRIM_INTERVAL_S (malloc_trim). Fixing the mmap threshold at 1 MiB did
as well for memory but made that run ~30 % slower (a fresh mapping's pages fault in on every use).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time

TRIM_INTERVAL_S = 1.0

_libc: ctypes.CDLL | None | bool = None


def release_free_memory() -> bool:
    """Return the free pages inside malloc's heaps to the OS (glibc's malloc_trim); False where that
    is not glibc."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c"))
            _libc.malloc_trim  # noqa: B018 (raises AttributeError where it is not glibc)
        except (OSError, AttributeError, TypeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)
    return bool(_libc)


class Trimmer:
    """release_free_memory at most once per interval_s, and only when work was done since the last time."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S):
        self.interval_s = interval_s
        self._last_s = time.monotonic()
        self._worked = False

    def worked(self) -> None:
        self._worked = True

    def maybe_release(self) -> None:
        if self._worked and time.monotonic() - self._last_s >= self.interval_s:
            release_free_memory()
            self._last_s, self._worked = time.monotonic(), False
