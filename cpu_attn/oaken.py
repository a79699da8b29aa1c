"""Oaken quantization of one token's K (or V) vector: group split, group shift, per-token scales,
fused dense-sparse encoding (issue #3, second part; the store and attention over it come next).

Groups, from four calibrated thresholds (cpu_attn/calibrate.py) s_lo < t_lo < t_hi < s_hi:
    outer  x < s_lo or x > s_hi   shifted by the outer threshold on its side   5 bits
    inner  t_lo <= x <= t_hi      not shifted                                  5 bits
    middle everything else        shifted by the inner threshold on its side   4 bits

Every group is sign-magnitude coded with one per-token scale (the shift puts 0 at the group's
edge, so the sign also says which threshold to add back, and no value is ambiguous):
    middle: dense nibble = sign bit | 3-bit magnitude
    inner / outer: dense nibble = 4-bit magnitude; the sign lives in the sparse entry

Layout of one token (C = num_kv_heads * head_dim values, split in 64-wide segments):
    dense  [C / 2] uint8   two nibbles per byte, value 2i in the low nibble
    sparse [C] uint8       one entry per inner/outer value, segment by segment:
                           bits 0-5 index in the segment | bit 6 outer | bit 7 negative
    counts [C / 64] uint8  sparse entries per segment
    scales [3] float16     middle, inner, outer
Effective bits per value = 4 + 8 * sparse fraction + (3 * 16 + 8 * C / 64) / C.
"""
from __future__ import annotations

import numpy as np
from numba import get_num_threads, get_thread_id, njit, prange

from cpu_attn.kernels import _as_f32, _as_u32

SEGMENT = 64
MIDDLE, INNER, OUTER = 0, 1, 2


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


@njit(cache=True, nogil=True)
def _code(magnitude, scale, max_code):
    if scale == 0.0:
        return 0
    return min(int(magnitude / scale + 0.5), max_code)


@njit(cache=True, nogil=True)
def quantize_token(x, thr, dense, sparse, counts, scales, shifted, group, peak):
    """x: [C] float32; thr: [4] (s_lo, t_lo, t_hi, s_hi) -> fills dense, sparse, counts, scales
    (scales as float32 already rounded to float16). Returns the number of sparse entries.
    Scratch: shifted [C] float32, group [C] int8, peak [3] float32."""
    s_lo, t_lo, t_hi, s_hi = thr[0], thr[1], thr[2], thr[3]
    num = x.shape[0]
    peak[:] = 0.0
    for i in range(num):
        v = x[i]
        if v > s_hi or v < s_lo:
            g, y = OUTER, v - (s_hi if v > s_hi else s_lo)
        elif v >= t_lo and v <= t_hi:
            g, y = INNER, v
        else:
            g, y = MIDDLE, v - (t_hi if v > t_hi else t_lo)
        group[i], shifted[i] = g, y
        peak[g] = max(peak[g], abs(y))
    scales[0] = round_to_fp16(peak[0] / np.float32(7.0))
    scales[1] = round_to_fp16(peak[1] / np.float32(15.0))
    scales[2] = round_to_fp16(peak[2] / np.float32(15.0))
    dense[:] = 0
    num_sparse = 0
    for seg in range(num // SEGMENT):
        count = 0
        for j in range(SEGMENT):
            i = seg * SEGMENT + j
            g, y = group[i], shifted[i]
            if g == MIDDLE:
                nibble = _code(abs(y), scales[0], 7) | (8 if y < 0 else 0)
            else:
                nibble = _code(abs(y), scales[g], 15)
                sparse[num_sparse] = j | (64 if g == OUTER else 0) | (128 if y < 0 else 0)
                num_sparse += 1
                count += 1
            dense[i // 2] |= nibble << (4 * (i % 2))
        counts[seg] = count
    return num_sparse


@njit(cache=True, nogil=True)
def dequantize_token(thr, dense, sparse, counts, scales, out):
    """Inverse of quantize_token: out [C] float32."""
    s_lo, t_lo, t_hi, s_hi = thr[0], thr[1], thr[2], thr[3]
    for i in range(out.shape[0]):
        nibble = (dense[i // 2] >> (4 * (i % 2))) & 15
        magnitude = np.float32(nibble & 7) * scales[0]
        out[i] = t_lo - magnitude if nibble & 8 else t_hi + magnitude
    e = 0
    for seg in range(counts.shape[0]):
        for _ in range(counts[seg]):
            entry = sparse[e]
            e += 1
            i = seg * SEGMENT + (entry & 63)
            is_negative = entry & 128
            nibble = (dense[i // 2] >> (4 * (i % 2))) & 15
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
                                       peak[me])


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
    threads = get_num_threads()
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
