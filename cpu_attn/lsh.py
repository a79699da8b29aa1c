"""MagicPIG sampled attention over the Oaken store: LSH hash tables, retrieval of the
keys that collide with a query in at least m of L tables (served: 3 of 300; MagicPIG: 2 of 150),
and the importance-sampled estimator merged with exact attention over the sinks and the local window.

Codes come from gpu_model/lsh.py (keys centered on their mean prefill key, queries as they are).
A table set holds up to MAX_KEYS keys in CSR form:
    offsets [L, 2^K + 1] uint16  bucket b of table t holds the ids at indices
                                 offsets[t, b] .. offsets[t, b + 1] - 1 of table t
    ids     [L, bytes] uint8     keys (0 = the set's first), ascending within a bucket, each packed
                                 in id_bits(n) = ceil(log2 n) bits (13 for 8k keys) as one
                                 little-endian bit string per table, padded to whole uint64 words plus one
That is id_bits(n) / 8 bytes per key and table (at most 2), plus the offsets (2 * L * 2^K bytes
per set). A (sequence, layer, kv-head) indexes its first keys in consecutive sets, each full but
the last: positions 0 .. MAX_KEYS - 1 in the first, MAX_KEYS .. in the second, and so on.

A key collides with the query in one table with probability p^K, p = 1 - angle / pi, so it is
retrieved (>= m of L tables; MagicPIG's m = 2) with probability
    u = P(Binomial(L, p^K) >= m)    (m = 2: 1 - (1 - p^K)^L - L p^K (1 - p^K)^(L - 1)).
A larger m with more tables keeps the likely keys (u near 1 at high similarity) and drops more of
the many dissimilar ones, whose weights e^s are small.
A retrieved key enters the softmax with weight e^s / u, i.e. with logit s - ln u, which is the
self-normalized importance-sampling estimator; sinks and the local window enter with weight
e^s. Both go through the same online softmax, so merging them is exact log-sum-exp arithmetic
(the kernel: sampled.py).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from cpu_attn.llvm_ir import load_u32, prefetch

MAX_KEYS = 65535  # keys one table set can index (uint16 offsets, ids of <= 16 bits); longer contexts take more sets
LOG_U_POINTS = 4097  # grid over cos(angle) in [-1, 1]
_LOG_U_FLOOR = -80.0


def inclusion_probability(cos: np.ndarray, k: int, l: int, m: int = 2) -> np.ndarray:
    """u for cos(angle(q, k)) (float64, exact formula; the kernel interpolates log_u_table)."""
    p = 1 - np.arccos(np.clip(cos, -1, 1)) / np.pi
    pk = np.asarray(p**k, np.float64)
    miss = np.zeros_like(pk)  # P(fewer than m collisions) = sum over j < m of C(L, j) pk^j (1 - pk)^(L - j)
    for j in range(m):
        miss += math.comb(l, j) * pk**j * (1 - pk) ** (l - j)
    return 1 - miss


def log_u_table(k: int, l: int, m: int = 2) -> np.ndarray:
    """ln u on LOG_U_POINTS evenly spaced cos values from -1 to 1, float32, floored at -80."""
    u = inclusion_probability(np.linspace(-1, 1, LOG_U_POINTS), k, l, m)
    return np.maximum(np.log(np.maximum(u, 1e-300)), _LOG_U_FLOOR).astype(np.float32)


@njit(cache=True, nogil=True, inline="always")
def _log_u(table, cos):
    x = (min(max(cos, np.float32(-1.0)), np.float32(1.0)) + 1) * np.float32((table.shape[0] - 1) / 2)
    i = min(int(x), table.shape[0] - 2)
    f = x - i
    return table[i] + f * (table[i + 1] - table[i])


@njit(cache=True, nogil=True)
def id_bits(num_keys):
    """Bits per packed id in a set of num_keys keys (ids 0 .. num_keys - 1; at least 1)."""
    bits = 1
    while (1 << bits) < num_keys:
        bits += 1
    return bits


def empty_ids(num_tables: int, num_keys: int) -> np.ndarray:
    """Zeroed packed ids for a set of num_keys keys: [L, bytes] uint8, bytes a multiple of 8 with at
    least 8 spare (get_id reads 4 bytes at an id's first; merge_tables reads rows as uint64 words,
    one past the last)."""
    return np.zeros((num_tables, _id_row_bytes(num_keys)), np.uint8)


def _id_row_bytes(num_keys: int) -> int:
    return 8 * ((num_keys * id_bits(num_keys) + 63) // 64 + 1)


def table_arrays(count: int, num_tables: int, num_buckets: int, num_keys: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`count` pairs of (offsets [L, num_buckets + 1] uint16, zeroed ids as empty_ids(L, num_keys)),
    carved from one zeroed buffer. A lookup reads one random line of both arrays in each of its L
    tables. Apart, a set's arrays (0.6 and 3.8 MB at 8k keys, L 300) stay under the 4 MiB from which
    NumPy asks Linux for 2 MiB pages, and those reads miss the TLB; a (sequence, layer)'s kv-heads
    together are over it (lookups at 16 x 8k: ~18 % faster)."""
    offset_bytes = num_tables * (num_buckets + 1) * 2
    ids_at = offset_bytes + -offset_bytes % 64  # the ids on a cache line of their own
    stride = ids_at + num_tables * _id_row_bytes(num_keys)
    buf = np.zeros(count * stride, np.uint8)
    return [(buf[at:at + offset_bytes].view(np.uint16).reshape(num_tables, -1),
             buf[at + ids_at:at + stride].reshape(num_tables, -1)) for at in range(0, count * stride, stride)]


@njit(cache=True, nogil=True, inline="always")
def get_id(row, i, bits):
    """Id i of a packed table row: one unaligned 32-bit little-endian read at its first byte."""
    at = i * bits
    return np.int64((load_u32(row, at >> 3) >> np.uint32(at & 7)) & np.uint32((1 << bits) - 1))


@njit(cache=True, nogil=True, inline="always")
def put_id(row, i, bits, key):
    """Write id i (< 2^16) of a packed table row whose bits there are still zero."""
    at = i * bits
    p = at >> 3
    word = np.uint32(key) << np.uint32(at & 7)
    row[p] |= np.uint8(word & np.uint32(255))
    row[p + 1] |= np.uint8((word >> np.uint32(8)) & np.uint32(255))
    row[p + 2] |= np.uint8(word >> np.uint32(16))


def unpack_ids(ids: np.ndarray, num_keys: int) -> np.ndarray:
    """Packed ids [L, bytes] of a set of num_keys keys -> [L, num_keys] int64 (NumPy)."""
    bits = id_bits(num_keys)
    at = np.arange(num_keys, dtype=np.int64) * bits
    word = sum(ids[:, (at >> 3) + j].astype(np.int64) << (8 * j) for j in range(4))
    return (word >> (at & 7)) & ((1 << bits) - 1)


def table_set(codes: np.ndarray, k: int, out: tuple[np.ndarray, np.ndarray] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """Hash tables of keys 0..N-1 from their codes [N, L] -> offsets [L, 2^K + 1] uint16,
    packed ids [L, bytes] uint8 (into `out`, from table_arrays, when given)."""
    n, num_tables = codes.shape
    if n > MAX_KEYS:
        raise ValueError(f"a table set holds at most {MAX_KEYS} keys (uint16 offsets), not {n}")
    offsets, ids = out if out is not None else table_arrays(1, num_tables, 2**k, n)[0]
    build_tables(np.ascontiguousarray(codes, np.int32), 2**k, offsets, ids)
    return offsets, ids


@njit(cache=True, nogil=True, parallel=True)
def build_tables(codes, num_buckets, offsets, ids):
    """codes [N, L] int32 of keys 0..N-1 -> offsets [L, num_buckets + 1], ids [L, bytes] zeroed,
    packed at id_bits(N) (counting sort per table, tables in parallel)."""
    n = codes.shape[0]
    bits = id_bits(n)
    for t in prange(codes.shape[1]):
        offsets[t, :] = 0
        for i in range(n):
            offsets[t, codes[i, t] + 1] += 1
        for b in range(num_buckets):
            offsets[t, b + 1] += offsets[t, b]
        fill = offsets[t, :num_buckets].copy()
        for i in range(n):
            b = codes[i, t]
            put_id(ids[t], fill[b], bits, i)
            fill[b] += 1


@njit(cache=True, nogil=True, parallel=True)
def merge_tables(offsets, ids, num_old, codes, new_offsets, new_ids):
    """Add keys num_old .. num_old + len(codes) - 1 (codes [M, L]) to tables that hold keys
    0..num_old-1 -> new_offsets, new_ids (zeroed, empty_ids(L, num_old + M)); old ids are copied
    bucket by bucket, so buckets stay ascending and no key's code has to be kept. O(L * (N + 2^K)).
    While the id width stays (all merges but one per doubling of the set), the old ids of the
    buckets between two that gain keys move as one bit string, 64 bits at a time."""
    num_buckets = offsets.shape[1] - 1
    old_bits, bits = id_bits(num_old), id_bits(num_old + codes.shape[0])
    for t in prange(codes.shape[1]):
        new_offsets[t, :] = 0
        for i in range(codes.shape[0]):
            new_offsets[t, codes[i, t] + 1] += 1
        for b in range(num_buckets):
            new_offsets[t, b + 1] += new_offsets[t, b] + offsets[t, b + 1] - offsets[t, b]
        fill = new_offsets[t, :num_buckets].astype(np.int64)
        if old_bits == bits:
            src, dst = ids[t].view(np.uint64), new_ids[t].view(np.uint64)
            run = 0  # first bucket of the run of old ids that keeps one shift
            for b in range(num_buckets):
                old = np.int64(offsets[t, b + 1]) - np.int64(offsets[t, b])
                if new_offsets[t, b + 1] - new_offsets[t, b] != old or b == num_buckets - 1:
                    lo, hi = np.int64(offsets[t, run]), np.int64(offsets[t, b + 1])
                    _copy_bits(src, lo * bits, dst, fill[run] * bits, (hi - lo) * bits)
                    fill[b] += old
                    run = b + 1
        else:
            for b in range(num_buckets):
                for i in range(offsets[t, b], offsets[t, b + 1]):
                    put_id(new_ids[t], fill[b], bits, get_id(ids[t], i, old_bits))
                    fill[b] += 1
        for i in range(codes.shape[0]):
            b = codes[i, t]
            put_id(new_ids[t], fill[b], bits, num_old + i)
            fill[b] += 1


@njit(cache=True, nogil=True, inline="always")
def _copy_bits(src, at, dst, to, n):
    """OR n bits of the little-endian bit string src (uint64 words, one spare) from bit `at` into
    dst (zero there) from bit `to`: one word of dst per step."""
    end = to + n
    while to < end:
        r = to & 63
        take = min(64 - r, end - to)
        i, shift = at >> 6, np.uint64(at & 63)
        word = src[i] >> shift
        if shift:
            word |= src[i + 1] << (np.uint64(64) - shift)
        if take < 64:
            word &= (np.uint64(1) << np.uint64(take)) - np.uint64(1)
        dst[to >> 6] |= word << np.uint64(r)
        at += take
        to += take


@njit(cache=True, nogil=True)
def collect_candidates(q_codes, offsets, ids, num_keys, lo, hi, count, cand, base, m=2):
    """Keys in [lo, hi) of one table set (offsets, ids, num_keys) that share the query's bucket in
    >= m tables -> their positions (base + key) in cand[:n]; returns n.
    count: [>= hi] uint8 scratch, all zero on entry and on return.

    Each table costs two dependent misses (bucket offset, then its ids) when the tables are
    larger than the cache: all L offsets are requested first, then all L buckets, so the misses
    overlap instead of coming one after another."""
    for t in range(q_codes.shape[0]):
        prefetch(offsets, (t, q_codes[t]))
    bits = id_bits(num_keys)
    for t in range(q_codes.shape[0]):
        prefetch(ids, (t, (np.int64(offsets[t, q_codes[t]]) * bits) >> 3))
    n = 0
    for t in range(q_codes.shape[0]):
        b = q_codes[t]
        for i in range(offsets[t, b], offsets[t, b + 1]):
            key = get_id(ids[t], i, bits)
            if lo <= key < hi:
                c = count[key] + 1
                count[key] = min(c, m)
                if c == m:
                    cand[n] = base + key
                    n += 1
    count[lo:max(lo, hi)] = 0  # a memset: cheaper than walking the buckets again (0.15 n ids at K 10, L 150)
    return n
