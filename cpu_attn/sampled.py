"""MagicPIG's sampled decode kernel over the Oaken store: for each (sequence, kv-head),
the keys lsh.py's tables retrieve for a query, importance-weighted (logit s - ln u), merged in one
online softmax with exact attention over the sinks and the local window (see lsh.py for u)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from cpu_attn.kernels import attend_scores, block_scores
from cpu_attn.llvm_ir import _FAST, prefetch
from cpu_attn.softmax import attend_begin, attend_end
from cpu_attn.oaken import SEGMENT, add_key_center, load_block, load_row, row_entries
from cpu_attn.lsh import _log_u, collect_candidates


@njit(cache=True, nogil=True, inline="always")
def _center_rows(k_center, kvh, pos0, width, cb):
    """cb[t] = the key center turned to position pos0 + t, for t < width (rows of one block)."""
    for t in range(width):
        cb[t, :] = 0.0
    add_key_center(cb, pos0, width, k_center, kvh)


class SampledQueries(NamedTuple):
    """A decode step's queries as sampled_decode_attention takes them, in the store's key space (times
    key_scale). R per kv-head: R = group (each head retrieves its own keys; r is q) or R = 1 (the
    group's heads share one retrieval by their mean query)."""
    q: np.ndarray  # [B, Hq, D] float32
    q_turned: np.ndarray  # [B, Hq, D]: q turned by the store's rotation, as its keys are (q where it does not rotate)
    r: np.ndarray  # [B, Hkv * R, D] float32: the queries that were hashed
    r_turned: np.ndarray  # [B, Hkv * R, D]: r turned the same way
    r_norm: np.ndarray  # [B, Hkv * R] float32: norms of the true hashed queries
    r_mu: np.ndarray  # [B, Hkv * R] float32: their dot products with the keys' center for LSH
    r_codes: np.ndarray  # [B, Hkv * R, L] int32: their SimHash codes


class LshTables(NamedTuple):
    """The batch's hash table sets (cpu_attn/lsh.py); offsets, ids and norms may be typed Lists of per-set arrays."""
    set_of: np.ndarray  # [B, Hkv, 2] int64: the range [first, end) of each item's table sets
    indexed: np.ndarray  # [S] int64: keys in each set, the sets of an item in position order
    offsets: np.ndarray  # [S, L, 2^K + 1]: where each bucket's ids start
    ids: np.ndarray  # [S, L, >= bytes]: the buckets' key ids, packed for indexed[S] keys
    norms: np.ndarray  # [S, >= indexed] float32: each key's |k - mu| as hashed (true keys)


class Sampling(NamedTuple):
    """Which keys are exact and which sampled, and how a sampled key is weighed."""
    log_u: np.ndarray  # [LOG_U_POINTS] float32: lsh.log_u_table of the tables' K, L and min_hits
    num_sinks: int  # the first positions, always exact
    window: int  # the last positions, always exact (>= 1: the current token)
    min_hits: int  # tables a key must share a bucket with the query in to be retrieved


class SampledOutputs(NamedTuple):
    """What sampled_decode_attention writes."""
    out: np.ndarray  # [B, Hq, D] float32: over the store's values, turned
    lse: np.ndarray  # [B, Hq] float32: natural log
    touched: np.ndarray  # [B, Hq] int64: keys sampled per query head


class SampledScratch(NamedTuple):
    """sampled_decode_attention's scratch per (sequence, kv-head) item W (sampled_scratch)."""
    s: np.ndarray  # [W, group, bs] float32: scores, then weights
    sc: np.ndarray  # [W, group, bs] float32: the keys' centers' scores
    kb: np.ndarray  # [W, bs, D] float32: K rows decoded
    cb: np.ndarray  # [W, bs, D] float32: their centers
    vb: np.ndarray  # [W, bs, D] float32: V rows decoded
    m: np.ndarray  # [W, group] float32: running max
    l: np.ndarray  # [W, group] float32: running sum
    count: np.ndarray  # [W, cap] uint8, zeros: collisions of each indexed key (left zeroed)
    marks: np.ndarray  # [W, cap] uint8, zeros: the heads that retrieved each key (left zeroed)
    cand: np.ndarray  # [W, (group + 1) * cap] int64: each hashed query's keys, then their union
    entries: np.ndarray  # [W, max(ROWS_AHEAD, bs), 2] int64: where sampled rows' K and V entries start


@njit(cache=True, nogil=True, inline="always")
def _attend_range(q, q_turned, k_parts, v_parts, k_center, kvh, table, lo, hi, scale, s, sc, kb, cb, vb, acc, m, l):
    """Exact attention of the group's queries (q, q_turned [group, D]) over positions [lo, hi) of one
    kv-head: the keys as stored (q_turned) plus their centers (q), see sampled_decode_attention. The
    item's scratch and states come as arrays, not a record: written through a record built in the
    parallel loop, they would lose writes (oaken/records.py)."""
    bs = k_parts[0].shape[1]
    first_seg = kvh * q.shape[1] // SEGMENT
    if hi <= lo:
        return
    centered = k_center[1].shape[0] > 0
    for j in range(lo // bs, (hi + bs - 1) // bs):
        block = table[j]
        start, end = max(lo - j * bs, 0), min(hi - j * bs, bs)
        load_block(k_parts, block, first_seg, end, kb)
        load_block(v_parts, block, first_seg, end, vb)
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
def sampled_decode_attention(queries, k_parts, v_parts, k_center, block_tables, seq_lens, scale, tables, sampling,
                             outputs, scratch):
    """One query token per sequence: exact attention over the sinks [0, num_sinks) and the tail
    [max(indexed, n - window), n), importance-sampled attention over the rest. The tail also
    takes in the last block (with window < block_size): a block still filling lives in full
    precision, and sampled rows are read by load_row, which only decodes quantized blocks.

    queries: SampledQueries; k_parts, v_parts: one layer's K and V (oaken.OakenParts); k_center:
    oaken.KeyCenter (oaken.add_key_center); tables: LshTables; sampling: Sampling; outputs:
    SampledOutputs (written); scratch: SampledScratch, cap >= the keys an item indexes, count and
    marks zeros (and left so); records as plain tuples (oaken/records.py). block_tables,
    seq_lens, scale as in paged_decode_attention.

    Each hashed query retrieves its keys; the union of the group's keys is walked in position
    order, block_size rows at a time: rows decoded into kb/vb (the lines of ROWS_AHEAD rows are
    requested together first, _prefetch_rows), then one online-softmax step as in exact
    attention, where a head whose query did not retrieve a key scores it -inf (weight 0). A key
    scores as stored, turned (q_turned . kb), plus its center (q . cb): no row is turned back.
    u comes from the angle between the key and the query that retrieved it (with R = 1 the
    group's mean query, for all its heads)."""
    q, q_turned, r, r_turned, r_norm, r_mu, r_codes = queries  # read only: unpacked (oaken/records.py)
    set_of, indexed, offsets, ids, norms = tables
    log_u, num_sinks, window, min_hits = sampling
    out = outputs[0]  # written: by index, one statement each
    lse = outputs[1]
    touched = outputs[2]
    s = scratch[0]
    sc = scratch[1]
    kb = scratch[2]
    cb = scratch[3]
    vb = scratch[4]
    m = scratch[5]
    l = scratch[6]
    count = scratch[7]
    marks = scratch[8]
    cand = scratch[9]
    entries = scratch[10]
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
            _attend_range(q[b, heads], q_turned[b, heads], k_parts, v_parts, k_center, kvh, table, lo, hi, scale,
                          s[item], sc[item], kb[item], cb[item], vb[item], acc, m[item], l[item])
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
                _prefetch_rows(k_parts, v_parts, k_center, table, union[c0:min(c0 + ahead, num)], first_seg,
                               entries[item])
            for t in range(width):
                pos, e = union[c0 + t], entries[item, (c0 + t) % ahead]
                load_row(k_parts, table[pos // bs], first_seg, pos % bs, e[0], kb[item, t])
                load_row(v_parts, table[pos // bs], first_seg, pos % bs, e[1], vb[item, t])
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


def sampled_scratch(work: int, group: int, block_size: int, head_dim: int, capacity: int) -> SampledScratch:
    """SampledScratch for `work` (sequence, kv-head) items that index up to `capacity` keys each."""
    f32 = np.float32
    return SampledScratch(np.empty((work, group, block_size), f32), np.empty((work, group, block_size), f32),
                          *(np.empty((work, block_size, head_dim), f32) for _ in range(3)),
                          np.empty((work, group), f32), np.empty((work, group), f32),
                          np.zeros((work, capacity), np.uint8), np.zeros((work, capacity), np.uint8),
                          np.empty((work, (group + 1) * capacity), np.int64),
                          np.empty((work, max(ROWS_AHEAD, block_size), 2), np.int64))
