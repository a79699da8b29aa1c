"""The decode step's linear layers on the CPU, six ways in one run, on the bundled model's weights:
the fp32 copy with BLAS, the GGUF's own Q4_1 blocks (gpu_model/quant.py: float32 products), the
same blocks with integer dots (gpu_model/quant_vnni.py, CPUs with AVX512-VNNI or AVX2), with 8-bit
activations (`--activation-bits 8`, AVX512-VNNI), and by AMX tiles (gpu_model/quant_amx.py, CPUs with AMX;
served from TILE_MIN_TOKENS rows), and bf16 weights with oneDNN (`--cpu-linear-dtype bfloat16`, the default on
CPUs with AVX512-BF16 or AMX).

    python -m benchmarks.bench_linears [--tokens 1 2 4 16 64 512] [--repeats 20] [--name linears]

One "step" = every layer's qkv, o, gate_up and down plus the output head, for a batch of `tokens`
rows (a decode step at that many sequences, or a prefill chunk). Warm caches: the weights of a
135M model (212 MB in bf16) do not stay in L3 between real steps, so in the server the bf16 and
fp32 paths also pay the weight reads that the blocks (~0.6 byte a weight) avoid; the table gives
the floor that read costs at the machine's measured bandwidth. Prints a table, writes
benchmarks/results/NAME.json and NAME.png.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS, machine, print_table, times_ms, write_json
from gpu_model.loader import load_model, resolve_model_dir
from gpu_model.model import LlamaModel
from gpu_model.quant_amx import is_available as has_tiles
from gpu_model.quant_vnni import VnniWeight, x8_available

BLOCKS_MAX_TOKENS = 64


def _nbytes(q) -> int:
    """Bytes of a block weight's arrays (QuantWeight, VnniWeight)."""
    return sum(a.nbytes for a in vars(q).values() if isinstance(a, np.ndarray))


def step_ms(model: LlamaModel, tokens: int, repeats: int) -> float:
    mats = list(model.matmul_weights().items())
    xs = {w.shape[1]: torch.randn(tokens, w.shape[1]) for _, w in mats}

    def step() -> None:
        for key, w in mats:
            model._linear(key, w, xs[w.shape[1]])

    return float(np.median(times_ms(step, repeats)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 16, 64, 512])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--model", help="GGUF file or safetensors directory (default: the bundled model)")
    p.add_argument("--name", default="linears", help="results file stem (default: linears)")
    args = p.parse_args()
    model_dir = resolve_model_dir(args.model, Path("~/.cache/hetserve/models").expanduser())
    torch.set_grad_enabled(False)
    fp32 = load_model(model_dir, gguf_blocks_max_tokens=0, cpu_linear_dtype="float32")
    blocks = load_model(model_dir, gguf_blocks_max_tokens=BLOCKS_MAX_TOKENS, cpu_linear_dtype="float32")
    bf16 = load_model(model_dir, gguf_blocks_max_tokens=0, cpu_linear_dtype="bfloat16")
    # the blocks with integer dots (gpu_model/quant_vnni.py), as served by default where the CPU has them
    vnni = load_model(model_dir, gguf_blocks_max_tokens=BLOCKS_MAX_TOKENS, cpu_linear_dtype="auto")
    has_blocks, has_vnni = bool(blocks.quant), any(isinstance(q, VnniWeight) for q in vnni.quant.values())
    x8 = load_model(model_dir, gguf_blocks_max_tokens=BLOCKS_MAX_TOKENS, activation_bits=8) if x8_available() else None
    mach = machine()
    gbs = mach["memory_read_gb_s"]
    nbytes = {"fp32": sum(w.numel() * 4 for w in fp32.matmul_weights().values()),
              "bf16": sum(w.numel() * 2 for w in bf16.matmul_weights().values()),
              "blocks": sum(_nbytes(q) for q in blocks.quant.values())}
    if has_vnni:
        nbytes["vnni"] = sum(_nbytes(q) for q in vnni.quant.values())
    rows = []
    for t in args.tokens:
        row = {"tokens": t, "fp32_ms": step_ms(fp32, t, args.repeats), "bf16_ms": step_ms(bf16, t, args.repeats)}
        if has_blocks and t <= BLOCKS_MAX_TOKENS:
            row["blocks_ms"] = step_ms(blocks, t, args.repeats)
            row["bf16_vs_blocks"] = row["blocks_ms"] / row["bf16_ms"]
        if has_vnni and t <= BLOCKS_MAX_TOKENS:
            vnni.tile_rows = 0
            row["vnni_ms"] = step_ms(vnni, t, args.repeats)
            row["vnni_vs_blocks"] = row["blocks_ms"] / row["vnni_ms"]
            row["bf16_vs_vnni"] = row["vnni_ms"] / row["bf16_ms"]
            if x8 is not None:
                x8.tile_rows = 0
                row["x8_ms"] = step_ms(x8, t, args.repeats)
                row["vnni_vs_x8"] = row["vnni_ms"] / row["x8_ms"]
            if has_tiles():
                vnni.tile_rows = 1
                row["tiles_ms"] = step_ms(vnni, t, args.repeats)
                row["vnni_vs_tiles"] = row["vnni_ms"] / row["tiles_ms"]
        row["bf16_vs_fp32"] = row["fp32_ms"] / row["bf16_ms"]
        rows.append(row)
        print(f"{t} tokens done", flush=True)
    floors = {k: 1e3 * v / 1e9 / gbs for k, v in nbytes.items()}
    print("weights per step: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in nbytes.items())
          + f"; read floors at {gbs} GB/s: " + ", ".join(f"{k} {v:.1f} ms" for k, v in floors.items()))
    print("ms per step (speed-ups: a / b > 1 means b is faster)")
    print_table(rows, ["tokens", "fp32_ms", "blocks_ms", "vnni_ms", "x8_ms", "tiles_ms", "bf16_ms", "bf16_vs_fp32",
                       "bf16_vs_blocks", "vnni_vs_blocks", "bf16_vs_vnni", "vnni_vs_x8", "vnni_vs_tiles"])
    path = write_json(f"{args.name}.json", {"machine": mach, "weight_bytes": nbytes, "read_floor_ms": floors,
                                            "rows": rows})
    plot(rows, floors, RESULTS / f"{args.name}.png")
    print(f"wrote {path} and {args.name}.png")


def plot(rows: list[dict], floors: dict[str, float], path: Path) -> None:
    """Milliseconds a step's linears take per way against the tokens a step, the blocks' read floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("fp32_ms", "fp32 (BLAS)"), ("blocks_ms", "Q4_1 blocks, float32 products"),
                       ("vnni_ms", "blocks, integer dots"), ("x8_ms", "blocks, integer dots, 8-bit x"),
                       ("tiles_ms", "blocks, AMX tiles"), ("bf16_ms", "bf16")):
        points = [(r["tokens"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    if "vnni" in floors:
        ax.axhline(floors["vnni"], linestyle="--", color="gray", label="blocks' read floor")
    ax.set(xscale="log", yscale="log", xlabel="tokens a step", ylabel="ms a step's linears")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
