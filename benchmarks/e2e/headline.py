"""Decode speed at long context, hetserve's backend against llama.cpp, back to back, each with one shared
prompt (the only way to reach 16 x 8k contexts on 2 cores in minutes rather than hours):

    python -m benchmarks.e2e.headline --context-tokens 7936 --concurrency 1 4 16 --steps 32 --repeats 2

hetserve: `benchmarks.e2e.decode_only` (its backend, one prefill, its KV blocks shared by every sequence, or
copied to each with `--distinct`).
llama.cpp: `llama-batched-bench -pps` (one prefill, copied to every sequence): without `-kvu` each sequence
gets its own physical copy (as llama-server's slots have); with `-kvu` the cells are shared, like hetserve's
blocks here. Both with flash attention, 2 threads, the same GGUF. Peak RSS of each process is recorded.
Writes benchmarks/results/e2e_decode.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.common import RESULTS, machine, print_table, write_json
from benchmarks.e2e import report, servers
from benchmarks.e2e.llama_build import build_llama_server


def run_hetserve(cfg: servers.ServerConfig, args, log: Path) -> list[dict]:
    out = log.with_suffix(".json")
    cmd = [sys.executable, "-m", "benchmarks.e2e.decode_only", "--context-tokens", str(args.context_tokens),
           "--concurrency", *map(str, args.concurrency), "--steps", str(args.steps), "--out", str(out),
           *(["--distinct"] if args.distinct else []), "--", "--log-level", "warning", *cfg.args]
    peak = _run(cmd, log)
    rows = json.loads(out.read_text())
    return [{"config": cfg.name, "concurrency": r["concurrency"], "decode_tok_s": r["decode_tok_s"],
             "step_ms": r["mean_step_ms"], "p99_step_ms": r["p99_step_ms"],
             "accelerator_ms": r["parts_ms"].get("accelerator"), "cpu_attn_ms": r["parts_ms"].get("cpu_attn"),
             "prefill_s": r["prefill_one_prompt_s"], "peak_rss_mb": peak, "cmd": " ".join(cmd)} for r in rows]


def run_llama(cfg: servers.ServerConfig, args, log: Path, bench: Path, gguf: Path, unified: bool) -> list[dict]:
    c_max = max(args.concurrency)
    n_ctx = args.context_tokens + c_max * args.steps if unified else c_max * (args.context_tokens + args.steps)
    cmd = [str(bench), "-m", str(gguf), "-c", str(n_ctx), "-b", "2048", "-ub", "512", "-fa", "on",
           "-t", str(args.threads), "-tb", str(args.threads), "-npp", str(args.context_tokens),
           "-ntg", str(args.steps), "-npl", ",".join(map(str, args.concurrency)), "-pps",
           "--output-format", "jsonl", *(["-kvu"] if unified else []), *cfg.args]
    peak = _run(cmd, log)
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"n_kv_max"')]
    name = cfg.name + ("-unified" if unified else "")
    return [{"config": name, "concurrency": r["pl"], "decode_tok_s": r["speed_tg"],
             "step_ms": 1e3 * r["t_tg"] / r["tg"], "prefill_s": r["t_pp"], "peak_rss_mb": peak,
             "cmd": " ".join(cmd)} for r in rows]


def _run(cmd: list[str], log: Path) -> int:
    """Runs cmd with its output in `log`; returns the peak RSS of its process tree in MB."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        rss = servers.PeakRss(proc.pid)
        rc = proc.wait()
    peak = rss.stop()
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} exited with {rc}; see {log}")
    return round(peak / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context-tokens", type=int, default=7936, help="shared prompt (a multiple of 16)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per concurrency")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", nargs="+", choices=[n for n, c in servers.CONFIGS.items() if c.kind != "hf"],
                    default=["hetserve-oaken-magicpig", "llama-f16", "hetserve-oaken", "hetserve-fp16", "llama-q8_0"])
    ap.add_argument("--no-unified", action="store_true", help="llama.cpp: skip the shared-cell (-kvu) variant")
    ap.add_argument("--distinct", action="store_true",
                    help="hetserve: copy the prompt's KV to every sequence (as llama.cpp without -kvu), not share it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="e2e_decode.json")
    ap.add_argument("--run-dir", default=str(Path.home() / ".cache" / "hetserve" / "e2e_runs"))
    args = ap.parse_args()

    from gpu_model.loader import default_model_path

    cfgs = [servers.CONFIGS[n] for n in args.configs]
    bench = build_llama_server(target="llama-batched-bench") if any(c.kind == "llama" for c in cfgs) else None
    run_dir = Path(args.run_dir) / ("decode-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S"))
    result = {"machine": machine(), "args": {k: v for k, v in vars(args).items()}, "rows": []}
    for rep in range(args.repeats):
        for cfg in cfgs:
            variants = [False, True] if cfg.kind == "llama" and not args.no_unified else [False]
            for unified in variants:
                load, t0 = servers.wait_quiet(), time.time()
                log = run_dir / f"r{rep}-{cfg.name}{'-unified' if unified else ''}.log"
                print(f"repeat {rep}: {cfg.name}{' -kvu' if unified else ''} (load {load:.1f}) ...", flush=True)
                try:
                    rows = (run_hetserve(cfg, args, log) if cfg.kind == "hetserve"
                            else run_llama(cfg, args, log, bench, Path(default_model_path()), unified))
                except RuntimeError as exc:
                    print(f"  failed: {exc}", flush=True)
                    continue
                for r in rows:
                    r.update(repeat=rep, context_tokens=args.context_tokens, load_avg_before=round(load, 2),
                             started_utc=datetime.fromtimestamp(t0, timezone.utc).isoformat(timespec="seconds"))
                    print(f"  c={r['concurrency']}: {r['decode_tok_s']:.1f} tok/s, step {r['step_ms']:.0f} ms", flush=True)
                result["rows"] += rows
                write_json(args.out, result)
    print()
    print_table(result["rows"], ["repeat", "config", "concurrency", "decode_tok_s", "step_ms", "accelerator_ms",
                                 "cpu_attn_ms", "prefill_s", "peak_rss_mb", "load_avg_before"])
    if result["rows"]:
        print(f"wrote {report.plot_decode(result['rows'], (RESULTS / args.out).with_suffix('.png'))}")


if __name__ == "__main__":
    main()
