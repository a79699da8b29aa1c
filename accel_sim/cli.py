"""`hetserve sim ...`: sweeps like the Oaken paper's figures, the validation table, trace replay."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from hetcore.kv_policy import BUDGET_RATIO


def _csv(kind=str):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def _clean_errors(handler):
    """Bad names and values end the command with one line, not a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (ValueError, OSError) as exc:
            raise SystemExit(f"hetserve sim {args.sim_command}: {exc}") from None
    return run


def register(sub) -> None:
    p = sub.add_parser("sim", help="simulated Oaken accelerators and GPU baselines (accel_sim)",
                       description="Discrete-event simulation of Oaken accelerators and GPU baselines.")
    ss = p.add_subparsers(dest="sim_command", required=True)

    sw = ss.add_parser("sweep", help="throughput vs batch size and vs sequence length (paper Fig. 11/13)")
    sw.add_argument("--models", type=_csv(), default=None,
                    help="comma-separated (default: the six Fig. 11 models for --vs batch, llama2-13b for seq_len)")
    sw.add_argument("--systems", type=_csv(), default=None, help="comma-separated systems (see `hetserve sim devices`)")
    sw.add_argument("--vs", choices=["batch", "seq_len", "both"], default="both", help="what to sweep (default: both)")
    sw.add_argument("--batches", type=_csv(int), default=None, help="batch sizes (default: 16,32,64,128,256)")
    sw.add_argument("--prompt-tokens", type=int, default=1024, help="--vs batch: prompt length (default: 1024)")
    sw.add_argument("--output-tokens", type=int, default=1024, help="--vs batch: output length (default: 1024)")
    sw.add_argument("--seq-lens", type=_csv(int), default=None, help="total lengths (default: 1K..32K)")
    sw.add_argument("--seq-batch", type=int, default=16, help="--vs seq_len: batch size (default: 16)")
    sw.add_argument("--out", default="benchmarks/results/sim_sweep",
                    help="output prefix: PREFIX_{batch,seq_len}.png and PREFIX.json (default: %(default)s)")
    sw.set_defaults(func=_clean_errors(sweep_command))

    va = ss.add_parser("validate", help="the simulator against the Oaken paper's published numbers")
    va.add_argument("--json", help="write {rows: [{name, target, value, passed, error, ...}]} here")
    va.set_defaults(func=_clean_errors(validate_command))

    rp = ss.add_parser("replay", help="timing-only replay of a request trace (default: Azure conversation)")
    rp.add_argument("--trace", default=None, help="Azure (TIMESTAMP,ContextTokens,GeneratedTokens) or BurstGPT CSV")
    rp.add_argument("--model", default="llama2-13b", help="model shape (default: %(default)s)")
    rp.add_argument("--systems", type=_csv(), default=["oaken-lpddr", "a100-vllm"],
                    help="comma-separated; each is replayed separately (default: oaken-lpddr,a100-vllm)")
    rp.add_argument("--replicas", type=int, default=1, help="model replicas in the pool (default: 1)")
    rp.add_argument("--pool", default=None, help="one mixed pool instead of --systems/--replicas, e.g. "
                                                  "oaken-lpddr:2,a100-vllm:1 (system:replicas)")
    rp.add_argument("--num-devices", type=int, default=None, help="devices per replica (default: fewest that fit)")
    rp.add_argument("--weight-format", default="auto",
                    help="the simulated weights' format, which sets the bytes a step reads: auto (fp16), bf16, fp32, "
                         "gguf, mxfp8, mxfp6, mxfp6_e3m2, mxfp4, mxint8 (default: auto)")
    rp.add_argument("--kv-policy", choices=["full", "layered"], default="full",
                    help="layered: the first --kv-full-layers keep every token, the others a budget per sequence once "
                         "its prompt is computed (hetserve serve's --kv-policy layered; default: full)")
    rp.add_argument("--kv-full-layers", type=int, default=3, help="--kv-policy layered: layers that keep every "
                                                                   "token (default: 3, PPIO's)")
    rp.add_argument("--kv-budget-tokens", type=int, default=None,
                    help="--kv-policy layered: tokens each other layer keeps per sequence")
    rp.add_argument("--kv-budget-ratio", type=float, default=None,
                    help=f"--kv-policy layered: the same as a share of the prompt (default: {BUDGET_RATIO} unless "
                         "--kv-budget-tokens)")
    rp.add_argument("--routing", default="least-loaded", help="least-loaded, round-robin or random")
    rp.add_argument("--time-scale", type=float, default=1.0, help="speed-up of arrivals (2 = twice the rate)")
    rp.add_argument("--limit", type=int, default=None, help="first N requests only")
    rp.add_argument("--max-num-seqs", type=int, default=256, help="running sequences per replica (default: 256)")
    rp.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step (default: 2048)")
    rp.add_argument("--seed", type=int, default=0, help="seed of the random routing policy")
    rp.add_argument("--json", help="write the summaries here")
    rp.set_defaults(func=_clean_errors(replay_command))

    dv = ss.add_parser("devices", help="list devices, KV formats and systems with their sources")
    dv.set_defaults(func=devices_command)


def sweep_command(args: argparse.Namespace) -> int:
    from accel_sim.models import PAPER_FIG11_MODELS
    from accel_sim.sweep import BATCHES, DEFAULT_SYSTEMS, SEQ_LENS, format_table, plot, sweep_batch, sweep_seq_len

    systems = args.systems or list(DEFAULT_SYSTEMS)
    out: dict = {"systems": systems}
    t0 = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.vs in ("batch", "both"):
        models = args.models or list(PAPER_FIG11_MODELS)
        rows = sweep_batch(models, systems, args.batches or BATCHES, args.prompt_tokens, args.output_tokens)
        print(f"throughput vs batch size ({args.prompt_tokens} in / {args.output_tokens} out)")
        print(format_table(rows, "batch"))
        plot(rows, "batch", f"{args.out}_batch.png",
             f"generation throughput vs batch ({args.prompt_tokens}/{args.output_tokens} tokens), simulated")
        out["vs_batch"] = rows
    if args.vs in ("seq_len", "both"):
        models = args.models or ["llama2-13b"]
        rows = sweep_seq_len(models, systems, args.seq_lens or SEQ_LENS, args.seq_batch)
        print(f"\nthroughput vs total sequence length (batch {args.seq_batch}, half prompt / half output)")
        print(format_table(rows, "seq_len"))
        plot(rows, "seq_len", f"{args.out}_seq_len.png",
             f"generation throughput vs sequence length (batch {args.seq_batch}), simulated")
        out["vs_seq_len"] = rows
    Path(f"{args.out}.json").write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}.json and PNGs ({time.perf_counter() - t0:.1f} s)")
    return 0


def validate_command(args: argparse.Namespace) -> int:
    from accel_sim.validate import format_cross_checks, format_rows, validate

    t0 = time.perf_counter()
    result = validate()
    print(format_rows(result["rows"]))
    print("\n" + format_cross_checks(result["cross_checks"]))
    print(f"\n{result['num_passed']} of {result['num_rows']} rows pass ({time.perf_counter() - t0:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


def replay_command(args: argparse.Namespace) -> int:
    from accel_sim.hardware import LayeredKV, make_system
    from accel_sim.models import get_model
    from accel_sim.sim import SchedulerLimits, simulate
    from accel_sim.workloads import AZURE_CONV_TRACE, fresh, read_trace

    trace = Path(args.trace) if args.trace else AZURE_CONV_TRACE
    limits = SchedulerLimits(args.max_num_seqs, args.max_num_batched_tokens)
    model = get_model(args.model)
    layered = None
    if args.kv_policy == "layered":
        ratio = BUDGET_RATIO if args.kv_budget_tokens is None and args.kv_budget_ratio is None else args.kv_budget_ratio
        layered = LayeredKV(args.kv_full_layers, args.kv_budget_tokens, ratio)
    elif args.kv_budget_tokens is not None or args.kv_budget_ratio is not None:
        raise ValueError("--kv-budget-tokens and --kv-budget-ratio need --kv-policy layered")
    if args.pool:
        pools = [[make_system(name, model, args.num_devices, args.weight_format, layered) for name, _, n in
                  (entry.partition(":") for entry in args.pool.split(",")) for _ in range(int(n or 1))]]
    else:
        pools = [[make_system(name, model, args.num_devices, args.weight_format, layered)] * args.replicas
                 for name in args.systems]
    base = read_trace(trace, args.limit, args.time_scale)
    results = []
    for pool in pools:
        t0 = time.perf_counter()
        res = simulate(pool, fresh(base), limits, args.routing, args.seed)
        wall = time.perf_counter() - t0
        name = "+".join(dict.fromkeys(s.name for s in pool))
        s = {"system": name, "model": args.model, "kv_policy": args.kv_policy,
             "layered": None if layered is None else dataclasses.asdict(layered), "replicas": len(pool),
             "devices_per_replica": [s.num_devices for s in pool], "trace": trace.name, "wall_s": wall,
             **res.summary()}
        results.append(s)
        print(f"{name:12} x{len(pool)}: {s['num_finished']}/{s['num_requests']} done, "
              f"{s['gen_tok_s']:.0f} gen tok/s, TTFT p50 {s['ttft_p50_s']:.2f} s p99 {s['ttft_p99_s']:.1f} s, "
              f"TPOT {s['tpot_mean_s'] * 1e3:.1f} ms, {s['j_per_gen_token']:.2f} J/token, "
              f"{s['num_preemptions']} preemptions; simulated {s['makespan_s']:.0f} s in {wall:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=1))
        print(f"wrote {args.json}")
    return 0


def devices_command(args: argparse.Namespace) -> int:
    from accel_sim.hardware import SYSTEMS, device_names, load_device, load_formats

    for name in device_names():
        d = load_device(name)
        print(f"{name}: {d.description}")
        for key, src in d.sources.items():
            v = getattr(d, key)
            v = str(v) if isinstance(v, bool) else format(v, "g")
            print(f"  {key:20} {v:>10}  {' '.join(str(src).split())}")
    print("\nKV formats (bits per value):", ", ".join(f"{f.name} {f.bits_per_value:g}" for f in load_formats().values()))
    print("\nsystems:")
    for name, (dev, fmt, what) in SYSTEMS.items():
        print(f"  {name:12} {dev:12} {fmt:11} {what}")
    return 0
