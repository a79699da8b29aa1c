"""MagicPIG table lookups with bit-packed key ids (cpu_attn.lsh: ceil(log2 n) bits per id) against the
uint16 ids they replaced, side by side in one run, as the sampled kernel uses them: one table set
per (sequence, kv-head) item, items in parallel, each looking up its GQA group's 3 queries.

    python -m benchmarks.bench_lsh_ids [--keys 4096 8192 32768] [--items 24]

Keys and queries as in bench_sampled_attn (queries near stored keys, so ~3 % of keys collide in
>= 2 tables); 24 items = 8 sequences x 3 kv-heads, whose tables (~2.4-9 MB each at 8k-32k) do not fit
the cache together. Reports ms per lookup round (every item, 3 queries each) and table bytes per key.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from numba import njit, prange

from benchmarks.bench_decode_attn import best_of
from benchmarks.common import machine, print_table, write_json
from cpu_attn import lsh
from cpu_attn.llvm_ir import prefetch
from cpu_attn.simhash import simhash, simhash_matrix

HEAD_DIM, GROUP = 64, 3


@njit(cache=True, nogil=True)
def collect_uint16(q_codes, offsets, ids, lo, hi, count, cand):
    """The lookup as it was with ids [L, N] uint16 (lsh.collect_candidates before the packing)."""
    for t in range(q_codes.shape[0]):
        prefetch(offsets, (t, q_codes[t]))
    for t in range(q_codes.shape[0]):
        prefetch(ids, (t, offsets[t, q_codes[t]]))
    n = 0
    for t in range(q_codes.shape[0]):
        b = q_codes[t]
        for i in range(offsets[t, b], offsets[t, b + 1]):
            key = np.int64(ids[t, i])
            if lo <= key < hi:
                c = count[key] + 1
                count[key] = min(c, 2)
                if c == 2:
                    cand[n] = key
                    n += 1
    for t in range(q_codes.shape[0]):
        b = q_codes[t]
        for i in range(offsets[t, b], offsets[t, b + 1]):
            count[ids[t, i]] = 0
    return n


@njit(cache=True, nogil=True, parallel=True)
def lookup_round(q_codes, offsets, ids, num_keys, packed, found):
    """Every item looks up its group's queries q_codes [items, GROUP, L] -> found [items]."""
    for item in prange(offsets.shape[0]):
        count, cand = np.zeros(num_keys, np.uint8), np.empty(GROUP * num_keys, np.int64)
        total = 0
        for g in range(GROUP):
            if packed:
                total += lsh.collect_candidates(q_codes[item, g], offsets[item], ids[item], num_keys, 0, num_keys,
                                                count, cand[total:], 0)
            else:
                total += collect_uint16(q_codes[item, g], offsets[item], ids[item], 0, num_keys, count, cand[total:])
        found[item] = total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, nargs="+", default=[4096, 8192, 32768])
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--lsh-k", type=int, default=10)
    ap.add_argument("--lsh-l", type=int, default=150)
    ap.add_argument("--out", default="lsh_ids.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    w = simhash_matrix(HEAD_DIM, args.lsh_k, args.lsh_l)
    rows = []
    for n in args.keys:
        offsets, packed, plain, q_codes = [], [], [], []
        for _ in range(args.items):
            keys = rng.standard_normal((n, HEAD_DIM)).astype(np.float32)
            keys[:, 3] *= 8  # a heavy channel, as real keys have
            q = keys[rng.integers(0, n, GROUP)] * 0.6 + rng.standard_normal((GROUP, HEAD_DIM)) * 0.3
            o, ids = lsh.table_set(simhash(torch.from_numpy(keys - keys.mean(0)), w, args.lsh_k).numpy(), args.lsh_k)
            offsets.append(o)
            packed.append(ids)
            plain.append(lsh.unpack_ids(ids, n).astype(np.uint16))
            q_codes.append(simhash(torch.from_numpy(q.astype(np.float32)), w, args.lsh_k).numpy())
        offsets, packed, plain, q_codes = (np.stack(x) for x in (offsets, packed, plain, q_codes))
        found_packed, found_plain = np.zeros(args.items, np.int64), np.zeros(args.items, np.int64)
        lookup_round(q_codes, offsets, packed, n, True, found_packed)
        lookup_round(q_codes, offsets, plain, n, False, found_plain)
        assert (found_packed == found_plain).all(), "both formats must retrieve the same keys"
        t_plain = min(best_of(lambda: lookup_round(q_codes, offsets, plain, n, False, found_plain)) for _ in range(3))
        t_packed = min(best_of(lambda: lookup_round(q_codes, offsets, packed, n, True, found_packed)) for _ in range(3))
        rows.append({"keys": n, "items": args.items, "uint16_ms": t_plain * 1e3, "packed_ms": t_packed * 1e3,
                     "packed_vs_uint16": t_packed / t_plain, "id_bits": lsh.id_bits(n),
                     "bytes_per_key_uint16": (offsets[0].nbytes + plain[0].nbytes) / n,
                     "bytes_per_key_packed": (offsets[0].nbytes + packed[0].nbytes) / n,
                     "found_per_query_frac": float(found_packed.mean() / GROUP / n)})
        print(f"{n} keys: uint16 {t_plain * 1e3:.2f} ms, packed {t_packed * 1e3:.2f} ms", flush=True)
    print(f"\nK={args.lsh_k}, L={args.lsh_l}, {args.items} table sets looked up in parallel, {GROUP} queries each")
    print_table(rows, ["keys", "id_bits", "uint16_ms", "packed_ms", "packed_vs_uint16", "bytes_per_key_uint16",
                       "bytes_per_key_packed", "found_per_query_frac"])
    print(f"wrote {write_json(args.out, {'machine': machine(), 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
