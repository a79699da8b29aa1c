"""End to end against peers: hetserve, llama.cpp's llama-server and HF transformers on this machine, the
same GGUF (the bundled SmolLM2-135M-Instruct Q4_1) and the same prompts, driven by `hetserve loadgen`.

    python -m benchmarks.e2e_peers --configs hetserve-oaken-magicpig llama-f16 --workloads long-8k \
        --concurrency 16 --repeats 2
    python -m benchmarks.e2e_peers --grid [--workloads chat-256]   # the standard grid (GRID), or a row of it

Per cell (workload x concurrency) and repeat, every config runs back to back: start the server on a free
port, wait for /health, send the workload, read the metrics, stop it; peak RSS is the server's process
tree, sampled every 0.5 s. Rows accumulate in benchmarks/results/e2e_peers.json (--fresh starts over);
the plot (e2e_peers.png) shows every row there. llama-server is built once from the llama-cpp-python
sdist (the only download; see benchmarks/e2e/llama_build.py). Logs and loadgen outputs go to --run-dir.
"""
from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.common import RESULTS, machine, write_json
from benchmarks.e2e import drive, report, servers
from benchmarks.e2e.llama_build import build_llama_server

DEFAULT_CONFIGS = ("hetserve-fp16", "hetserve-oaken", "hetserve-oaken-magicpig", "llama-f16", "llama-q8_0", "hf")
GRID = {"configs": ["hetserve-default", "hetserve-ray", "llama-f16", "hf"], "workloads": ["chat-256", "long-4k", "long-8k"],
        "concurrency": [1, 8, 16], "output_tokens": 128}
"""What a user meets: `make serve` (and its Ray executor) against llama-server and HF transformers, one chat to
sixteen streams of 8k prompts."""


def run_server_cell(cfg: servers.ServerConfig, w: drive.Workload, c: int, args, llama_server: Path | None,
                    run_dir: Path) -> dict:
    from gpu_model.loader import default_model_path

    cmd = servers.command(cfg, servers.free_port(), c, w.context_tokens, Path(default_model_path()), llama_server,
                          args.threads)
    srv = servers.start(cmd, run_dir / "server.log")
    try:
        before = servers.step_totals(srv.url) if cfg.kind == "hetserve" else {}
        row = drive.run_loadgen(drive.loadgen_command(w, srv.url, c, args.output_tokens, run_dir), run_dir)
        if cfg.kind == "hetserve":
            after = servers.step_totals(srv.url)
            prof = {k: after[k] - before.get(k, 0.0) for k in after}
            prof["other_step_s"] = prof.get("step_s", 0) - prof.get("accelerator_s", 0) - prof.get("cpu_attn_s", 0)
            row["profile"] = {k: round(v, 3) for k, v in prof.items()}
    finally:
        row_rss = srv.stop()
    row.update(peak_rss_mb=round(row_rss / 2**20), ready_s=round(srv.ready_s, 1), cmd=" ".join(cmd))
    return row


def run_hf_cell(w: drive.Workload, c: int, args, run_dir: Path) -> dict:
    import subprocess
    import sys

    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "hf.json"
    cmd = [sys.executable, "-m", "benchmarks.e2e.hf", "--prompt-tokens", str(w.prompt_tokens(args.output_tokens)),
           "--output-tokens", str(args.output_tokens), "--concurrency", str(c),
           "--num-requests", str(max(c, 2)), "--threads", str(args.threads), "--out", str(out)]
    with (run_dir / "hf.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=drive.ROOT)
        rss = servers.PeakRss(proc.pid)
        rc = proc.wait()
    peak = rss.stop()
    if rc != 0:
        raise RuntimeError(f"HF baseline exited with {rc}; see {run_dir / 'hf.log'}")
    row = json.loads(out.read_text())
    row.pop("num_prompt_tokens")
    row.update(peak_rss_mb=round(peak / 2**20), cmd=" ".join(cmd))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(servers.CONFIGS))
    ap.add_argument("--workloads", nargs="+", choices=list(drive.WORKLOADS),
                    help="default: every one (with --grid: the grid's)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                    help="long workloads: each level; the trace runs at the largest only")
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="passes over each cell's configs, back to back")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t/-tb and HF torch threads")
    ap.add_argument("--hf-max-batch-tokens", type=int, default=16384,
                    help="skip HF where concurrency x context exceeds this (fp32 KV, hours on 2 cores)")
    ap.add_argument("--grid", action="store_true",
                    help="the standard grid (GRID): its configs, concurrencies and output tokens; its workloads "
                         "unless --workloads names some")
    ap.add_argument("--out", default="e2e_peers.json", help="file under benchmarks/results/ (rows accumulate)")
    ap.add_argument("--fresh", action="store_true", help="drop the rows already in --out")
    ap.add_argument("--run-dir", default=str(Path.home() / ".cache" / "hetserve" / "e2e_runs"))
    args = ap.parse_args()
    if args.grid:
        args.configs, args.concurrency, args.output_tokens = GRID["configs"], GRID["concurrency"], GRID["output_tokens"]
    args.workloads = args.workloads or (GRID["workloads"] if args.grid else list(drive.WORKLOADS))

    cfgs = [servers.CONFIGS[n] for n in args.configs]
    llama_server = build_llama_server() if any(c.kind == "llama" for c in cfgs) else None
    out_path = RESULTS / args.out
    old = [] if args.fresh or not out_path.is_file() else json.loads(out_path.read_text())["rows"]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    result = {"machine": machine(), "llama_server": str(llama_server), "rows": old}
    new_rows = []
    for wname in args.workloads:
        w = drive.WORKLOADS[wname]
        for c in (args.concurrency if w.kind == "long" else [max(args.concurrency)]):
            for rep in range(args.repeats):
                for cfg in cfgs:
                    if cfg.kind == "hf" and (w.kind != "long" or c * w.context_tokens > args.hf_max_batch_tokens):
                        continue
                    run_dir = Path(args.run_dir) / stamp / f"{wname}-c{c}-r{rep}-{cfg.name}"
                    load = servers.wait_quiet()
                    t0 = time.time()
                    print(f"{wname} c={c} repeat {rep}: {cfg.name} (load {load:.1f}) ...", flush=True)
                    try:
                        row = (run_hf_cell(w, c, args, run_dir) if cfg.kind == "hf"
                               else run_server_cell(cfg, w, c, args, llama_server, run_dir))
                    except (RuntimeError, TimeoutError) as exc:
                        print(f"  failed: {exc}", flush=True)
                        row = {"error": str(exc)}
                    row = {"workload": wname, "concurrency": c, "config": cfg.name, "repeat": rep,
                           "started_utc": datetime.fromtimestamp(t0, timezone.utc).isoformat(timespec="seconds"),
                           "load_avg_before": round(load, 2), "output_tokens": args.output_tokens,
                           "prompt_tokens": w.prompt_tokens(args.output_tokens) if w.kind == "long" else None,
                           **row, "run_dir": str(run_dir)}
                    print(f"  {row.get('output_throughput') or 0:.1f} out tok/s, decode {row.get('decode_tok_s') or 0:.1f} "
                          f"tok/s, TPOT p50 {row.get('median_tpot_ms') or 0:.0f} ms, TTFT {row.get('mean_ttft_ms') or 0:.0f} "
                          f"ms, RSS {row.get('peak_rss_mb')} MB, {time.time() - t0:.0f} s", flush=True)
                    new_rows.append(row)
                    result["rows"] = old + new_rows
                    write_json(args.out, result)
    print()
    report.table([r for r in new_rows if "error" not in r])
    png = report.plot([r for r in result["rows"] if "error" not in r], out_path.with_suffix(".png"))
    print(f"\nwrote {out_path}, {png}")


if __name__ == "__main__":
    main()
