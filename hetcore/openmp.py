"""OpenMP's idle threads: how long they spin before they sleep, set before torch or Numba load OpenMP."""
from __future__ import annotations

import os

SPIN_COUNT = "1000"
"""GOMP_SPINCOUNT unless the environment sets it: ~0.1 ms of spinning, enough to bridge the gaps between one
layer's kernel calls. torch and Numba each load a libgomp with its own thread pool, and by default a pool's
idle threads spin 300,000 turns (milliseconds) after every parallel region, holding the core the other
pool's next region needs. A 1-sequence decode step on a 2-core Xeon VM under other load took a median
1,431 and 311 ms with the default and 48 ms with 1,000."""


def limit_spinning() -> None:
    """Set GOMP_SPINCOUNT (SPIN_COUNT) unless it is set: call before torch or Numba's OpenMP pool loads (libgomp
    reads it once, when it loads)."""
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
