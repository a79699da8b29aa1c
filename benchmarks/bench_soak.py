"""Soak: a real `hetserve serve` process under mixed load with random disconnects and bad
requests for --minutes; its RSS, KV usage and /health latency over time.

    python -m benchmarks.bench_soak [--minutes 10] [--concurrency 16] [--disconnect-frac 0.5]

Each of --concurrency clients loops: with --bad-frac probability a malformed request (expects a
4xx); otherwise a completion or chat request (random prompt of 3 to --max-prompt-words words, max_tokens 4-64,
streamed or not) which, with --disconnect-frac probability, it abandons at a random point (after
k chunks, or a client timeout of 0.1-2 s). Every --sample-s: the RSS of the server and all its
processes (with `--executor ray`, the Ray processes and actors), /metrics (running, waiting, the
fullest KV shard's usage), /health latency. At the end: seconds until every shard's KV usage is
back to 0, the RSS once idle, then SIGTERM and the exit code. Writes results/<--out>.json and results/<--out>_rss.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import textwrap
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from benchmarks.common import RESULTS, machine, start_hetserve, write_json
from benchmarks.e2e.servers import tree_rss

WORDS = ["the", "river", "light", "stone", "market", "winter", "engine", "garden", "letter", "window", "number",
         "silver", "morning", "city", "question", "paper", "music", "forest", "signal", "answer"]
BAD = [b"{not json", b'{"prompt": "\xff\xfe"}', b'{"prompt": ""}', b'{"prompt": "hi", "max_tokens": 0}',
       b'{"prompt": "hi", "temperature": 9}', b'{"messages": []}', b'{"prompt": "hi", "n": 3}',
       b'{"prompt": "hi", "model": "nope"}', b"[" * 5000]


def scrape(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def kv_usage(metrics: dict[str, float]) -> float:
    """The fullest CPU attention shard's KV usage (0-1)."""
    return max(v for k, v in metrics.items() if k.startswith("hetserve:kv_cache_usage_perc"))


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, args) -> str:
    if rng.random() < args.bad_frac:
        r = await client.post(url + "/v1/completions", content=rng.choice(BAD),
                              headers={"content-type": "application/json"})
        return "bad_4xx" if 400 <= r.status_code < 500 else f"bad_{r.status_code}"
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, args.max_prompt_words)))
    chat = rng.random() < 0.5
    body = {"max_tokens": rng.randint(4, 64), "stream": rng.random() < 0.6, "temperature": rng.choice([0, 0.8])}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    leave = rng.random() < args.disconnect_frac
    if not body["stream"]:
        try:
            r = await client.post(url + path, json=body, timeout=rng.uniform(0.1, 2) if leave else 300)
        except httpx.TimeoutException:
            return "left"
        return "ok" if r.status_code == 200 else f"status_{r.status_code}"
    leave_after = rng.randint(0, body["max_tokens"]) if leave else None
    chunks = 0
    async with client.stream("POST", url + path, json=body, timeout=300) as r:
        if r.status_code != 200:
            return f"status_{r.status_code}"
        async for line in r.aiter_lines():
            if leave_after is not None and chunks >= leave_after:
                return "left"
            if line.startswith("data: {"):
                if '"error"' in line:
                    return "stream_error"
                chunks += 1
    return "ok"


async def client_loop(client: httpx.AsyncClient, url: str, seed: int, end: float, outcomes: Counter, args) -> None:
    rng = random.Random(seed)
    while time.monotonic() < end:
        try:
            outcomes[await one_request(client, url, rng, args)] += 1
        except httpx.HTTPError as exc:
            outcomes[f"client_{type(exc).__name__}"] += 1


async def sampler(url: str, pid: int, t0: float, end: float, outcomes: Counter, samples: list, every_s: float) -> None:
    server = psutil.Process(pid)
    async with httpx.AsyncClient(timeout=10) as client:  # its own connection: never queued behind the load
        while True:
            h0 = time.perf_counter()
            health = await client.get(url + "/health")
            health_s = time.perf_counter() - h0
            m = scrape((await client.get(url + "/metrics")).text)
            samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mib": round(tree_rss(server) / 2**20, 1),
                            "health_s": round(health_s, 4), "health_status": health.status_code,
                            "running": m["hetserve:num_requests_running"],
                            "waiting": m["hetserve:num_requests_waiting"],
                            "kv_usage": kv_usage(m),
                            "requests": sum(outcomes.values())})
            print(f"{samples[-1]['t_s']:7.1f}s rss {samples[-1]['rss_mib']:8.1f} MiB  kv {samples[-1]['kv_usage']:.3f}"
                  f"  running {samples[-1]['running']:3.0f}  requests {samples[-1]['requests']}", flush=True)
            if time.monotonic() >= end:
                return
            await asyncio.sleep(every_s)


async def soak(url: str, pid: int, args) -> tuple[Counter, list[dict]]:
    outcomes: Counter = Counter()
    samples: list[dict] = []
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    # one client made up front: building an SSL context per client stalls this process's loop for ~50 ms each
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.gather(sampler(url, pid, t0, end, outcomes, samples, args.sample_s),
                             *(client_loop(client, url, 1000 + i, end, outcomes, args) for i in range(args.concurrency)))
    return outcomes, samples


def plot(samples: list[dict], path: Path, server_args: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    minutes = [s["t_s"] / 60 for s in samples]
    ax.plot(minutes, [s["rss_mib"] for s in samples], label="server RSS, all its processes (MiB)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax2 = ax.twinx()
    ax2.plot(minutes, [s["requests"] for s in samples], color="gray", linestyle="--", label="requests sent")
    ax2.set_ylabel("requests sent (cumulative)")
    title = "hetserve soak: RSS under load with random disconnects\n" + textwrap.fill(server_args, 110)
    ax.set_title(title, fontsize=8)
    ax.legend(ax.get_lines() + ax2.get_lines(), [line.get_label() for line in ax.get_lines() + ax2.get_lines()],
              loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect-frac", type=float, default=0.5)
    p.add_argument("--bad-frac", type=float, default=0.1)
    p.add_argument("--sample-s", type=float, default=5)
    p.add_argument("--max-prompt-words", type=int, default=300, help="prompts of 3 to this many words (a token each)")
    p.add_argument("--server-args", default="--kv-cache-bytes 256MiB --max-num-seqs 32 --request-timeout-s 120",
                   help="extra `hetserve serve` arguments")
    p.add_argument("--out", default="soak", help="results/<out>.json and results/<out>_rss.png")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc, ready_s = start_hetserve(port, *args.server_args.split())
    try:
        outcomes, samples = asyncio.run(soak(url, proc.pid, args))
        t_end = time.monotonic()
        while kv_usage(scrape(httpx.get(url + "/metrics").text)) > 0:
            time.sleep(0.1)
        kv_zero_after_s = time.monotonic() - t_end
        time.sleep(args.sample_s)  # a step's worth for the workers to drop the last sequences' state
        rss_drained = tree_rss(psutil.Process(proc.pid)) / 2**20
        metrics_end = scrape(httpx.get(url + "/metrics").text)
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    rss = [s["rss_mib"] for s in samples]
    after_1min = [s["rss_mib"] for s in samples if s["t_s"] >= 60] or rss
    summary = {"minutes": args.minutes, "concurrency": args.concurrency, "disconnect_frac": args.disconnect_frac,
               "max_prompt_words": args.max_prompt_words,
               "bad_frac": args.bad_frac, "server_args": args.server_args, "server_ready_s": round(ready_s, 1),
               "rss_start_mib": rss[0], "rss_at_1min_mib": after_1min[0], "rss_end_mib": rss[-1],
               "rss_max_mib": max(rss), "rss_growth_after_1min_mib": round(rss[-1] - after_1min[0], 1),
               "rss_drained_mib": round(rss_drained, 1),
               "health_max_s": max(s["health_s"] for s in samples),
               "health_non_200": sum(s["health_status"] != 200 for s in samples),
               "outcomes": dict(outcomes), "kv_zero_after_s": round(kv_zero_after_s, 2),
               "requests_finished_by_reason": {k.split('"')[1]: v for k, v in metrics_end.items()
                                               if k.startswith("hetserve:request_success_total")},
               "num_preemptions": metrics_end["hetserve:num_preemptions_total"], "sigterm_exit_code": exit_code}
    print(json.dumps(summary, indent=1))
    path = write_json(f"{args.out}.json", {**summary, "machine": machine(), "samples": samples})
    plot(samples, RESULTS / f"{args.out}_rss.png", args.server_args)
    print(f"wrote {path} and {RESULTS / f'{args.out}_rss.png'}")


if __name__ == "__main__":
    main()
