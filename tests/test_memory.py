"""server.memory: a freed MB-sized array that glibc kept in its heap (its dynamic mmap threshold had
risen past it) goes back to the OS on release_free_memory."""
from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

PROBE = """
import sys
import numpy as np
from server.memory import release_free_memory

def rss_kb():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])

big = np.ones(8 << 20, np.uint8)
del big                                   # glibc's dynamic threshold now rises to 8 MB
work = np.ones(6 << 20, np.uint8)         # a step's working array: in the heap now
keep = np.ones(1000, np.uint8)            # something small allocated after it, still alive
before = rss_kb()
del work
kept = rss_kb()
assert release_free_memory()
print(before - kept, before - rss_kb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or "libc.so" not in (ctypes.util.find_library("c") or ""),
                    reason="glibc only")
def test_release_free_memory_returns_freed_heap_pages():
    freed_by_free, freed_by_trim = map(int, subprocess.run([sys.executable, "-c", PROBE], capture_output=True,
                                                           text=True, check=True).stdout.split())
    assert freed_by_free < 1000  # kB: the heap kept the 6 MB array's pages (what the trim is for)
    assert freed_by_trim > 5000  # and malloc_trim gave them back


def test_trimmer_releases_only_after_work_and_at_most_once_per_interval(monkeypatch):
    from server import memory

    calls = []
    monkeypatch.setattr(memory, "release_free_memory", lambda: calls.append(1))
    trimmer = memory.Trimmer(interval_s=0.0)
    trimmer.maybe_release()
    assert calls == []  # nothing was done since it was made
    trimmer.worked()
    trimmer.maybe_release()
    trimmer.maybe_release()
    assert calls == [1]
    slow = memory.Trimmer(interval_s=3600.0)
    slow.worked()
    slow.maybe_release()
    assert calls == [1]  # not before its interval
