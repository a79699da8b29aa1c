"""Decode attention per layer over each KV format, side by side in one run, against torch SDPA
on contiguous fp32 KV, with the machine's two limits measured in the same run.

    python -m benchmarks.bench_decode_attn [--batch 1 4 8 16] [--context 1024 4096 8192 16384 32768]
                                           [--shape smollm2-135m | llama-3.1-8b]

For every (context, batch): ms per layer for the Oaken, fp16 and fp32 paged kernels and for
SDPA, and for a speculative verify step over the fp16 KV (5 rows a sequence; its time over the
one-row decode's); bytes each kernel reads; achieved GB/s and GFLOP/s (4 * D flops per query head
and context token: q.k and p.v); the bound each limit sets (bytes / bandwidth, flops / FMA rate)
and which one binds. Oaken's K/V are real SmolLM2 statistics (Gaussian with a heavy channel,
thresholds at the default group shares), so its sparse share is that of the defaults; `oaken` is the store as
served: keys centered on a pre-RoPE mean turned to each key's position (added back in the score
domain), K and V turned by the Hadamard rotation (queries turned, outputs turned back);
`oaken_nocenter` does neither (their cost). One layer of SmolLM2-135M's shape (9 / 3 heads of 64) by
default; `--shape llama-3.1-8b` takes 32 / 8 heads of 128.
"""
from __future__ import annotations

import argparse
import time
from statistics import NormalDist

import numpy as np
import torch
import torch.nn.functional as F
from numba import get_num_threads, njit, prange

from benchmarks.common import machine, print_table, write_json
from cpu_attn.calibrate import INNER_RATIO, OUTER_RATIO, hadamard
from cpu_attn.kv_store import OakenKVStore, PagedKVStore

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M, one layer
DRAFTS = 4  # a verify step's draft rows a sequence (speculative decoding's default)
SHAPES = {"smollm2-135m": (HEADS, KV_HEADS, HEAD_DIM), "llama-3.1-8b": (32, 8, 128)}  # query, kv-heads, head_dim


def gaussian_thresholds(outer: float, inner: float) -> np.ndarray:
    """The thresholds that put `outer` and `inner` of a unit Gaussian's values in those groups."""
    z = NormalDist().inv_cdf
    return np.array([z(outer / 2), z(0.5 - inner / 2), z(0.5 + inner / 2), z(1 - outer / 2)], np.float32)


THR = gaussian_thresholds(OUTER_RATIO, INNER_RATIO)  # the default group shares


@njit(parallel=True, cache=True, fastmath=True)
def _parallel_sum(a):
    n = a.shape[0]
    chunk = (n + 63) // 64
    parts = np.zeros(64)
    for c in prange(64):
        s = 0.0
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            s += a[i]
        parts[c] = s
    return parts.sum()


@njit(parallel=True, cache=True, fastmath=True)
def _fma_loop(x, y, reps):
    """Per thread: reps passes of acc = acc * x + y over 16 rows of 64 floats (L1-resident, like
    the kernel's inner loops). Each step depends on the last, so the compiler cannot fold the
    passes together (a plain acc += x * y gets hoisted and reports impossible rates)."""
    out = np.zeros(x.shape[0], np.float32)
    for t in prange(x.shape[0]):
        acc = np.zeros(64, np.float32)
        for _ in range(reps):
            for r in range(16):
                for d in range(64):
                    acc[d] = acc[d] * x[t, r, d] + y[t, r, d]
        out[t] = acc.sum()
    return out


def limits() -> dict:
    """Memory read bandwidth and two FMA rates: the streaming loop above (operands loaded from L1,
    as in the kernels' inner loops: the bound the table's `binds` column uses) and float32 matrix
    multiply by torch (the BLAS SDPA runs on; operands in registers: the CPU's FMA peak, ~3x the
    loop's on an AVX-512 Xeon). Not NumPy's BLAS: its threads spin on after a call and slowed the
    SDPA timed next 100x."""
    a = np.ones(2**30 // 8)
    _parallel_sum(a[:1024])
    read = min(_timed(lambda: _parallel_sum(a)) for _ in range(3))
    threads = get_num_threads()
    x = np.full((threads * 4, 16, 64), 0.999, np.float32)
    y = np.full_like(x, 1e-3)
    reps = 20000
    _fma_loop(x, y, 1)
    fma = min(_timed(lambda: _fma_loop(x, y, reps)) for _ in range(3))
    m = torch.from_numpy(np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32))
    m @ m
    gemm = min(_timed(lambda: m @ m) for _ in range(3))
    return {"threads": threads, "read_gb_s": a.nbytes / read / 1e9,
            "fma_gflop_s": 2 * x.size * reps / fma / 1e9, "sgemm_gflop_s": 2 * 2048**3 / gemm / 1e9,
            "sgemm_threads": torch.get_num_threads()}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_of(fn, budget_s: float = 1.5, most: int = 10) -> float:
    fn()
    times, t0 = [], time.perf_counter()
    while len(times) < most and (len(times) < 2 or time.perf_counter() - t0 < budget_s):
        times.append(_timed(fn))
    return min(times)


def fill(store, rng, batch: int, context: int) -> np.ndarray:
    """Random K/V with a heavy key channel per head, written through store.write; returns tables."""
    blocks = -(-context // BLOCK)
    tables = rng.permutation(batch * blocks).astype(np.int32).reshape(batch, blocks)
    pos = np.arange(context)
    for b in range(batch):
        slots = (tables[b][pos // BLOCK] * BLOCK + pos % BLOCK).astype(np.int64)
        for s in range(0, context, 4096):
            k = rng.standard_normal((len(slots[s:s + 4096]), store.num_kv_heads, store.head_dim)).astype(np.float32)
            k[:, :, 5] *= 3
            store.write(0, slots[s:s + 4096], k, rng.standard_normal(k.shape).astype(np.float32), pos[s:s + 4096])
    return tables


def served_oaken(num_blocks: int, rng, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
                 recent_blocks: int = 0) -> OakenKVStore:
    """One layer's Oaken store as served: keys centered on a pre-RoPE mean turned to each
    position by SmolLM2's RoPE (theta 100000), K and V turned by the Hadamard rotation (and, as
    `hetserve serve` sizes them, a full-precision tail per running sequence: recent_blocks)."""
    return OakenKVStore(1, kv_heads, head_dim, BLOCK, num_blocks, np.tile(THR, (1, 2, 1)), recent_blocks=recent_blocks,
                        key_bias=rng.uniform(-1, 1, (1, kv_heads * head_dim)).astype(np.float32),
                        rope_inv_freq=100000.0 ** -(np.arange(head_dim // 2) * 2 / head_dim),
                        rotation=hadamard(head_dim))


def oaken_bytes(store: OakenKVStore, tables: np.ndarray, context: int) -> int:
    """What the Oaken kernel reads: dense, scales, counts of every token and the used sparse entries."""
    per_token = store.dense.shape[-1] + 2 * 3 + store.counts.shape[-1]
    used = sum(int(store.counts[0, :, t].sum()) for t in tables.ravel())  # over K and V
    return 2 * len(tables) * context * per_token + used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="one layer of this model's heads")
    ap.add_argument("--out", default="decode_attn.json")
    args = ap.parse_args()
    heads, kv_heads, head_dim = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    lim = limits()
    scale = head_dim**-0.5
    rows = []
    for context in args.context:
        for batch in args.batch:
            lens = np.full(batch, context, np.int32)
            q = rng.standard_normal((batch, heads, head_dim)).astype(np.float32)
            flops = 4 * head_dim * heads * context * batch
            num_blocks = batch * -(-context // BLOCK)
            row = {"context": context, "batch": batch}
            fp32 = PagedKVStore(1, kv_heads, head_dim, BLOCK, num_blocks, "float32")
            tables = fill(fp32, rng, batch, context)
            k, v = (torch.from_numpy(np.stack([fp32.gather(0, t, context)[i] for t in tables]).transpose(0, 2, 1, 3).copy())
                    for i in (0, 1))  # contiguous [B, Hkv, S, D]: SDPA's best case
            qt = torch.from_numpy(q)[:, :, None]
            with torch.inference_mode():
                sdpa = best_of(lambda: F.scaled_dot_product_attention(qt, k, v, enable_gqa=True))
            del k, v
            stores = {"fp32": (fp32, tables)}
            fp16 = PagedKVStore(1, kv_heads, head_dim, BLOCK, num_blocks, "float16")
            stores["fp16"] = (fp16, fill(fp16, rng, batch, context))
            # as served: keys centered on a pre-RoPE mean turned to each position (SmolLM2's RoPE)
            # one more block per sequence to append to
            oak = served_oaken(num_blocks + batch, rng, kv_heads, head_dim, recent_blocks=batch)
            stores["oaken"] = (oak, fill(oak, rng, batch, context))
            plain = OakenKVStore(1, kv_heads, head_dim, BLOCK, num_blocks, np.tile(THR, (1, 2, 1)))
            stores["oaken_nocenter"] = (plain, fill(plain, rng, batch, context))
            for name, (store, tabs) in stores.items():
                t = best_of(lambda: store.decode_attention(0, q, tabs, lens, scale))
                nbytes = oaken_bytes(store, tabs, context) if name.startswith("oaken") else \
                    2 * batch * context * kv_heads * head_dim * store.k.itemsize
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_gb_s"] = nbytes / t / 1e9
                row[f"{name}_mb"] = nbytes / 1e6
            # a verify step of speculative decoding: 1 + DRAFTS rows a sequence over the same fp16 KV
            n = 1 + DRAFTS
            qv = rng.standard_normal((batch * n, heads, head_dim)).astype(np.float32)
            first, count = np.arange(0, batch * n, n, dtype=np.int32), np.full(batch, n, np.int32)

            def verify():
                return fp16.verify_attention(0, qv, stores["fp16"][1], lens - DRAFTS, first, count, scale)

            row["fp16_verify_ms"] = 1e3 * best_of(verify)
            row["verify_vs_decode"] = row["fp16_verify_ms"] / row["fp16_ms"]
            t = row["oaken_ms"] / 1e3
            row["oaken_gflop_s"] = flops / t / 1e9
            row["sdpa_fp32_ms"] = sdpa * 1e3
            row["oaken_vs_sdpa"] = sdpa / t
            bw_bound, fma_bound = row["oaken_mb"] / 1e3 / lim["read_gb_s"], flops / 1e9 / lim["fma_gflop_s"]
            row["binds"] = "memory" if bw_bound > fma_bound else "fma"
            row["oaken_vs_bound"] = t / max(bw_bound, fma_bound)
            row["oaken_vs_peak"] = t / max(bw_bound, flops / 1e9 / lim["sgemm_gflop_s"])  # against the sgemm rate
            # quantization on append, one decode token per sequence: as served, a block fills in its tail
            # and is quantized when its last row arrives (the mean over a block's 16 steps); and a token
            # quantized at once (into a quantized block: the path of a store without tails)
            new = rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32)
            fresh = num_blocks + np.arange(batch, dtype=np.int64)

            def fill_a_block():
                for i in range(BLOCK):
                    oak.write(0, fresh * BLOCK + i, new, new, np.full(batch, context + i))

            row["append_ms"] = best_of(fill_a_block) * 1e3 / BLOCK
            slots = stores["oaken"][1][:, -1].astype(np.int64) * BLOCK + (context - 1) % BLOCK
            last = np.full(batch, context - 1)
            row["append_now_ms"] = best_of(lambda: oak.write(0, slots, new, new, last)) * 1e3
            for key in ("", "_now"):
                row[f"append{key}_share"] = row[f"append{key}_ms"] / (row[f"append{key}_ms"] + row["oaken_ms"])
            del stores, fp32, fp16, oak, plain
            rows.append(row)
            print(f"context {context} batch {batch}: oaken {row['oaken_ms']:.2f} ms, fp16 {row['fp16_ms']:.2f}, "
                  f"fp32 {row['fp32_ms']:.2f}, sdpa {row['sdpa_fp32_ms']:.2f}", flush=True)
    info = machine()
    print(f"\none layer of {args.shape} (heads {heads}/{kv_heads}, head_dim {head_dim}, block {BLOCK}); "
          f"{lim['threads']} threads: memory read {lim['read_gb_s']:.1f} GB/s, "
          f"Numba FMA {lim['fma_gflop_s']:.1f} GFLOP/s, "
          f"torch sgemm {lim['sgemm_gflop_s']:.1f} GFLOP/s ({lim['sgemm_threads']} threads)")
    cols = ["context", "batch", "oaken_ms", "oaken_nocenter_ms", "fp16_ms", "fp32_ms", "sdpa_fp32_ms", "oaken_vs_sdpa",
            "fp16_verify_ms", "verify_vs_decode",
            "oaken_mb", "oaken_gb_s", "oaken_gflop_s", "binds", "oaken_vs_bound", "oaken_vs_peak", "append_share",
            "append_now_share"]
    print_table(rows, cols)
    print(f"wrote {write_json(args.out, {'machine': info, 'limits': lim, 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
