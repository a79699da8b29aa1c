"""Oaken quantization of one token's K (or V) vector: group split, group shift, per-token scales,
fused dense-sparse encoding, and tokens quantized into the paged store's blocks (write_tokens).

Groups, from four calibrated thresholds (cpu_attn/calibrate.py) s_lo < t_lo < t_hi < s_hi:
    outer  x < s_lo or x > s_hi   shifted by the outer threshold on its side   5 bits
    inner  t_lo <= x <= t_hi      not shifted                                  5 bits
    middle everything else        shifted by the inner threshold on its side   4 bits

Every group is sign-magnitude coded with one per-token scale (the shift puts 0 at the group's
edge, so the sign also says which threshold to add back, and no value is ambiguous):
    middle: dense nibble = sign bit | 3-bit magnitude m; step = peak / 8, levels (m + 0.4) * step,
            m = the nearest level. The magnitudes crowd towards the inner threshold, so a level
            at exactly the edge (m * peak / 7) wastes range; these levels are what Lloyd-Max
            finds for SmolLM2's K and V (0.05, 0.16, ..., 0.92 of the peak) and cut the group's
            squared error by ~24 %. Levels at the middle of each step, (m + 1/2) * step, sit
            above Lloyd-Max's (magnitudes biased outwards) and cost +1.15 % perplexity in eval
    inner / outer: dense nibble = 4-bit magnitude = round(y / step), step = peak / 15; the sign
            lives in the sparse entry

Layout of one token (C = num_kv_heads * head_dim values, split in 64-wide segments):
    dense  [C / 2] uint8   two nibbles per byte: in each 64-wide segment, byte j holds value j
                           (low nibble) and value j + 32 (high nibble), so unpacking stores
                           two contiguous runs of 32 and vectorizes
    sparse [C] uint8       one entry per inner/outer value, segment by segment:
                           bits 0-5 index in the segment | bit 6 outer | bit 7 negative
    counts [C / 64] uint8  sparse entries per segm"""
from __future__ import annotations

import numba
import numpy as np
from numba import get_thread_id, njit, prange

from cpu_attn.fp16 import fp16_to_f32
from cpu_attn.llvm_ir import _as_f32, _as_u32

SEGMENT = 64
MIDDLE, INNER, OUTER = 0, 1, 2
MIDDLE_OFFSET = np.float32(0.4)
"""Middle-group levels sit at (m + MIDDLE_OFFSET) * step, step = the token's peak / 8."""


@njit(cache=True, nogil=True)
def round_to_fp16(x):
    """A non-negative scale rounded to the nearest float16 value (ties to even), kept as float32;
    nonzero scales are clamped to float16's normal range [2^-14, 65504]."""
    if x == 0.0:
        return np.float32(0.0)
    x = min(max(np.float32(x), np.float32(2.0**-14)), np.float32(65504.0))
    bits = _as_u32(x)
    bits = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return _as_f32(bits)


@njit(cache=True, nogil=True, inline="always")
def _byte_and_shift(i):
    """Where value i's nibble lives in the dense bytes."""
    return (i // SEGMENT) * (SEGMENT // 2) + i % (SEGMENT // 2), 4 * ((i % SEGMENT) // (SEGMENT // 2))


@njit(cache=True, nogil=True)
def _code(magnitude, scale, max_code, offset):
    """round(magnitude / scale - offset), clamped to [0, max_code]: the nearest level (m + offset) * scale."""
    if scale == 0.0:
        return 0
    return max(min(int(magnitude / scale + (0.5 - offset)), max_code), 0)


@njit(cache=True, nogil=True)
def _demote(x, thr, group, want, which):
    """Move the `want` values of group `which` that lie closest to a middle threshold into the
    middle group (the least error a full sparse budget can cost). Returns how many were moved."""
    s_lo, t_lo, t_hi, s_hi = thr[0], thr[1], thr[2], thr[3]
    idx = np.nonzero(group == which)[0]
    dist = np.empty(idx.shape[0], np.float32)
    for n in range(idx.shape[0]):
        v = x[idx[n]]
        dist[n] = min(t_hi - v, v - t_lo) if which == INNER else (v - s_hi if v > s_hi else s_lo - v)
    moved = min(want, idx.shape[0])
    for n in np.argsort(dist)[:moved]:
        group[idx[n]] = MIDDLE
    return moved


@njit(cache=True, nogil=True)
def quantize_token(x, thr, dense, sparse, counts, scales, shifted, group, peak, max_sparse):
    """x: [C] float32; thr: [4] (s_lo, t_lo, t_hi, s_hi) -> fills dense, sparse, counts, scales
    (scales as float32 already rounded to float16). Returns the number of sparse entries.
    Scratch: shifted [C] float32, group [C] int8, peak [3] float32.

    At most `max_sparse` entries are written (the room left in a store block): beyond it, inner
    values nearest the middle thresholds join the middle group first, then outer ones."""
    s_lo, t_lo, t_hi, s_hi = thr[0], thr[1], thr[2], thr[3]
    num = x.shape[0]
    num_sparse = 0
    for i in range(num):
        v = x[i]
        g = OUTER if v > s_hi or v < s_lo else (INNER if v >= t_lo and v <= t_hi else MIDDLE)
        group[i] = g
        num_sparse += g != MIDDLE
    if num_sparse > max_sparse:
        num_sparse -= _demote(x, thr, group, num_sparse - max_sparse, INNER)
        num_sparse -= _demote(x, thr, group, num_sparse - max_sparse, OUTER)
    peak[:] = 0.0
    middle = np.float32(0.5) * (t_lo + t_hi)
    for i in range(num):  # magnitude from the group's edge; the sign says which edge
        v, g = x[i], group[i]
        if g == OUTER:
            y = v - s_hi if v > s_hi else s_lo - v
            negative = v < s_lo
        elif g == INNER:
            y, negative = abs(v), v < 0
        else:  # demoted inner values sit at their nearest edge (magnitude 0)
            negative = v < middle
            y = max(t_lo - v if negative else v - t_hi, np.float32(0.0))
        shifted[i] = y
        group[i] = g | (4 if negative else 0)
        peak[g] = max(peak[g], y)
    scales[0] = round_to_fp16(peak[0] / np.float32(8.0))
    scales[1] = round_to_fp16(peak[1] / np.float32(15.0))
    scales[2] = round_to_fp16(peak[2] / np.float32(15.0))
    dense[:] = 0
    e = 0
    for seg in range(num // SEGMENT):
        count = 0
        for j in range(SEGMENT):
            i = seg * SEGMENT + j
            g, negative, y = group[i] & 3, group[i] & 4, shifted[i]
            if g == MIDDLE:
                nibble = _code(y, scales[0], 7, MIDDLE_OFFSET) | (8 if negative else 0)
            else:
                nibble = _code(y, scales[g], 15, 0.0)
                sparse[e] = j | (64 if g == OUTER else 0) | (128 if negative else 0)
                e += 1
                count += 1
            byte, shift = _byte_and_shift(i)
            dense[byte] |= nibble << shift
        counts[seg] = count
    return num_sparse


@njit(cache=True, nogil=True)
def dequantize_token(thr, dense, sparse, counts, scales, out):
    """Inverse of quantize_token: out [C] float32."""
    s_lo, t_lo, t_hi, s_hi = thr[0], thr[1], thr[2], thr[3]
    lo_base, hi_base = t_lo - MIDDLE_OFFSET * scales[0], t_hi + MIDDLE_OFFSET * scales[0]  # rounded as decode_token
    for i in range(out.shape[0]):
        byte, shift = _byte_and_shift(i)
        nibble = (dense[byte] >> shift) & 15
        magnitude = np.float32(nibble & 7) * scales[0]
        out[i] = lo_base - magnitude if nibble & 8 else hi_base + magnitude
    e = 0
    for seg in range(counts.shape[0]):
        for _ in range(counts[seg]):
            entry = sparse[e]
            e += 1
            i = seg * SEGMENT + (entry & 63)
            is_negative = entry & 128
            byte, shift = _byte_and_shift(i)
            nibble = (dense[byte] >> shift) & 15
            if entry & 64:
                y = np.float32(nibble) * scales[2]
                out[i] = s_lo - y if is_negative else s_hi + y
            else:
                y = np.float32(nibble) * scales[1]
                out[i] = -y if is_negative else y


@njit(cache=True, nogil=True, parallel=True)
def quantize_rows(x, thr, dense, sparse, counts, scales, num_sparse, shifted, group, peak):
    """x: [T, C] -> dense [T, C/2], sparse [T, C], counts [T, C/64], scales [T, 3], num_sparse [T].
    Per-thread scratch: shifted [threads, C] float32, group [threads, C] int8, peak [threads, 3]."""
    for t in prange(x.shape[0]):
        me = get_thread_id()
        num_sparse[t] = quantize_token(x[t], thr, dense[t], sparse[t], counts[t], scales[t], shifted[me], group[me],
                                       peak[me], x.shape[1])


def quantize(x: np.ndarray, thr: np.ndarray):
    """x: [T, C] float32 with C a multiple of 64 -> (dense, sparse, counts, scales, num_sparse)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % SEGMENT:
        raise ValueError(f"expected [tokens, C] with C a multiple of {SEGMENT}, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("KV values contain NaN or inf; Oaken quantization needs finite values")
    num_tokens, num = x.shape
    dense = np.empty((num_tokens, num // 2), np.uint8)
    sparse = np.zeros((num_tokens, num), np.uint8)
    counts = np.empty((num_tokens, num // SEGMENT), np.uint8)
    scales = np.empty((num_tokens, 3), np.float32)
    num_sparse = np.empty(num_tokens, np.int64)
    threads = numba.config.NUMBA_NUM_THREADS  # scratch rows for every thread id of the pool
    quantize_rows(x, np.asarray(thr, np.float32), dense, sparse, counts, scales, num_sparse,
                  np.empty((threads, num), np.float32), np.empty((threads, num), np.int8),
                  np.empty((threads, 3), np.float32))
    return dense, sparse, counts, scales, num_sparse


def dequantize(thr, dense, sparse, counts, scales) -> np.ndarray:
    out = np.empty((dense.shape[0], dense.shape[1] * 2), np.float32)
    thr = np.asarray(thr, np.float32)
    for t in range(dense.shape[0]):
        dequantize_token(thr, dense[t], sparse[t], counts[t], scales[t], out[t])
    return out


def effective_bits(num_values: int, num_sparse: np.ndarray) -> float:
    """Bits per stored value, every scale, count and sparse entry included."""
    per_token = 4 * num_values + 8 * num_sparse.mean() + 3 * 16 + 8 * (num_values // SEGMENT)
    return float(per_token / num_values)



# ---- the paged store's side: one layer's K (or V) in Oaken form ---------------------------------
#   dense  [num_blocks, block_size, C / 2] uint8
#   scales [num_blocks, block_size, 3]     uint16 (float16 bits: middle, inner, outer)
#   counts [num_blocks, block_size, C/64]  uint8
#   sparse [num_blocks, budget]            uint8, the block's tokens' entries one after another
# A token's entries start after those of the tokens before it in its block (sum of their counts);
# a block holds at most `budget` entries, so its size in bytes is fixed.


@njit(cache=True, nogil=True, inline="always")
def _fp16_bits(x):
    """A float32 that is exactly a normal float16 (or 0), as float16 bits."""
    return np.uint16(0) if x == 0.0 else np.uint16((_as_u32(x) >> np.uint32(13)) - np.uint32(112 << 10))



@njit(cache=True, nogil=True, inline="always")
def row_entries(counts, offset):
    """Where row `offset`'s sparse entries start in its block's budget: the entries of the rows
    before it (counts [bs, C/64] of the block), summed as one run of bytes: as rows of segments
    (a loop of C/64 inside), ~16 ns a row (half of decoding the row) against ~4."""
    e = 0
    for x in counts[:offset].flat:
        e += x
    return e


@njit(cache=True, nogil=True, inline="always")
def _quantize_row(x, thr, dense, scales, counts, sparse, block, offset, used, scale32, shifted, group, peak, me):
    """Quantize one row x [C] (finite) into row `offset` of `block` of a layer's K or V, its sparse entries from
    entry `used` of the block's budget on, with scratch rows `me` (arrays of records.OakenParts and TokenScratch,
    taken by the caller) -> the entries it took."""
    taken = quantize_token(x, thr, dense[block, offset], sparse[block, used:], counts[block, offset], scale32[me],
                           shifted[me], group[me], peak[me], sparse.shape[1] - used)
    for k in range(3):
        scales[block, offset, k] = _fp16_bits(scale32[me, k])
    return taken


@njit(cache=True, nogil=True)
def quantize_into_block(x, parts, block, first, scratch):
    """Quantize rows x [n, C] (finite) into rows first .. first + n - 1 of one block of one layer's K or V
    (parts: records.OakenParts), as write_tokens quantizes a run of them, in scratch's first row (outside a
    parallel loop: get_thread_id needs one)."""
    dense, scales, counts, sparse, thr = parts[0], parts[1], parts[2], parts[3], parts[6]
    shifted, group, peak, scale32 = scratch[0], scratch[1], scratch[2], scratch[3]
    used = row_entries(counts[block], first)
    for r in range(x.shape[0]):
        used += _quantize_row(x[r], thr, dense, scales, counts, sparse, block, first + r, used, scale32, shifted,
                              group, peak, 0)


@njit(cache=True, nogil=True, parallel=True)
def write_tokens(x, slot_mapping, runs, parts, scratch):
    """Quantize rows x [T, C] by its thresholds into their slots of one layer's K or V (parts:
    records.OakenParts, its dense, scales, counts and sparse written); `runs` [R + 1] splits the
    rows into runs that share a block (rows of a run are in position order), runs go in parallel.
    Returns the number of non-finite rows (nothing of those rows is written). scratch:
    records.TokenScratch."""
    dense = parts[0]  # written: by index, one statement each (records.py)
    scales = parts[1]
    counts = parts[2]
    sparse = parts[3]
    thr = parts[6]
    shifted = scratch[0]
    group = scratch[1]
    peak = scratch[2]
    scale32 = scratch[3]
    block_size = dense.shape[1]
    bad = 0
    for r in prange(runs.shape[0] - 1):
        me = get_thread_id()
        block = slot_mapping[runs[r]] // block_size
        used = row_entries(counts[block], slot_mapping[runs[r]] % block_size)
        for row in range(runs[r], runs[r + 1]):
            finite = True
            for i in range(x.shape[1]):
                finite &= np.isfinite(x[row, i])
            if not finite:
                bad += 1
                continue
            used += _quantize_row(x[row], thr, dense, scales, counts, sparse, block, slot_mapping[row] % block_size,
                                  used, scale32, shifted, group, peak, me)
    return bad


@njit(cache=True, nogil=True, parallel=True)
def move_tokens(parts, src, dst, runs, scratch):
    """Move rows of one layer's K or V (parts: records.OakenParts) within the store: row dst[i] becomes what row
    src[i] holds (slots; dst ascending, runs [R + 1] splitting it into runs that share a block, as write_tokens
    takes them; the sources are read before anything is written). A quantized row moves as its codes, unchanged,
    its sparse entries laid after those of the rows before it in its new block; a row in a full-precision tail is
    quantized there (its first quantization), or copied when its new block is still filling too (a quantized row
    going into a tail is decoded). Only a row whose entries do not fit the room left in its new block is
    quantized again, from its decoded values, within that room. scratch: records.TokenScratch."""
    dense = parts[0]  # written: by index, one statement each (records.py)
    scales = parts[1]
    counts = parts[2]
    sparse = parts[3]
    tail = parts[4]
    tail_of = parts[5]
    thr = parts[6]
    shifted = scratch[0]
    group = scratch[1]
    peak = scratch[2]
    scale32 = scratch[3]
    n, block_size, budget = src.shape[0], dense.shape[1], sparse.shape[1]
    width, num_seg = dense.shape[2], counts.shape[2]
    src_dense = np.empty((n, width), np.uint8)
    src_scales = np.empty((n, 3), np.uint16)
    src_counts = np.empty((n, num_seg), np.uint8)
    src_sparse = np.empty((n, 2 * width), np.uint8)
    src_float = np.empty((n, 2 * width), np.float32)
    in_tail = np.empty(n, np.bool_)
    for i in prange(n):
        block, offset = src[i] // block_size, src[i] % block_size
        slot = tail_of[block]
        in_tail[i] = slot >= 0
        if slot >= 0:
            src_float[i] = tail[slot, offset]
            continue
        src_dense[i] = dense[block, offset]
        src_scales[i] = scales[block, offset]
        src_counts[i] = counts[block, offset]
        e = row_entries(counts[block], offset)
        k = row_entries(counts[block], offset + 1) - e
        src_sparse[i, :k] = sparse[block, e:e + k]
    for r in prange(runs.shape[0] - 1):
        me = get_thread_id()
        block = dst[runs[r]] // block_size
        slot = tail_of[block]
        used = row_entries(counts[block], dst[runs[r]] % block_size)
        for i in range(runs[r], runs[r + 1]):
            offset = dst[i] % block_size
            if not in_tail[i]:
                k = row_entries(src_counts[i:i + 1], 1)
                if slot < 0 and used + k <= budget:
                    dense[block, offset] = src_dense[i]
                    scales[block, offset] = src_scales[i]
                    counts[block, offset] = src_counts[i]
                    sparse[block, used:used + k] = src_sparse[i, :k]
                    used += k
                    continue
                for j in range(3):
                    scale32[me, j] = fp16_to_f32(src_scales[i, j])
                dequantize_token(thr, src_dense[i], src_sparse[i], src_counts[i], scale32[me], src_float[i])
            if slot >= 0:
                tail[slot, offset] = src_float[i]
                continue
            used += _quantize_row(src_float[i], thr, dense, scales, counts, sparse, block, offset, used, scale32,
                                  shifted, group, peak, me)
