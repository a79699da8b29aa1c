"""OpenMP's idle threads: how long they spin before they sleep, set before torch or Numba load OpenMP."""
from __future__ import annotations

import os

SPIN_COUNT = "10000"
"""GOMP_SPINCOUNT unless the environment sets it: enough spinning to bridge the gaps between one layer's
kernel calls. torch and Numba each load a libgomp with its own thread pool, and by default a pool's idle
threads spin 300,000 turns (milliseconds) after every parallel region, holding the core the other pool's
next region needs. Decode steps at 256 tokens of context on a 2-core Xeon VM, p50 ms at 1 / 8 sequences,
quiet: 19.4 / 56.3 with 300,000, 16.8 / 53.7 with 10,000, 16.7 / 62.0 with 1,000, 26.2 / 81.0 with 0;
under other load (load average 3-7) 311-1,643 ms at 1 sequence with 300,000, 24-49 with 1,000-10,000."""


def limit_spinning() -> None:
    """Set GOMP_SPINCOUNT (SPIN_COUNT) unless it is set: call before torch or Numba's OpenMP pool loads (libgomp
    reads it once, when it loads)."""
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
