"""Prefill attention of one prompt chunk after earlier ones, side by side in one run: hetserve's
(cpu_attn.prefill: the earlier tokens without a mask, a kv-head's query heads as one matrix, the
chunk's own tokens causally, joined by log-sum-exps) against one torch SDPA with a boolean mask over
the whole context, with the machine's float32 matrix-multiply rate measured in the same run.

    python -m benchmarks.bench_prefill_attn [--context 1024 2048 4096 8192] [--chunk 256 512]

One layer of SmolLM2-135M's shape (9 / 3 heads of 64); the flops are 4 * D per query head and key
it attends (q.k and p.v). Prints a table, writes prefill_attn.json and prefill_attn.png under
benchmarks/results.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench_decode_attn import HEAD_DIM, HEADS, KV_HEADS, limits
from benchmarks.common import RESULTS, machine, print_table, times_ms, write_json
from cpu_attn.prefill import masked_attention, prefill_attention


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for chunk in sorted({r["chunk"] for r in rows}):
        mine = [r for r in rows if r["chunk"] == chunk]
        ax.plot([r["context"] for r in mine], [r["sdpa_mask_gflop_s"] for r in mine], "o--",
                label=f"SDPA with a mask, chunk {chunk}")
        ax.plot([r["context"] for r in mine], [r["hetserve_gflop_s"] for r in mine], "o-",
                label=f"hetserve, chunk {chunk}")
    ax.axhline(rows[0]["sgemm_gflop_s"], color="grey", lw=0.8, label="torch sgemm (this run)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context after the chunk (tokens)")
    ax.set_ylabel("GFLOP/s, one layer")
    ax.set_title("Prefill attention of a chunk after earlier ones")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--chunk", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    lim = limits()
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows = []
    for chunk in args.chunk:
        for context in args.context:
            start = context - chunk
            q = torch.randn(chunk, HEADS, HEAD_DIM, generator=gen)
            k, v = (torch.randn(context, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
            err = (prefill_attention(q, k, v, start, scale) - masked_attention(q, k, v, start, scale)).abs().max().item()
            flops = 4 * HEADS * HEAD_DIM * (chunk * start + chunk * (chunk + 1) / 2)
            base, mine = [], []
            for _ in range(3):  # interleaved, so that a neighbour's burst hits both
                base += times_ms(lambda: masked_attention(q, k, v, start, scale), args.repeats)
                mine += times_ms(lambda: prefill_attention(q, k, v, start, scale), args.repeats)
            b, m = statistics.median(base), statistics.median(mine)
            rows.append({"chunk": chunk, "context": context, "sdpa_mask_ms": b, "hetserve_ms": m,
                         "speedup": b / m, "sdpa_mask_gflop_s": flops / b / 1e6, "hetserve_gflop_s": flops / m / 1e6,
                         "of_sgemm": flops / m / 1e6 / lim["sgemm_gflop_s"], "sgemm_gflop_s": lim["sgemm_gflop_s"],
                         "max_abs_diff": err})
            print(f"chunk {chunk}, context {context}: {b:.1f} -> {m:.1f} ms", flush=True)
    print(f"torch sgemm {lim['sgemm_gflop_s']:.1f} GFLOP/s ({lim['sgemm_threads']} threads), "
          f"read {lim['read_gb_s']:.1f} GB/s")
    print_table(rows, ["chunk", "context", "sdpa_mask_ms", "hetserve_ms", "speedup", "sdpa_mask_gflop_s",
                       "hetserve_gflop_s", "of_sgemm", "max_abs_diff"])
    path = write_json("prefill_attn.json", {"machine": machine(), "limits": lim, "args": vars(args), "rows": rows})
    plot(rows, RESULTS / "prefill_attn.png")
    print(f"wrote {path} and prefill_attn.png")


if __name__ == "__main__":
    main()
