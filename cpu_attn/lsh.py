"""MagicPIG sampled attention over the Oaken store (issue #4): LSH hash tables, retrieval of the
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
e^s. Both go through the same online softmax, so merging them is exact log-sum-exp arithmetic.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from cpu_attn.kernels import attend_scores, block_scores
from cpu_attn.llvm_ir import _FAST, load_u32, prefetch
from cpu_attn.softmax import attend_begin, attend_end
from cpu_attn.oaken import SEGMENT, add_key_center, load_block, load_row, row_entries

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


def sampled_scratch(work: int, group: int, block_size: int, head_dim: int, capacity: int) -> tuple[np.ndarray, ...]:
    """s, sc, kb, cb, vb, m, l, count, marks, cand, entries for `work` (sequence, kv-head) items."""
    f32 = np.float32
    return (np.empty((work, group, block_size), f32), np.empty((work, group, block_size), f32),
            *(np.empty((work, block_size, head_dim), f32) for _ in range(3)),
            np.empty((work, group), f32), np.empty((work, group), f32),
            np.zeros((work, capacity), np.uint8), np.zeros((work, capacity), np.uint8),
            np.empty((work, (group + 1) * capacity), np.int64), np.empty((work, max(ROWS_AHEAD, block_size), 2), np.int64))


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


@njit(cache=True, nogil=True, inline="always")
def _center_rows(k_center, kvh, pos0, width, cb):
    """cb[t] = the key center turned to position pos0 + t, for t < width (rows of one block)."""
    for t in range(width):
        cb[t, :] = 0.0
    add_key_center(cb, pos0, width, k_center, kvh)


@njit(cache=True, nogil=True, inline="always")
def _attend_range(q, q_turned, k_parts, v_parts, thr_k, thr_v, k_center, kvh, table, first_seg, lo, hi, scale, s, sc,
                  kb, cb, vb, acc, m, l):
    """Exact attention of the group's queries over positions [lo, hi) of one kv-head: the keys as
    stored (q_turned) plus their centers (q), see sampled_decode_attention."""
    bs = k_parts[0].shape[1]
    if hi <= lo:
        return
    centered = k_center[1].shape[0] > 0
    for j in range(lo // bs, (hi + bs - 1) // bs):
        block = table[j]
        start, end = max(lo - j * bs, 0), min(hi - j * bs, bs)
        load_block(k_parts, block, thr_k, first_seg, end, kb)
        load_block(v_parts, block, thr_v, first_seg, end, vb)
        block_scores(q_turned, kb[start:], end - start, scale, s)
        if centered:
            _center_rows(k_center, kvh, j * bs, end, cb)
            block_scores(q, cb[start:], end - start, scale, sc)
            s[:, :end - start] += sc[:, :end - start]
        attend_scores(s, vb[start:], end - start, acc, m, l)


ROWS_AHEAD = 64
"""Sampled rows whose lines sampled_decode_attention requests together before decoding them
(rounded down to whole block_size chunks, at least one)."""


@njit(cache=True, nogil=True, inline="always")
def _prefetch_rows(k_parts, v_parts, k_center, table, positions, first_seg, entries):
    """Start loading every line load_row and add_key_center will read for the K and V rows at
    `positions`, all rows' at once so their misses overlap (row by row, the decoder waits on each
    one in turn): first each row's nibbles, scales and counts and its key's cos and sin rows, then,
    its block's counts having arrived meanwhile, where its sparse entries start (kept in
    entries [n, 2] for K and V) and their line."""
    bs = k_parts[0].shape[1]
    cos, sin = k_center[1], k_center[2]
    for pos in positions:
        j, offset = pos // bs, pos % bs
        block = table[j]
        if cos.shape[0]:  # a key's turned center: its block start's rows of the cos and sin tables
            for d in range(0, cos.shape[1], 16):
                prefetch(cos, (j, d))
                prefetch(sin, (j, d))
        for parts in (k_parts, v_parts):
            prefetch(parts[0], (block, offset, first_seg * (SEGMENT // 2)))
            prefetch(parts[1], (block, offset, 0))
            prefetch(parts[2], (block, offset, 0))
    for i in range(positions.shape[0]):
        block, offset = table[positions[i] // bs], positions[i] % bs
        entries[i, 0] = row_entries(k_parts[2][block], offset)
        entries[i, 1] = row_entries(v_parts[2][block], offset)
        prefetch(k_parts[3], (block, entries[i, 0]))
        prefetch(v_parts[3], (block, entries[i, 1]))


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def sampled_decode_attention(q, q_turned, r, r_turned, r_norm, r_mu, r_codes, k_parts, v_parts, thr_k, thr_v, k_center,
                             block_tables, seq_lens, set_of, indexed, offsets, ids, norms, log_u, num_sinks, window,
                             min_hits, scale, out, lse, touched, s, sc, kb, cb, vb, m, l, count, marks, cand, entries):
    """One query token per sequence: exact attention over the sinks [0, num_sinks) and the tail
    [max(indexed, n - window), n), importance-sampled attention over the rest. The tail also
    takes in the last block (with window < block_size): a block still filling lives in full
    precision, and sampled rows are read by load_row, which only decodes quantized blocks.

    q [B, Hq, D] float32 in the store's key space (already times key_scale); r [B, Hkv * R, D] the
    queries that were hashed, in the same space, R per kv-head: R = group (each head retrieves
    its own keys; r is q) or R = 1 (the group's heads share one retrieval by their mean query);
    q_turned, r_turned the same turned by the store's rotation (as its keys are; q and r where it
    does not rotate); r_norm [B, Hkv * R] norms of the true hashed queries and r_mu their dot
    products with the keys' center for LSH; r_codes [B, Hkv * R, L] int32; k_parts, v_parts,
    thr_k, thr_v as in oaken_decode_attention (with tails, and the keys' centers k_center:
    oaken.add_key_center); set_of [B, Hkv, 2] the range [first, end) of each item's table sets,
    indexed [S] keys in each set, offsets [S, L, 2^K + 1], ids [S, L, >= bytes] (packed for
    indexed[S] keys), norms [S, >= indexed] each key's |k - mu| as hashed (true keys); log_u
    [LOG_U_POINTS] (log_u_table of the same K, L and min_hits, the collisions a key needs to be
    retrieved). Writes out [B, Hq, D] (in the store's value space, turned), lse [B, Hq] and
    touched [B, Hq] (keys sampled per query head).
    Scratch per (sequence, kv-head) item W: s, sc [W, group, bs], kb, cb, vb [W, bs, D], m, l [W, group],
    count, marks [W, cap] uint8 zeros, cand [W, (group + 1) * cap] int64, cap >= the keys an item indexes,
    entries [W, max(ROWS_AHEAD, bs), 2] int64.

    Each hashed query retrieves its keys; the union of the group's keys is walked in position
    order, block_size rows at a time: rows decoded into kb/vb (the lines of ROWS_AHEAD rows are
    requested together first, _prefetch_rows), then one online-softmax step as in exact
    attention, where a head whose query did not retrieve a key scores it -inf (weight 0). A key
    scores as stored, turned (q_turned . kb), plus its center (q . cb): no row is turned back.
    u comes from the angle between the key and the query that retrieved it (with R = 1 the
    group's mean query, for all its heads)."""
    num_seqs, num_heads, head_dim = q.shape
    bs = k_parts[0].shape[1]
    num_kv_heads = set_of.shape[1]
    group = num_heads // num_kv_heads
    per_head = r.shape[1] == num_heads  # else one shared query per kv-head
    num_r = group if per_head else 1
    centered = k_center[1].shape[0] > 0
    cap = count.shape[1]
    for item in prange(num_seqs * num_kv_heads):
        b, kvh = item // num_kv_heads, item % num_kv_heads
        heads = slice(kvh * group, (kvh + 1) * group)
        first_seg = kvh * head_dim // SEGMENT
        acc = out[b, heads]
        attend_begin(acc, m[item], l[item])
        n = seq_lens[b]
        table = block_tables[b]
        sinks = min(num_sinks, n)
        first_set, end_set = set_of[b, kvh, 0], set_of[b, kvh, 1]
        num_indexed = 0
        for st in range(first_set, end_set):
            num_indexed += indexed[st]
        tail = max(min(num_indexed, n - window, (n - 1) // bs * bs), sinks)  # the last block may still be filling
        for part in range(2):  # the sinks, then the tail
            lo, hi = (0, sinks) if part == 0 else (tail, n)
            _attend_range(q[b, heads], q_turned[b, heads], k_parts, v_parts, thr_k, thr_v, k_center, kvh, table,
                          first_seg, lo, hi, scale, s[item], sc[item], kb[item], cb[item], vb[item], acc, m[item],
                          l[item])
        num, heads_of, union = 0, marks[item], cand[item, group * cap:]
        for g in range(num_r):
            h = kvh * num_r + g
            mine = cand[item, g * cap:(g + 1) * cap]
            found, base = 0, 0
            for st in range(first_set, end_set):
                if base < tail:
                    found += collect_candidates(r_codes[b, h], offsets[st], ids[st], indexed[st], max(sinks - base, 0),
                                                tail - base, count[item], mine[found:], base, min_hits)
                base += indexed[st]
            for gg in range(group):
                if not per_head or gg == g:
                    touched[b, kvh * group + gg] = found
            for c in range(found):
                heads_of[mine[c]] |= 1 << g
        for pos in range(sinks, tail):  # the union in position order: a branch-free scan beats a sort
            union[num] = pos
            num += heads_of[pos] != 0
        ahead = max(ROWS_AHEAD // bs, 1) * bs
        st, base = first_set, 0  # the table set of the row at hand (positions rise), for its norm
        for c0 in range(0, num, bs):
            width = min(bs, num - c0)
            if c0 % ahead == 0:
                _prefetch_rows(k_parts, v_parts, k_center, table, union[c0:min(c0 + ahead, num)], first_seg, entries[item])
            for t in range(width):
                pos, e = union[c0 + t], entries[item, (c0 + t) % ahead]
                load_row(k_parts, table[pos // bs], thr_k, first_seg, pos % bs, e[0], kb[item, t])
                load_row(v_parts, table[pos // bs], thr_v, first_seg, pos % bs, e[1], vb[item, t])
                if centered:
                    _center_rows(k_center, kvh, pos, 1, cb[item, t:t + 1])
            block_scores(q_turned[b, heads], kb[item], width, 1.0, s[item])  # q . k, unscaled
            if centered:
                block_scores(q[b, heads], cb[item], width, 1.0, sc[item])
                s[item, :, :width] += sc[item, :, :width]
            for t in range(width):
                pos = union[c0 + t]
                while pos >= base + indexed[st]:
                    base += indexed[st]
                    st += 1
                norm_c = max(norms[st][pos - base], np.float32(1e-30))
                shared_log_u = np.float32(0.0)
                if not per_head:  # every head weighs the row by the shared query's u
                    dot = np.float32(0.0)
                    for d in range(head_dim):
                        dot += r_turned[b, kvh, d] * kb[item, t, d]
                    if centered:
                        for d in range(head_dim):
                            dot += r[b, kvh, d] * cb[item, t, d]
                    shared_log_u = _log_u(log_u, (dot - r_mu[b, kvh]) / max(r_norm[b, kvh] * norm_c, np.float32(1e-30)))
                for g in range(group):  # a head whose query did not retrieve the row gives it weight 0, at no cost
                    dot = s[item, g, t]
                    s[item, g, t] = -np.inf
                    if heads_of[pos] & (1 << (g if per_head else 0)):
                        h = kvh * group + g
                        if per_head:
                            cos = (dot - r_mu[b, h]) / max(r_norm[b, h] * norm_c, np.float32(1e-30))
                            s[item, g, t] = dot * scale - _log_u(log_u, cos)
                        else:
                            s[item, g, t] = dot * scale - shared_log_u
                heads_of[pos] = 0
            attend_scores(s[item], vb[item], width, acc, m[item], l[item])
        attend_end(acc, m[item], l[item], lse[b, heads])
