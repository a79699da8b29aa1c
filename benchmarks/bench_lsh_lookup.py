"""The LSH lookup behind MagicPIG: our Numba CSR tables against faiss's binary multi-hash index,
side by side in one run, on the same codes.

    python -m benchmarks.bench_lsh_lookup [--keys 4096 8192 16384 32768] [--lsh-k 10] [--lsh-l 150]

Keys of one (sequence, layer, kv-head): Gaussian with a heavy channel, centered, hashed with
cpu_attn.simhash (K bits per table, L tables); queries near stored keys. Both indexes hold the same
codes: ours as L CSR tables of bit-packed ids (cpu_attn.lsh.table_set); faiss's
IndexBinaryMultiHash(d = K·L bits, nhash = L, b = K) as L hash maps over the same K-bit pieces.
Per query, ours returns the keys colliding in >= 2 tables (what MagicPIG samples); faiss
gathers the keys colliding in >= 1 table, ranks them by Hamming distance over all K·L bits and
returns the nearest, asked for as many as ours found. Both on one thread: the attention kernel
runs one lookup per (sequence, kv-head) and thread. Reports build time, lookup time per query,
candidates per query and index bytes per key.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.common import machine, print_table, write_json
from cpu_attn import lsh
from cpu_attn.simhash import simhash, simhash_matrix

HEAD_DIM = 64


def faiss_bits(codes: np.ndarray, k: int) -> np.ndarray:
    """codes [N, L] -> [N, ceil(K·L / 8)] uint8 with bit t·K + j = bit j of table t's code
    (faiss reads bit strings least significant bit first)."""
    bits = (codes[:, :, None] >> np.arange(k)) & 1
    return np.packbits(bits.reshape(len(codes), -1).astype(np.uint8), axis=1, bitorder="little")


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    import faiss

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--lsh-k", type=int, default=10)
    ap.add_argument("--lsh-l", type=int, default=150)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--out", default="lsh_lookup.json")
    args = ap.parse_args()
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    k, num_tables = args.lsh_k, args.lsh_l
    w = simhash_matrix(HEAD_DIM, k, num_tables)
    rows = []
    for n in args.keys:
        keys = rng.standard_normal((n, HEAD_DIM)).astype(np.float32)
        keys[:, 3] *= 8  # a heavy channel, as real keys have
        keys -= keys.mean(0)
        q = keys[rng.integers(0, n, args.queries)] * 0.6 + rng.standard_normal((args.queries, HEAD_DIM)) * 0.3
        codes = simhash(torch.from_numpy(keys), w, k).numpy()
        q_codes = simhash(torch.from_numpy(q.astype(np.float32)), w, k).numpy()

        t_build = timed(lambda: lsh.table_set(codes, k))
        offsets, ids = lsh.table_set(codes, k)
        count, cand = np.zeros(n, np.uint8), np.empty(n, np.int64)
        found = [lsh.collect_candidates(qc, offsets, ids, n, 0, n, count, cand, 0) for qc in q_codes]  # compiles too
        t_ours = timed(lambda: [lsh.collect_candidates(qc, offsets, ids, n, 0, n, count, cand, 0) for qc in q_codes])

        d = -(-k * num_tables // 8) * 8
        db, qb = faiss_bits(codes, k), faiss_bits(q_codes, k)

        def build_faiss():
            index = faiss.IndexBinaryMultiHash(d, num_tables, k)
            index.add(db)
            return index

        t_faiss_build = timed(build_faiss)
        index = build_faiss()
        top = max(1, int(np.mean(found)))
        stats = faiss.cvar.indexBinaryHash_stats
        stats.reset()
        index.search(qb, top)
        faiss_verified = stats.ndis / len(qb)
        t_faiss = timed(lambda: index.search(qb, top))
        faiss_bytes = faiss.serialize_index_binary(index).nbytes - db.nbytes  # the hash maps, not the codes
        row = {"keys": n, "ours_build_ms": t_build * 1e3, "faiss_build_ms": t_faiss_build * 1e3,
               "ours_lookup_us": t_ours / len(q_codes) * 1e6, "faiss_lookup_us": t_faiss / len(qb) * 1e6,
               "faiss_vs_ours": t_faiss / t_ours, "ours_candidates": float(np.mean(found)),
               "faiss_candidates_ranked": faiss_verified, "ours_bytes_per_key": (offsets.nbytes + ids.nbytes) / n,
               "faiss_bytes_per_key": faiss_bytes / n, "faiss_code_bytes_per_key": d / 8}
        rows.append(row)
        print(f"{n} keys: ours {row['ours_lookup_us']:.1f} us/query, faiss {row['faiss_lookup_us']:.1f}", flush=True)
    print(f"\nK={k}, L={num_tables}, {args.queries} queries, one thread each")
    print_table(rows, list(rows[0]))
    print(f"wrote {write_json(args.out, {'machine': machine(), 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
