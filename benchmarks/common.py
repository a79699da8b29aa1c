"""Helpers shared by benchmarks: the machine's memory bandwidth, prompts of exact token counts,
a hetserve process, tables and JSON."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from numba import njit, prange

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"


@njit(parallel=True, fastmath=True, cache=True)
def _parallel_sum(a):
    s = 0.0
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def memory_read_gb_s(num_bytes: int = 2**30, repeats: int = 3) -> float:
    """Single-pass read bandwidth of a large array, every core reading its share (a Numba parallel sum,
    as the kernels read weights and KV), best of `repeats`. NumPy's one-thread sum reads ~2.5x slower on a
    2-core Xeon VM (9 against 25 GB/s)."""
    a = np.ones(num_bytes // 4, dtype=np.float32)
    _parallel_sum(a[:1024])  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _parallel_sum(a)
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best / 1e9


def times_ms(fn, repeats: int) -> list[float]:
    """fn() once to warm up, then the wall time of each of `repeats` calls, in ms."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count(),
            "python": platform.python_version(), "memory_read_gb_s": round(memory_read_gb_s(), 2)}


def token_prompts(tokenizer, lengths: list[int], text_path: Path = WIKITEXT) -> list[list[int]]:
    """Windows of real text (WikiText-2 test) of exactly the given token counts."""
    ids = tokenizer.encode(text_path.read_text()[:2_000_000])
    out, start = [], 0
    for n in lengths:
        if start + n > len(ids):
            start = 0
        out.append(ids[start:start + n])
        start += n
    return out


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("server did not become healthy")


def start_hetserve(port: int, *args: str) -> tuple[subprocess.Popen, float]:
    """Start `hetserve serve` as a user would; returns the process and seconds to a ready /health."""
    exe = Path(sys.executable).parent / "hetserve"
    proc = subprocess.Popen([str(exe), "serve", "--port", str(port), "--log-level", "warning", *args])
    try:
        return proc, wait_healthy(f"http://127.0.0.1:{port}", proc)
    except BaseException:
        proc.kill()
        raise


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def write_json(name: str, data: dict) -> Path:
    """data as JSON at `name` under benchmarks/results (or at that path, when it names a folder too)."""
    path = RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path
