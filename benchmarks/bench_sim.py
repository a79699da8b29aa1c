"""Whole Azure conversation trace (19,366 requests) through the simulator in timing-only mode:
how long the simulation takes on this machine (target: under 30 s per system), and what each
simulated pool would deliver. Prints a table, writes benchmarks/results/sim_trace.json.

    .venv/bin/python -m benchmarks.bench_sim [--model llama2-13b] [--replicas 2]
"""
from __future__ import annotations

import argparse
import json
import time

from accel_sim.hardware import make_system
from accel_sim.models import get_model
from accel_sim.sim import simulate
from accel_sim.workloads import AZURE_CONV_TRACE, fresh, read_trace
from benchmarks.common import RESULTS, machine

SYSTEMS = ("oaken-lpddr", "oaken-hbm", "a100-vllm", "a100-qserve", "h100-vllm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2-13b")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=str(RESULTS / "sim_trace.json"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    base = read_trace(AZURE_CONV_TRACE)
    read_s = time.perf_counter() - t0
    print(f"{AZURE_CONV_TRACE.name}: {len(base)} requests over {base[-1].arrival_s:.0f} s, read in {read_s:.2f} s; "
          f"model {args.model}, {args.replicas} replica(s)")
    print(f"{'system':12} {'dev':>3} {'wall s':>7} {'sim s':>7} {'gen tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT ms':>8} {'J/tok':>6} {'preempt':>7}")
    rows = []
    for name in args.systems.split(","):
        system = make_system(name, get_model(args.model))
        reqs = fresh(base)
        t1 = time.perf_counter()
        res = simulate([system] * args.replicas, reqs)
        wall = time.perf_counter() - t1
        s = res.summary()
        rows.append({"system": name, "devices_per_replica": system.num_devices, "wall_s": wall, **s})
        print(f"{name:12} {system.num_devices:3d} {wall:7.2f} {s['makespan_s']:7.0f} {s['gen_tok_s']:9.0f} "
              f"{s['ttft_p50_s']:9.2f} {s['ttft_p99_s']:9.2f} {s['tpot_mean_s'] * 1e3:8.1f} "
              f"{s['j_per_gen_token']:6.2f} {s['num_preemptions']:7d}")
    out = {"trace": AZURE_CONV_TRACE.name, "num_requests": len(base), "model": args.model,
           "replicas": args.replicas, "trace_read_s": read_s, "machine": machine(), "results": rows}
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
