"""Layered KV sparsity against the full cache under one fixed KV capacity, through HTTP.

    PYTHONPATH=. python -m benchmarks.bench_kv_policy [--prompt-tokens 1024] [--output-tokens 64] \
        [--kv-format oaken] [--full-seqs 2] [--num-requests 8] [--rate 0.5] [--layered-args "--kv-budget-tokens 128"]

PPIO's shape (long prompts, long outputs, arrivals at a fixed rate) scaled to this model and machine:
`--num-requests` requests of exactly `--prompt-tokens` + `--output-tokens` tokens are sent by
`hetserve loadgen synth` (Poisson arrivals at `--rate` requests/s, streamed, greedy, ignore_eos) to
a `hetserve serve` whose --kv-cache-bytes holds `--full-seqs` such sequences with every layer's KV
in `--kv-format` (fp16, or oaken with its full-precision tails). The same run is made with
--kv-policy full and with --kv-policy layered (`--layered-args` give its budget), `--repeats` times
each, alternated (on 2 cores one policy's runs vary by up to a third). Chunked prefill is on
(--max-num-batched-tokens); prefix caching is on, though prompts share no blocks. Reports, of each
policy's median run, the peak of concurrently running sequences (/metrics, polled), output tok/s,
TTFT p50/p99 and TPOT, and every run's tok/s. Prints a table, writes JSON and a PNG.

    PYTHONPATH=. python -m benchmarks.bench_kv_policy --attention-only [--kv-format oaken] [--shapes 8x4000x750]

times instead one decode step of the attention worker alone, all 30 layers, B sequences at a context of
C tokens, a full cache against a layered one whose 29 sparse layers hold about K rows, each sequence
evicting in turn (random K/V; no model): what a step reads less, and what its bookkeeping costs.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.bench_loadgen import free_port
from benchmarks.common import machine, print_table, start_hetserve, write_json

GEOMETRY = (30, 3, 64, 16)  # SmolLM2-135M: layers, kv-heads, head_dim; blocks of 16 tokens


def capacity_bytes(kv_format: str, tokens: int, full_seqs: int, max_num_seqs: int) -> int:
    """KV bytes that hold `full_seqs` sequences of `tokens` tokens with every layer's KV in `kv_format` (for oaken,
    beside the server's default tails: one block per layer for each of max_num_seqs sequences)."""
    from cpu_attn.kv_store import OakenKVStore, bytes_per_block

    blocks = -(-tokens // GEOMETRY[3])
    tails = OakenKVStore.tail_bytes(*GEOMETRY, max_num_seqs) if kv_format == "oaken" else 0
    return full_seqs * blocks * bytes_per_block(kv_format, *GEOMETRY) + tails


POLL_S = 1.0
"""Seconds between /metrics polls. Each poll costs CPU in this process: on a 2-core machine, a poll every 0.2 s with
a new client each time made a layered run ~40 % slower (105 -> 145 s; a parallel kernel waits for a thread that
the poll took the core of)."""


def watch_running(url: str, stop: threading.Event, peaks: dict) -> None:
    """Poll /metrics until `stop`: the most requests running, and group usage at that moment."""
    with httpx.Client(base_url=url, timeout=5) as client:
        while not stop.wait(POLL_S):
            try:
                text = client.get("/metrics").text
            except httpx.HTTPError:
                continue
            m = re.search(r"^hetserve:num_requests_running (\S+)", text, re.M)
            running = int(float(m.group(1))) if m else 0
            if running >= peaks.get("running", 0):
                peaks["running"] = running
                usage = re.findall(r'^hetserve:kv_cache_group_usage_bytes\{group="(\d+)"\} (\S+)', text, re.M)
                peaks["group_bytes"] = {g: float(v) for g, v in usage}
            m = re.search(r"^hetserve:num_preemptions_total (\S+)", text, re.M)
            peaks["preemptions"] = int(float(m.group(1))) if m else peaks.get("preemptions", 0)


def run_policy(policy: str, args, capacity: int) -> dict:
    port = free_port()
    extra = args.layered_args.split() if policy == "layered" else []
    proc, ready_s = start_hetserve(port, "--kv-format", args.kv_format, "--kv-cache-bytes", str(capacity),
                                   "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                                   str(args.batch_tokens), "--kv-policy", policy, *extra)
    url = f"http://127.0.0.1:{port}"
    stop, peaks = threading.Event(), {}
    watcher = threading.Thread(target=watch_running, args=(url, stop, peaks), daemon=True)
    watcher.start()
    try:
        with tempfile.TemporaryDirectory() as out:
            cmd = [str(Path(sys.executable).parent / "hetserve"), "loadgen", "synth", "--endpoint", url,
                   "--num-requests", str(args.num_requests), "--rate", str(args.rate),
                   "--prompt-dist", "fixed", "--prompt-tokens", str(args.prompt_tokens), str(args.prompt_tokens),
                   "--output-dist", "fixed", "--output-tokens", str(args.output_tokens), str(args.output_tokens),
                   "--out", out, "--no-plots", "--no-progress", "--seed", str(args.seed)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            summary = json.loads((Path(out) / "summary.json").read_text())
    finally:
        stop.set()
        watcher.join()
        proc.terminate()
        proc.wait(timeout=60)
    return {"kv_policy": policy, "kv_format": args.kv_format, "server_ready_s": ready_s,
            "peak_running": peaks.get("running", 0), "preemptions": peaks.get("preemptions", 0),
            "group_bytes_at_peak": peaks.get("group_bytes", {}),
            "completed": summary["completed"], "failed": summary["failed"], "duration_s": summary["duration"],
            "output_tok_s": summary["output_throughput"], "ttft_p50_ms": summary["median_ttft_ms"],
            "ttft_p99_ms": summary["p99_ttft_ms"], "tpot_mean_ms": summary["mean_tpot_ms"],
            "tpot_p50_ms": summary["median_tpot_ms"]}


def median_run(runs: list[dict]) -> dict:
    """The run of median output tok/s (the lower middle of an even count), with every run's tok/s beside it."""
    ranked = sorted(runs, key=lambda r: r["output_tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "runs_output_tok_s": [r["output_tok_s"] for r in runs],
            "runs_duration_s": [r["duration_s"] for r in runs]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("peak_running", "peak running sequences"), ("output_tok_s", "output tok/s"),
               ("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_mean_ms", "TPOT mean (ms)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.2))
    for ax, (key, label) in zip(axes, metrics):
        ax.bar([r["kv_policy"] for r in rows], [r[key] for r in rows], color=["tab:gray", "tab:blue"])
        ax.set(title=label)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def attention_steps(shapes: str, kv_format: str = "fp16", repeats: int = 34) -> list[dict]:
    """ms per decode step of the attention worker (30 layers), full cache against layered, for each
    BxCxK of `shapes` (B sequences, context C, K rows kept in the sparse layers; the server's defaults: one full
    layer, the default window and evict slack, so each sequence evicts once every slack + 1 steps, in turn).
    K and V are random, written once through the stores (Oaken: the bundled calibration, tails for B blocks a
    layer); each step writes one row a sequence and attends."""
    import numpy as np
    import torch

    from cpu_attn.calibrate import BUNDLED_DIR, OakenThresholds
    from cpu_attn.kv_store import layered_stores, make_store
    from cpu_attn.layered_worker import LayeredAttentionWorker, LayeredChunkLayout
    from cpu_attn.worker import AttentionWorker, ChunkLayout
    from hetcore.kv_policy import KVPolicy, KVView, SeqRows

    layers, heads, kv_heads, dim, bs = 30, 9, 3, 64, 16
    cal = OakenThresholds.load(next(BUNDLED_DIR.glob("*.json"))) if kv_format == "oaken" else None
    rng = np.random.default_rng(0)
    rows = []
    for shape in shapes.split(","):
        num_seqs, ctx, kept = (int(x) for x in shape.split("x"))
        policy = KVPolicy("layered", full_layers=1, budget_tokens=kept)
        layout = policy.layout(layers, 8192)
        groups, slack = layout.num_groups, policy.evict_slack
        full_blocks, sparse_blocks = -(-(ctx + 1) // bs), -(-(kept + slack + 1) // bs)
        per_seq = full_blocks + (groups - 1) * sparse_blocks
        tables = []
        for i in range(num_seqs):
            ids = iter(range(i * per_seq, (i + 1) * per_seq))
            tables.append([tuple(next(ids) for _ in range(full_blocks if g == 0 else sparse_blocks))
                           for g in range(groups)])
        stores = layered_stores(kv_format, layout.slots, groups, kv_heads, dim, bs, num_seqs * per_seq, cal,
                                recent_blocks=num_seqs)
        layered = LayeredAttentionWorker(stores, dim, layout)
        full_store = make_store(kv_format, layers, kv_heads, dim, bs, num_seqs * full_blocks, cal,
                                recent_blocks=num_seqs)
        full_tables = [tuple(range(i * full_blocks, (i + 1) * full_blocks)) for i in range(num_seqs)]
        full = AttentionWorker(full_store, dim)
        # each sequence's rows before its first step: staggered, so that one evicts every few steps
        held = [kept + (i * (slack + 1)) // num_seqs for i in range(num_seqs)]

        def fill(store, layer, lengths, table_of):
            slots = np.concatenate([np.asarray(table_of(i), np.int64)[np.arange(n) // bs] * bs + np.arange(n) % bs
                                    for i, n in enumerate(lengths)])
            pos = np.concatenate([np.arange(n) for n in lengths])
            k, v = (rng.standard_normal((len(slots), kv_heads, dim)).astype(np.float32) for _ in range(2))
            store.write(layer, slots, k, v, pos)

        for layer in range(layers):
            fill(full_store, layer, [ctx] * num_seqs, lambda i: full_tables[i])
            group, slot = layout.group_of(layer)
            fill(stores[group], slot, [ctx] * num_seqs if group == 0 else held, lambda i: tables[i][group])
        for i in range(num_seqs):
            layered._scores[i] = rng.random((layers, kv_heads, ctx + 1)).astype(np.float32)
        q = torch.randn(num_seqs, heads, dim)
        k, v = torch.randn(num_seqs, kv_heads, dim), torch.randn(num_seqs, kv_heads, dim)

        counts = []  # each sequence's rows, advanced by the block manager's rules
        for i in range(num_seqs):
            counts.append(SeqRows(layout))
            counts[i].rows, counts[i].prompt_tokens = [held[i]] * (groups - 1), ctx

        def layered_step():
            views = []
            for i, seq in enumerate(counts):
                before, after, _ = seq.advance(1, seq.num_tokens + 1)
                views.append(KVView(tuple(tables[i][1:]), before, after))
            layered.begin_step([LayeredChunkLayout(num_tokens=1, start_pos=ctx, block_table=tables[i][0], seq_id=i,
                                                   kv_view=views[i]) for i in range(num_seqs)])
            for layer in range(layers):
                layered.attend(layer, q, k, v)

        def full_step():
            full.begin_step([ChunkLayout(1, ctx, full_tables[i], i) for i in range(num_seqs)])
            for layer in range(layers):
                full.attend(layer, q, k, v)

        row = {"kv_format": kv_format, "num_seqs": num_seqs, "context_tokens": ctx, "kept_rows": kept}
        for name, step in (("full", full_step), ("layered", layered_step)):
            step()
            t0 = time.perf_counter()
            for _ in range(repeats):
                step()
            row[f"{name}_ms"] = (time.perf_counter() - t0) / repeats * 1e3
        row["full_over_layered"] = row["full_ms"] / row["layered_ms"]
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--output-tokens", type=int, default=500)
    p.add_argument("--full-seqs", type=int, default=2, help="sequences the KV capacity holds with every layer's KV")
    p.add_argument("--kv-format", choices=("fp16", "oaken"), default="fp16")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--rate", type=float, default=0.25, help="mean requests/s (Poisson)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=256, help="--max-num-batched-tokens (chunked prefill)")
    p.add_argument("--layered-args", default="--kv-budget-tokens 750 --kv-prefill-evict on",
                   help="the layered server's --kv-* options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each policy, alternated; the table shows each policy's median run")
    p.add_argument("--out", default="kv_policy.json")
    p.add_argument("--attention-only", action="store_true", help="time the attention worker's decode step alone")
    p.add_argument("--shapes", default="8x1024x272,8x4000x272,8x8000x1360",
                   help="--attention-only: BxCxK, comma-separated (sequences x context x rows kept)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.attention_only:
        rows = attention_steps(args.shapes, args.kv_format)
        print_table(rows, list(rows[0]))
        path = write_json(f"kv_policy_attention_{args.kv_format}.json", {
            "benchmark": "kv_policy_attention", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(), "settings": vars(args), "results": rows})
        print(f"wrote {path}")
        return

    capacity = capacity_bytes(args.kv_format, args.prompt_tokens + args.output_tokens, args.full_seqs,
                              args.max_num_seqs)
    runs = {"full": [], "layered": []}
    for r in range(args.repeats):  # alternated, so that a slow spell of the host falls on both
        for policy in runs:
            print(f"[{r + 1}/{args.repeats}] kv-policy {policy}: {args.num_requests} requests of {args.prompt_tokens} "
                  f"+ {args.output_tokens} tokens at {args.rate}/s, KV capacity {capacity / 2**20:.1f} MiB ...",
                  flush=True)
            run = run_policy(policy, args, capacity)
            runs[policy].append(run)
            print(f"  {run['output_tok_s']:.1f} tok/s in {run['duration_s']:.1f} s", flush=True)
    rows = [median_run(runs[policy]) for policy in runs]
    full, layered = rows
    ratios = {"peak_running": layered["peak_running"] / max(full["peak_running"], 1),
              "output_tok_s": layered["output_tok_s"] / full["output_tok_s"],
              "ttft_p50": layered["ttft_p50_ms"] / full["ttft_p50_ms"]}
    print_table(rows, ["kv_policy", "peak_running", "preemptions", "completed", "output_tok_s", "ttft_p50_ms",
                       "ttft_p99_ms", "tpot_mean_ms", "duration_s"])
    print("layered / full: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    data = {"benchmark": "kv_policy", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
            "settings": vars(args), "kv_cache_bytes": capacity, "results": rows, "layered_over_full": ratios}
    path = write_json(args.out, data)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
