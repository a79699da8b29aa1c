"""Scoring text through the HTTP API (completions with echo, logprobs and max_tokens 0, as
lm-evaluation-harness' loglikelihood requests): perplexity and top-1 agreement of each KV format
against fp32 KV on the same windows, and the time it takes against plain prefill of the same
prompts (max_tokens 1, no echo) on the same server: the cost of a full-vocabulary log-softmax at
every prompt row.

    python -m benchmarks.bench_scoring --formats fp32,fp16,oaken --windows 8 --window-tokens 1024

Prompts longer than --max-num-batched-tokens (512) prefill in chunks; a later chunk reads the
earlier ones' K/V through the store, so the quantized formats' numbers reflect their stores.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.bench_loadgen import free_port
from benchmarks.common import WIKITEXT, machine, print_table, start_hetserve, write_json


def post_all(url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """Each body's first choice and the wall seconds to get them all."""
    def one(body: dict) -> dict:
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, bodies))
    return out, time.perf_counter() - t0


def run_format(fmt: str, windows: list[list[int]], args) -> dict:
    port = free_port()
    # no prefix cache: each round prefills its windows again
    proc, ready_s = start_hetserve(port, "--kv-format", fmt, "--cpu-linear-dtype", "float32", "--prefix-caching", "off",
                                   "--kv-cache-bytes", args.kv_cache_bytes, *args.server_args.split())
    url = f"http://127.0.0.1:{port}"
    prefill = [{"prompt": w, "max_tokens": 1, "temperature": 0} for w in windows]
    scoring = [{"prompt": w, "max_tokens": 0, "echo": True, "logprobs": 1} for w in windows]
    try:
        post_all(url, prefill[:1] + scoring[:1], 1)  # warm-up: both paths once
        prefill_s, scoring_s = [], []
        for _ in range(args.rounds):  # alternated; the best of each
            prefill_s.append(post_all(url, prefill, args.concurrency)[1])
            scored, seconds = post_all(url, scoring, args.concurrency)
            scoring_s.append(seconds)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lps = [c["logprobs"] for c in scored]
    values = [x for lp in lps for x in lp["token_logprobs"][1:]]
    return {"kv_format": fmt, "server_ready_s": round(ready_s, 1), "tokens_scored": len(values),
            "ppl": math.exp(-sum(values) / len(values)), "scoring_s": min(scoring_s), "prefill_s": min(prefill_s),
            "scoring_vs_prefill": min(scoring_s) / min(prefill_s), "rounds_scoring_s": scoring_s,
            "rounds_prefill_s": prefill_s,
            "top1": [max(top, key=top.get) for lp in lps for top in lp["top_logprobs"][1:]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="fp32,fp16,oaken", help="KV formats; the first is the reference")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-tokens", type=int, default=1024)
    p.add_argument("--text", type=Path, default=WIKITEXT)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds of each path, alternated")
    p.add_argument("--kv-cache-bytes", default="1GiB")
    p.add_argument("--server-args", default="", help="more `hetserve serve` options, one string")
    p.add_argument("--out", default="scoring.json")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from gpu_model.loader import resolve_model_dir
    from server.config import ServeConfig

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(ServeConfig().model))
    ids = tok.encode(args.text.read_text()[:2_000_000])
    windows = [ids[i * args.window_tokens:(i + 1) * args.window_tokens] for i in range(args.windows)]
    rows = []
    for fmt in args.formats.split(","):
        print(f"{fmt}: {args.windows} windows of {args.window_tokens} tokens ...", flush=True)
        rows.append(run_format(fmt, windows, args))
    ref = rows[0]
    for r in rows:
        r["ppl_vs_ref_pct"] = 100 * (r["ppl"] / ref["ppl"] - 1)
        r["top1_agreement"] = sum(a == b for a, b in zip(r["top1"], ref["top1"])) / len(ref["top1"])
    print_table(rows, ["kv_format", "tokens_scored", "ppl", "ppl_vs_ref_pct", "top1_agreement", "scoring_s",
                       "prefill_s", "scoring_vs_prefill"])
    path = write_json(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                 "rows": [{k: v for k, v in r.items() if k != "top1"} for r in rows]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
