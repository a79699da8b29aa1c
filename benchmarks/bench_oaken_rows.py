"""Time per row of the exact Oaken kernel's two int16 parts, alone: the key scores of a full block
(`oaken.vnni_block_scores`, or `avx2_block_scores` without AVX-512) and its values summed by the softmax
weights (`oaken.vnni_add_weighted_rows` or `avx2_add_weighted_rows`),
each over all kv-heads of the block, reported per kv-head's row (a row of one kv-head); and the float decoder of
one kv-head's row (`oaken.load_row`, as MagicPIG's sampled kernel decodes its rows) at 4096 random rows.

    python -m benchmarks.bench_oaken_rows [--shape smollm2-135m | llama-3.1-8b] [--blocks 64] [--calls 200000]

One thread, one layer's heads, each part called in a loop over `blocks` blocks (64 stay in
cache: no memory traffic), so the numbers are the instructions' cost: for work on these kernels, where
bench_decode_attn's whole-kernel timing moves by the VM's ±5 % noise. Each part is timed as stored and with
the blocks' sparse entries dropped (counts zeroed; the results then differ): the value side then skips its pass
over a row's entries; the key side still makes its one pass (over none), so its difference is small.
"""
from __future__ import annotations

import argparse

import numpy as np
from numba import njit

from benchmarks.bench_decode_attn import BLOCK, SHAPES, best_of, fill, served_oaken
from benchmarks.common import machine, print_table, write_json
from cpu_attn import oaken


@njit(cache=True)
def _key_scores(calls, parts, thr, qi, qscale, s, acc):
    blocks = parts[0].shape[0]
    for r in range(calls):
        b = r % blocks
        oaken.int16_block_scores(s, qi, qscale, parts[0][b], parts[1][b], parts[2][b], parts[3][b], thr,
                                 np.float32(0.125), acc)


@njit(cache=True)
def _values(calls, parts, thr, w, out):
    blocks = parts[0].shape[0]
    for r in range(calls):
        b = r % blocks
        oaken.int16_add_weighted_rows(out, w, parts[0][b], parts[1][b], parts[2][b], parts[3][b], thr)


@njit(cache=True)
def _sampled_rows(rounds, parts, blocks, offsets, segs, entries, out):
    for _ in range(rounds):
        for i in range(blocks.shape[0]):
            oaken.load_row(parts, blocks[i], segs[i], offsets[i], entries[i], out[i & 15])


def _sampled_args(store, rng, kv_heads, head_dim, rows=4096):
    """Random (block, row, kv-head) rows of the store's K, as the sampled kernel decodes them (load_row: the
    float decoder, one kv-head's row; each row's entry start precomputed, as _prefetch_rows does)."""
    parts = store._parts(0, 0)
    blocks = rng.integers(0, parts[0].shape[0], rows)
    offsets = rng.integers(0, BLOCK, rows)
    segs = rng.integers(0, kv_heads, rows) * (head_dim // oaken.SEGMENT)
    entries = np.array([oaken.row_entries(parts[2][b], o) for b, o in zip(blocks, offsets)], np.int64)
    return parts, blocks, offsets, segs, entries, np.zeros((16, head_dim), np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="one layer of this model's heads")
    ap.add_argument("--blocks", type=int, default=64, help="blocks cycled through (64: in cache)")
    ap.add_argument("--calls", type=int, default=200_000, help="calls of each part per timing")
    ap.add_argument("--out", default="oaken_rows.json")
    args = ap.parse_args()
    if not oaken.INT16:
        raise SystemExit("the int16 kernels need AVX2 (AVX512-BW, -VNNI and -VBMI2 for the vnni_ ones) and "
                         "NUMBA_CPU_NAME unset")
    heads, kv_heads, head_dim = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    store = served_oaken(args.blocks, rng, kv_heads, head_dim)
    fill(store, rng, 1, args.blocks * BLOCK)
    k_parts, v_parts = store._parts(0, 0)[:4], store._parts(0, 1)[:4]
    thr_k, thr_v = store.thresholds[0]
    qi, qscale = oaken.query_codes(rng.standard_normal((heads, head_dim)).astype(np.float32))
    s, acc = np.zeros((heads, BLOCK), np.float32), np.zeros((heads, oaken.ROWS, 16), np.float32)
    w, out = rng.random((heads, BLOCK)).astype(np.float32), np.zeros((heads, head_dim), np.float32)
    head_rows = BLOCK * kv_heads
    calls = args.calls
    row_parts, *row_args = _sampled_args(store, rng, kv_heads, head_dim)
    num_rows = len(row_args[0])
    rounds = max(calls * head_rows // num_rows // 4, 1)  # a quarter of the int16 parts' rows: each costs more
    rows = []
    for entries in ("stored", "dropped"):
        if entries == "dropped":
            store.counts[:] = 0
        key = best_of(lambda: _key_scores(calls, k_parts, thr_k, qi, qscale, s, acc)) / calls * 1e9
        value = best_of(lambda: _values(calls, v_parts, thr_v, w, out)) / calls * 1e9
        row = best_of(lambda: _sampled_rows(rounds, row_parts, *row_args)) / rounds / num_rows * 1e9
        rows.append({"sparse_entries": entries, "key_scores_ns_per_row": key / head_rows,
                     "values_ns_per_row": value / head_rows, "both_ns_per_row": (key + value) / head_rows,
                     "sampled_row_ns": row})
        print(f"sparse entries {entries}: key scores {key / head_rows:.2f} ns a kv-head's row, values "
              f"{value / head_rows:.2f}, a sampled row decoded {row:.2f}", flush=True)
    print(f"\n{args.shape}: {kv_heads} kv-heads of {head_dim}, {heads} query heads, {args.blocks} blocks of {BLOCK} "
          "rows, one thread; ns per kv-head's row")
    print_table(rows, ["sparse_entries", "key_scores_ns_per_row", "values_ns_per_row", "both_ns_per_row", "sampled_row_ns"])
    print(f"wrote {write_json(args.out, {'machine': machine(), 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
