"""Paged decode-attention kernel alone: time per layer and KV read rate against the machine's
memory read bandwidth, and against a plain torch baseline (gather the paged KV, then SDPA).

    python -m benchmarks.bench_decode_attn [--batch 32] [--context 1000 4000]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import machine, print_table, write_json
from cpu_attn.kv_store import PagedKVStore


def best_of(fn, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def torch_baseline(store: PagedKVStore, q: np.ndarray, block_tables: np.ndarray, seq_len: int) -> None:
    """What a torch user would do: gather each sequence's blocks, widen, SDPA over the batch."""
    k, v = zip(*(store.gather(0, t, seq_len) for t in block_tables))
    kt, vt = torch.from_numpy(np.stack(k)).transpose(1, 2), torch.from_numpy(np.stack(v)).transpose(1, 2)
    F.scaled_dot_product_attention(torch.from_numpy(q)[:, :, None], kt, vt, enable_gqa=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--out", default="decode_attn.json")
    args = ap.parse_args()
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16  # SmolLM2-135M
    rows = []
    for seq_len in args.context:
        for dtype in ("float16", "float32"):
            blocks_per_seq = -(-seq_len // block_size)
            store = PagedKVStore(1, kv_heads, head_dim, block_size, args.batch * blocks_per_seq, dtype)
            rng = np.random.default_rng(0)
            store.k[:] = rng.standard_normal(store.k.shape).astype(np.float32).astype(np.float16 if dtype == "float16" else np.float32).view(store.k.dtype)
            store.v[:] = store.k
            tables = rng.permutation(args.batch * blocks_per_seq).astype(np.int32).reshape(args.batch, -1)
            q = rng.standard_normal((args.batch, heads, head_dim)).astype(np.float32)
            lens = np.full(args.batch, seq_len, np.int32)
            ours = best_of(lambda: store.decode_attention(0, q, tables, lens, head_dim**-0.5))
            base = best_of(lambda: torch_baseline(store, q, tables, seq_len), repeats=3)
            kv_bytes = 2 * args.batch * seq_len * kv_heads * head_dim * store.k.itemsize
            rows.append({"context": seq_len, "kv": dtype, "ms": ours * 1e3, "kv_gb_s": kv_bytes / ours / 1e9,
                         "torch_gather_sdpa_ms": base * 1e3, "speedup": base / ours})
    info = machine()
    print(f"batch {args.batch}, heads {heads}/{kv_heads}, head_dim {head_dim}, one layer; "
          f"memory read {info['memory_read_gb_s']} GB/s (numpy, one thread)")
    print_table(rows, list(rows[0]))
    print(f"wrote {write_json(args.out, {'machine': info, 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
