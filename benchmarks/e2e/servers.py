"""The compared server configurations; start one on a free port, wait for /health, sample the peak
RSS of its process tree while it serves, stop it."""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.common import wait_healthy

SMOLLM2 = argparse.Namespace(num_layers=30, num_kv_heads=3, head_dim=64)
"""SmolLM2-135M's KV shape."""


def kv_cache_bytes(args: tuple[str, ...], concurrency: int, context_tokens: int) -> int:
    """hetserve's --kv-cache-bytes for `concurrency` sequences of `context_tokens` at SmolLM2's shape: what
    fp16 KV needs plus 25 %, or more where the configuration's KV format and MagicPIG's state need it.
    Untouched capacity costs no memory (the stores' pages are zero until written)."""
    from server.config import add_arguments, from_args
    from server.hetero import kv_capacity_for

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = from_args(parser.parse_args(list(args)))
    need = [kv_capacity_for(SMOLLM2, fmt, cfg.block_size, concurrency, context_tokens, lsh, recent_blocks=concurrency)
            for fmt, lsh in (("fp16", None), (cfg.kv_format, cfg.lsh_config()))]
    actors = cfg.ray_cpu_actors if cfg.executor == "ray" else 1  # each actor's share may have to hold every sequence
    return int(max(1.25 * need[0], actors * need[1]))


@dataclass(frozen=True)
class ServerConfig:
    name: str
    """Row label in the table."""
    kind: str
    """hetserve, llama (llama-server) or hf (transformers generate, in its own process)."""
    args: tuple[str, ...] = ()
    """Extra command-line arguments for this configuration."""
    label: str = ""
    """One line for the README: what this configuration is."""


CONFIGS = {c.name: c for c in (
    ServerConfig("hetserve-default", "hetserve", (), "hetserve as `make serve` starts it (local executor, defaults)"),
    ServerConfig("hetserve-x8", "hetserve", ("--activation-bits", "8"),
                 "hetserve as `make serve` starts it, with 8-bit activations (--activation-bits 8)"),
    ServerConfig("hetserve-ray", "hetserve", ("--executor", "ray"),
                 "hetserve, defaults, Ray executor (one actor holds the model and the KV)"),
    ServerConfig("hetserve-ray-actors", "hetserve", ("--executor", "ray", "--ray-cpu-actors", "1"),
                 "hetserve, defaults, Ray executor with a CPU attention actor (a TCP round trip a layer)"),
    ServerConfig("hetserve-fp16", "hetserve", ("--kv-format", "fp16"), "hetserve local, fp16 KV, exact attention"),
    ServerConfig("hetserve-oaken", "hetserve", ("--kv-format", "oaken"), "hetserve local, Oaken KV, exact attention"),
    ServerConfig("hetserve-oaken-magicpig", "hetserve",
                 ("--kv-format", "oaken", "--attention", "magicpig", "--lsh-retrieval", "head", "--lsh-l", "150",
                  "--lsh-min-collisions", "2"),
                 "hetserve local, Oaken KV, MagicPIG sampled attention as the paper (per-head retrieval, K 10, L 150)"),
    ServerConfig("hetserve-oaken-magicpig-group", "hetserve",
                 ("--kv-format", "oaken", "--attention", "magicpig", "--lsh-retrieval", "group", "--lsh-l", "200",
                  "--lsh-min-collisions", "2"),
                 "hetserve local, Oaken KV, MagicPIG with one retrieval per GQA group (K 10, L 200, >= 2 collisions)"),
    ServerConfig("hetserve-oaken-magicpig-m3", "hetserve", ("--kv-format", "oaken", "--attention", "magicpig"),
                 "hetserve local, Oaken KV, MagicPIG as served by default (group retrieval, K 10, L 300, >= 3 collisions)"),
    ServerConfig("hetserve-oaken-magicpig-ray", "hetserve",
                 ("--kv-format", "oaken", "--attention", "magicpig", "--executor", "ray"),
                 "hetserve Ray executor (2 CPU attention actors), Oaken KV, MagicPIG"),
    ServerConfig("llama-f16", "llama", ("--cache-type-k", "f16", "--cache-type-v", "f16"),
                 "llama-server, f16 KV, flash attention"),
    ServerConfig("llama-f16-fa-off", "llama", ("--cache-type-k", "f16", "--cache-type-v", "f16", "-fa", "off"),
                 "llama-server, f16 KV, flash attention off (the later -fa wins)"),
    ServerConfig("llama-q8_0", "llama", ("--cache-type-k", "q8_0", "--cache-type-v", "q8_0"),
                 "llama-server, q8_0 KV, flash attention"),
    ServerConfig("hf", "hf", (), "HF transformers generate, fp32, one left-padded batch of `concurrency`"),
)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(cfg: ServerConfig, port: int, concurrency: int, context_tokens: int, gguf: Path,
            llama_server: Path | None, threads: int) -> list[str]:
    """The server's command line for `concurrency` sequences of up to `context_tokens` each."""
    if cfg.kind == "hetserve":
        kv_bytes = kv_cache_bytes(cfg.args, concurrency, context_tokens)
        return [str(Path(sys.executable).parent / "hetserve"), "serve", "--port", str(port), "--log-level", "warning",
                "--max-num-seqs", str(concurrency), "--kv-cache-bytes", str(kv_bytes),
                "--max-model-len", str(context_tokens), *cfg.args]
    assert cfg.kind == "llama" and llama_server is not None
    # -np slots of -c / -np tokens each (no unified KV with an explicit -np); no host-RAM prompt cache (-cram 0):
    # every prompt is new, so it would only add RSS
    return [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(concurrency), "-c", str(concurrency * context_tokens), "-fa", "on",
            "-t", str(threads), "-tb", str(threads), "-cram", "0", "--no-webui", *cfg.args]


def tree_rss(proc: psutil.Process) -> int:
    """The summed RSS of a process and all its descendants (with `--executor ray`, its Ray processes and actors)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # a child exited between listing and reading
            pass
    return total


class PeakRss:
    """Samples the summed RSS of a process and all its descendants every `interval_s` in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        self._proc = psutil.Process(pid)
        self._interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_bytes = max(self.peak_bytes, tree_rss(self._proc))
            except psutil.Error:
                return
            self._stop.wait(self._interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


@dataclass
class Running:
    proc: subprocess.Popen
    url: str
    ready_s: float
    rss: PeakRss
    log_path: Path
    cmd: list[str] = field(default_factory=list)

    def stop(self) -> int:
        """Stops the server; returns the peak RSS in bytes."""
        peak = self.rss.stop()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return peak


def start(cmd: list[str], log_path: Path, timeout_s: float = 900) -> Running:
    port = int(cmd[cmd.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        # own session: terminate() reaches the server, and Ray's children are cleaned by the server itself
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        ready_s = wait_healthy(url, proc, timeout_s)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return Running(proc, url, ready_s, PeakRss(proc.pid), log_path, cmd)


_STEP_SUM = re.compile(r'^hetserve:step_time_seconds_(sum|count)\{part="(\w+)"\} (\S+)$', re.MULTILINE)


def step_totals(url: str) -> dict[str, float]:
    """hetserve's cumulative engine step time by part from /metrics: {'accelerator_s': .., 'steps': ..}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for kind, part, value in _STEP_SUM.findall(text):
        if kind == "sum":
            out[f"{part}_s"] = float(value)
        elif part == "step":
            out["num_steps"] = float(value)
    return out


def wait_quiet(max_load: float = 3.0, timeout_s: float = 60) -> float:
    """Wait (up to timeout_s) for the 1-min load average to drop below max_load; returns it (noise note)."""
    t0 = time.monotonic()
    while os.getloadavg()[0] > max_load and time.monotonic() - t0 < timeout_s:
        time.sleep(5)
    return os.getloadavg()[0]
