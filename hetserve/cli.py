"""`hetserve` command line. Each package registers its own subcommands (register(sub)):

    serve      server/cli.py       the OpenAI-compatible daemon
    calibrate  evaluation/cli.py   Oaken thresholds for a model
    eval       evaluation/cli.py   accuracy of KV formats through the serving path
    sim        accel_sim/cli.py    simulated accelerators and GPU baselines
    loadgen    loadgen/cli.py      drive an endpoint with a trace and report
    quantize   hetserve/quantize.py  a packed copy of a model in an MX weight format

A subcommand sets `func` (it handles its own errors) or `run` (it loads a model: a wrong model path
or too small a KV cache ends it with one line and exit status 1, not a traceback).
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from accel_sim.cli import register as register_sim
    from evaluation.cli import register as register_eval
    from hetserve.quantize import register as register_quantize
    from loadgen.cli import register as register_loadgen
    from server.cli import register as register_serve

    parser = argparse.ArgumentParser(prog="hetserve", description="Heterogeneous LLM serving daemon")
    parser.set_defaults(func=None, run=None)
    sub = parser.add_subparsers(dest="command", required=True)
    for register in (register_serve, register_eval, register_sim, register_loadgen, register_quantize):
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.run is None:
        return args.func(args) or 0
    from gpu_model.loader import ModelLoadError
    from hetcore.backend import KVCapacityError
    from hetcore.kv_policy import KVPolicyError

    try:
        args.run(args)
    except (ModelLoadError, KVCapacityError, KVPolicyError) as exc:  # a wrong --model path, too small a cache,
        # a KV policy the model cannot take: no traceback
        parser.exit(1, f"hetserve {args.command}: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
