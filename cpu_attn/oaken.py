"""Oaken quantization of one token's K (or V) vector: group split, group shift, per-token scales,
fused dense-sparse encoding (issue #3, second part; the store and attention over it come next).

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
    counts [C / 64] uint8  sparse entries per segment
    scales [3] float16     middle, inner, outer
Effective bits per value = 4 + 8 * sparse fraction + (3 * 16 + 8 * C / 64) / C.
"""
from __future__ import annotations

import numpy as np
import numba
from llvmlite import binding, ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.kernels import (_FAST, _as_f32, _as_u32, _llvm_fn, attend_begin, attend_scores, block_scores, c_array,
                              f32_matrices, fmuladd8, finish_unit, fp16_to_f32, host_has, lane_sums, matrix_args,
                              merge_parts, part_blocks, prefetch, softmax_rows16, splat)

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
def turn_rows(rows, width, matrix, tmp):
    """rows[t] = rows[t] @ matrix for t < width (rows [>= width, D], matrix [D, D], tmp [_TURN_ROWS, D]):
    each head's row turned by the store's rotation, or back by its transpose; a no-op when matrix is
    empty (the store does not rotate). The sums over e of rows[t, e] * matrix[e, i] are added in
    order of e, one float32 multiply and one add each: every path that turns rows stores the same bits."""
    dim = matrix.shape[0]
    if dim == 0:
        return
    t = 0
    while t < width:
        if dim % _TURN_LANES == 0 and width - t >= _TURN_ROWS:
            _turn_rows(rows[t:t + _TURN_ROWS], matrix, tmp)
            n = _TURN_ROWS
        elif dim % _TURN_LANES == 0:
            _turn_row(rows[t], matrix, tmp[0])
            n = 1
        else:
            n = 1
            for i in range(dim):
                tmp[0, i] = 0.0
            for e in range(dim):
                x = rows[t, e]
                for i in range(dim):
                    tmp[0, i] += x * matrix[e, i]
        for r in range(n):
            for i in range(dim):
                rows[t + r, i] = tmp[r, i]
        t += n


_TURN_LANES = 64  # outputs _turn_row sums at a time, in four vectors of 16
_TURN_ROWS = 4  # rows _turn_rows turns at once: four independent chains of adds, each matrix row loaded once for them


def _turn_codegen(num_rows):
    """LLVM IR of out[r] = rows[r] @ matrix for r < num_rows (row, out [D] when num_rows is 1, else
    [>= num_rows, D]; matrix [D, D], D a multiple of _TURN_LANES) as turn_rows's loop computes it,
    _TURN_LANES sums a row held in registers over the loop on e: the loop kept them in memory, and
    each step waited on the last one's store (~0.27 us a row of 64; ~0.13 one row at a time, where
    each chain of adds waits on the last; four rows together ~4x fewer waits)."""
    def codegen(context, builder, signature, args):
        f32, i64 = _F32, _I64
        vec = ir.VectorType(f32, 16)
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
        src, mat, dst = (a.data for a in arrays)
        dim = cgutils.unpack_tuple(builder, arrays[1].shape, 2)[0]
        sums = [[cgutils.alloca_once(builder, vec) for _ in range(_TURN_LANES // 16)]  # registers after mem2reg
                for _ in range(num_rows)]
        with cgutils.for_range_slice(builder, i64(0), dim, i64(_TURN_LANES)) as (first, _):
            for row in sums:
                for acc in row:
                    builder.store(ir.Constant(vec, [0.0] * 16), acc)
            with cgutils.for_range(builder, dim) as e:
                at = builder.add(builder.mul(e.index, dim), first)
                m = [builder.load(builder.bitcast(builder.gep(mat, [builder.add(at, i64(16 * k))]), vec.as_pointer()),
                                  align=4) for k in range(_TURN_LANES // 16)]
                for r, row in enumerate(sums):
                    x = builder.load(builder.gep(src, [builder.add(builder.mul(i64(r), dim), e.index)]))
                    x = splat(builder, x, 16)
                    for acc, mk in zip(row, m):
                        builder.store(builder.fadd(builder.load(acc), builder.fmul(x, mk)), acc)
            for r, row in enumerate(sums):
                for k, acc in enumerate(row):
                    at = builder.add(builder.mul(i64(r), dim), builder.add(first, i64(16 * k)))
                    builder.store(builder.load(acc), builder.bitcast(builder.gep(dst, [at]), vec.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _turn_row(typingctx, row, matrix, out):
    """out = row @ matrix (_turn_codegen, one row)."""
    if not (c_array(row, 1, types.float32) and c_array(matrix, 2, types.float32) and c_array(out, 1, types.float32)):
        return None
    return types.none(row, matrix, out), _turn_codegen(1)


@intrinsic
def _turn_rows(typingctx, rows, matrix, out):
    """out[r] = rows[r] @ matrix for r < _TURN_ROWS (_turn_codegen; rows, out [>= _TURN_ROWS, D])."""
    if not (c_array(rows, 2, types.float32) and c_array(matrix, 2, types.float32) and c_array(out, 2, types.float32)):
        return None
    return types.none(rows, matrix, out), _turn_codegen(_TURN_ROWS)


def turn_heads(x, matrix):
    """x [T, Hkv * D] float32: each head's D values times matrix [D, D], in place, with the same
    operations as write_tail_rows turns its rows (so every write path stores the same bits): a
    decode step's few rows on one thread (_turn_few; below ~130 rows of 64 waking the threads took
    longer than turning them), more in parallel (_turn_all, in chunks of _TURN_CHUNK rows: a 64k-token
    prompt of a 32-layer model turns 33 M rows of 128)."""
    (_turn_few if x.size * matrix.shape[0] <= _FEW_MACS else _turn_all)(x, matrix)


_FEW_MACS = 1 << 19  # multiply-adds turn_heads does on one thread (up to 128 rows of 64: waking the threads cost more)


@njit(cache=True, nogil=True, parallel=True)
def _turn_all(x, matrix):
    dim = matrix.shape[0]
    if dim == 0:
        return
    rows = x.reshape(x.size // dim, dim)
    chunks = (rows.shape[0] + _TURN_CHUNK - 1) // _TURN_CHUNK
    for c in prange(chunks):
        part = rows[c * _TURN_CHUNK:(c + 1) * _TURN_CHUNK]
        turn_rows(part, part.shape[0], matrix, np.empty((_TURN_ROWS, dim), np.float32))


_TURN_CHUNK = 256  # rows a task of _turn_all


@njit(cache=True, nogil=True)
def _turn_few(x, matrix):  # _turn_all's loop on one thread (a parallel njit's prange always wakes the threads)
    dim = matrix.shape[0]
    if dim == 0:
        return
    rows = x.reshape(x.size // dim, dim)
    turn_rows(rows, rows.shape[0], matrix, np.empty((_TURN_ROWS, dim), np.float32))


@njit(cache=True, nogil=True)
def write_tail_rows(k, v, key_scales, value_scales, key_bias, rotation, cos, sin, positions, slot_mapping, block_size,
                    tail, tail_of, tail_len, tail_stamp, stamp):
    """A decode step's rows, one per sequence, each going on filling its block's tail slot without
    filling it up, written into one layer's tails in store space: (k - R(p) key_bias) / key_scales
    (key_bias [0]: no centering) and v / value_scales, with the same float32 operations, in the
    same order, as OakenKVStore.write's NumPy path, then each head times `rotation` ([D, D]; [0, 0]:
    none). k, v, key_scales, value_scales, key_bias [T or 1, Hkv * D]; cos, sin [>= max position +
    1, D / 2]; tail [2, slots, bs, Hkv * D];
    tail_of [blocks]; tail_len, tail_stamp [slots] (stamps stamp + 1 ..).
    Returns 0 when written; -1 when a row is not such a row, or the number of rows with NaN or
    inf; then nothing is written."""
    n, c = k.shape
    half = cos.shape[1]
    for i in range(n):
        block, offset = slot_mapping[i] // block_size, slot_mapping[i] % block_size
        if tail_of[block] < 0 or offset == block_size - 1 or (i > 0 and slot_mapping[i - 1] // block_size == block):
            return -1
    bad = 0
    for i in range(n):
        finite = True
        for j in range(c):
            finite &= np.isfinite(k[i, j]) and np.isfinite(v[i, j])
        bad += not finite
    if bad:
        return bad
    dim = rotation.shape[0]
    tmp = np.empty((_TURN_ROWS, dim), np.float32)
    for i in range(n):
        slot, offset = tail_of[slot_mapping[i] // block_size], slot_mapping[i] % block_size
        p = positions[i]
        for j in range(c):
            key = k[i, j] / key_scales[0, j]
            if key_bias.shape[0]:
                d = j % (2 * half)
                t = d % half
                turned = -key_bias[0, j + half] if d < half else key_bias[0, j - half]
                key -= (key_bias[0, j] * cos[p, t] + turned * sin[p, t]) / key_scales[0, j]
            tail[0, slot, offset, j] = key
            tail[1, slot, offset, j] = v[i, j] / value_scales[0, j]
        if dim:
            for kv in range(2):
                turn_rows(tail[kv, slot, offset].reshape(c // dim, dim), c // dim, rotation, tmp)
        tail_len[slot] = offset + 1
        tail_stamp[slot] = stamp + 1 + i
    return 0


@njit(cache=True, nogil=True, parallel=True)
def write_tokens(x, thr, slot_mapping, runs, dense, scales, counts, sparse, shifted, group, peak, scale32):
    """Quantize rows x [T, C] into their slots; `runs` [R + 1] splits the rows into runs that share
    a block (rows of a run are in position order), runs go in parallel. Returns the number of
    non-finite rows (nothing of those rows is written).
    Per-thread scratch: shifted [threads, C], group [threads, C] int8, peak [threads, 3], scale32 [threads, 3]."""
    block_size, budget = dense.shape[1], sparse.shape[1]
    bad = 0
    for r in prange(runs.shape[0] - 1):
        me = get_thread_id()
        block = slot_mapping[runs[r]] // block_size
        used = 0
        for t in range(slot_mapping[runs[r]] % block_size):
            for seg in range(counts.shape[2]):
                used += counts[block, t, seg]
        for row in range(runs[r], runs[r + 1]):
            offset = slot_mapping[row] % block_size
            finite = True
            for i in range(x.shape[1]):
                finite &= np.isfinite(x[row, i])
            if not finite:
                bad += 1
                continue
            used += quantize_token(x[row], thr, dense[block, offset], sparse[block, used:], counts[block, offset],
                                   scale32[me], shifted[me], group[me], peak[me], budget - used)
            for k in range(3):
                scales[block, offset, k] = _fp16_bits(scale32[me, k])
    return bad


_LANES = 16  # sparse entries _scatter_entries decodes at once
_F32, _I1, _I8, _I16, _I32, _I64 = (ir.FloatType(), ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32),
                                    ir.IntType(64))  # the IR kernels' types


def _entries_args(out, dense, sparse) -> bool:
    """Typing check of _scatter_entries and _write_entries."""
    return c_array(out, 1, types.float32) and c_array(dense, 1, types.uint8) and c_array(sparse, 1, types.uint8)


def _entries_setup(context, builder, signature, args):
    """LLVM IR: _scatter_entries' or _write_entries' arguments -> (the addresses of out[out_at], dense[dense_at]
    and sparse[k] as i64, n, (s_lo, s_hi, s1, s2) as float32)."""
    sig = signature.args
    out_at, dense_at, k, n = (context.cast(builder, args[i], sig[i], types.intp) for i in (1, 3, 5, 6))
    data = [builder.ptrtoint(context.make_array(sig[i])(context, builder, args[i]).data, _I64) for i in (0, 2, 4)]
    scalars = tuple(context.cast(builder, a, t, types.float32) for a, t in zip(args[7:], sig[7:]))
    return (builder.add(data[0], builder.shl(out_at, _I64(2))), builder.add(data[1], dense_at), builder.add(data[2], k),
            n, scalars)


@intrinsic
def _scatter_entries(typingctx, out, out_at, dense, dense_at, sparse, k, n, s_lo, s_hi, s1, s2):
    """The sparse entries sparse[k : k + min(n, _LANES)] of one segment -> their values written into
    out[out_at + index]; the segment's nibbles start at dense[dense_at] (4-byte aligned). Entry
    bits 0-5 index, 6 outer, 7 negative; the value is base + y * step with y its dense nibble:
    inner +-y * s1, outer s_hi + y * s2 or s_lo - y * s2 (dequantize_token says it plainly).

    Numba emits no vector gather or scatter, so this is written in LLVM IR: a masked load of the
    entries, a gather of the 32-bit words that hold their nibbles, a scatter of the values (one
    instruction each with AVX-512; LLVM expands them lane by lane on CPUs without, where decode_token
    uses _write_entries instead).
    Sixteen lanes: a segment has ~9 entries at the default ratios (with eight, two passes: 5 %
    slower). Exact attention at 16 x 8k (one layer) went from 25.6 to 21 ms with it on an AVX-512
    Xeon, and from 27.1 to 22.6 ms compiled for plain x86-64."""
    if not _entries_args(out, dense, sparse):
        return None

    def codegen(context, builder, signature, args):
        f32, i1, i8, i32, i64 = _F32, _I1, _I8, _I32, _I64
        ptr = i8.as_pointer()
        vec = lambda t: ir.VectorType(t, _LANES)
        const = lambda t, x: ir.Constant(vec(t), [x] * _LANES)

        def lanes(x):  # _LANES copies of the scalar x
            return splat(builder, x, _LANES)

        def intrinsic_fn(name, ret, params):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)

        out_base, nibbles, entries, n, (s_lo, s_hi, s1, s2) = _entries_setup(context, builder, signature, args)
        mask = builder.icmp_signed("<", ir.Constant(vec(i64), list(range(_LANES))), lanes(n))
        at = builder.inttoptr(entries, ptr)
        load = intrinsic_fn(f"llvm.masked.load.v{_LANES}i8.p0", vec(i8), [ptr, i32, vec(i1), vec(i8)])
        entry = builder.zext(builder.call(load, [at, i32(1), mask, const(i8, 0)]), vec(i32))
        j = builder.and_(entry, const(i32, 63))
        outer = builder.icmp_unsigned("!=", builder.and_(entry, const(i32, 64)), const(i32, 0))
        negative = builder.icmp_unsigned("!=", builder.and_(entry, const(i32, 128)), const(i32, 0))
        byte = builder.and_(j, const(i32, 31))  # value j's nibble: byte j % 32, high nibble for j >= 32
        shift = builder.add(builder.shl(builder.and_(byte, const(i32, 3)), const(i32, 3)),
                            builder.shl(builder.lshr(j, const(i32, 5)), const(i32, 2)))
        words = builder.add(lanes(nibbles),
                            builder.zext(builder.and_(byte, const(i32, ~3)), vec(i64)))
        gather = intrinsic_fn(f"llvm.masked.gather.v{_LANES}i32.v{_LANES}p0", vec(i32),
                              [vec(ptr), i32, vec(i1), vec(i32)])
        word = builder.call(gather, [builder.inttoptr(words, vec(ptr)), i32(4), mask, const(i32, 0)])
        y = builder.uitofp(builder.and_(builder.lshr(word, shift), const(i32, 15)), vec(f32))
        base = builder.select(outer, builder.select(negative, lanes(s_lo), lanes(s_hi)), const(f32, 0.0))
        step = builder.select(outer, lanes(s2), lanes(s1))
        value = builder.fadd(base, builder.fmul(y, builder.select(negative, builder.fneg(step), step)))
        slots = builder.add(lanes(out_base),
                            builder.shl(builder.zext(j, vec(i64)), const(i64, 2)))
        scatter = intrinsic_fn(f"llvm.masked.scatter.v{_LANES}f32.v{_LANES}p0", ir.VoidType(),
                               [vec(f32), vec(ptr), i32, vec(i1)])
        builder.call(scatter, [value, builder.inttoptr(slots, vec(ptr)), i32(4), mask])
        return context.get_dummy_value()
    return types.none(out, out_at, dense, dense_at, sparse, k, n, s_lo, s_hi, s1, s2), codegen


@intrinsic
def _write_entries(typingctx, out, out_at, dense, dense_at, sparse, k, n, s_lo, s_hi, s1, s2):
    """_scatter_entries for CPUs without AVX-512: all n entries sparse[k : k + n] of one segment,
    one scalar loop, each entry's base and step (by its group and sign bits) from a table of four.

    There _scatter_entries' masked gather and scatter have no single instruction: LLVM expands them
    lane by lane, sixteen lanes whatever the count. A row of one kv-head (64 values, ~8 entries;
    41-47 ns with none) decoded by load_row on a Zen 1 (bench_oaken_rows' sampled row): 98-102 ns
    with the masked ones, 64-66 with this loop (~12 instructions an entry, no branch but the loop's;
    a Numba loop branched on the random group and sign bits and was slower than either)."""
    if not _entries_args(out, dense, sparse):
        return None

    def codegen(context, builder, signature, args):
        f32, i8, i64 = _F32, _I8, _I64
        b = builder
        out_base, nibbles, entries, n, (s_lo, s_hi, s1, s2) = _entries_setup(context, b, signature, args)
        # (base, step) by bits 6 (outer) and 7 (negative) of an entry: inner +-y * s1, outer s_hi + y * s2 or s_lo - y * s2
        table = cgutils.alloca_once(b, ir.ArrayType(f32, 8))
        for at, x in enumerate((f32(0.0), s1, s_hi, s2, f32(0.0), b.fneg(s1), s_lo, b.fneg(s2))):
            b.store(x, b.gep(table, [_I32(0), _I32(at)]))
        with cgutils.for_range(b, n) as loop:
            e = b.zext(b.load(b.inttoptr(b.add(entries, loop.index), i8.as_pointer())), i64)
            j = b.and_(e, i64(63))
            byte = b.zext(b.load(b.inttoptr(b.add(nibbles, b.and_(e, i64(31))), i8.as_pointer())), i64)
            y = b.uitofp(b.and_(b.lshr(byte, b.and_(b.lshr(e, i64(3)), i64(4))), i64(15)), f32)  # high nibble: j >= 32
            kind = b.shl(b.lshr(e, i64(6)), i64(1))
            base, step = (b.load(b.gep(table, [i64(0), b.add(kind, i64(h))])) for h in (0, 1))
            b.store(b.fadd(base, b.fmul(y, step)), b.inttoptr(b.add(out_base, b.shl(j, i64(2))), f32.as_pointer()))
        return context.get_dummy_value()
    return types.none(out, out_at, dense, dense_at, sparse, k, n, s_lo, s_hi, s1, s2), codegen


@intrinsic
def _decode_middle(typingctx, out, dense, dense_at, s0, lo_base, hi_base):
    """Every value of out [D] decoded as a middle value from the nibbles at dense[dense_at ...]
    (D / 2 bytes; in each 64-wide segment byte j holds value j low and value j + 32 high):
    lo_base - m * s0 for a set sign bit, hi_base + m * s0 otherwise, m the nibble's low 3 bits.
    D a multiple of 64 (OakenKVStore's head_dim is).

    In LLVM IR because Numba's loop, vectorized, ran its aliasing checks and set-up again for every
    32-byte segment: here a whole segment is widened to 32-bit lanes at once, the constants in
    registers (K of 16 x 8k decoded into L1-sized blocks: 6.1 -> 5.2 ms; 4.8 with sixteen-lane scatters)."""
    if not (c_array(out, 1, types.float32) and c_array(dense, 1, types.uint8) and isinstance(dense_at, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        f32, i8, i32, i64 = _F32, _I8, _I32, _I64
        lanes = SEGMENT // 2  # a segment's bytes
        bytes_t, ints, floats = ir.VectorType(i8, lanes), ir.VectorType(i32, lanes), ir.VectorType(f32, lanes)
        sig = signature.args
        out_a = context.make_array(sig[0])(context, builder, args[0])
        dense_a = context.make_array(sig[1])(context, builder, args[1])
        (num,) = cgutils.unpack_tuple(builder, out_a.shape, 1)
        out_base = builder.ptrtoint(out_a.data, i64)
        src_base = builder.add(builder.ptrtoint(dense_a.data, i64), context.cast(builder, args[2], sig[2], types.intp))
        s0, lo_base, hi_base = (splat(builder, context.cast(builder, a, t, types.float32), lanes)
                                for a, t in zip(args[3:], sig[3:]))
        const = lambda x: ir.Constant(ints, [x] * lanes)
        with cgutils.for_range(builder, builder.udiv(num, i64(SEGMENT))) as seg:
            raw = builder.load(builder.inttoptr(builder.add(src_base, builder.mul(seg.index, i64(lanes))),
                                                bytes_t.as_pointer()), align=1)
            x = builder.zext(raw, ints)
            first = builder.add(out_base, builder.mul(seg.index, i64(4 * SEGMENT)))  # the segment's values 0 .. 31
            low, high = builder.and_(x, const(15)), builder.lshr(x, const(4))
            for nib, at in ((low, first), (high, builder.add(first, i64(4 * lanes)))):
                mag = builder.fmul(builder.uitofp(builder.and_(nib, const(7)), floats), s0)
                negative = builder.icmp_unsigned(">=", nib, const(8))
                value = builder.select(negative, builder.fsub(lo_base, mag), builder.fadd(hi_base, mag))
                builder.store(value, builder.inttoptr(at, floats.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(out, dense, dense_at, s0, lo_base, hi_base), codegen


@njit(cache=True, nogil=True, inline="always")
def decode_token(dense, scales, counts, sparse, e, thr, first_seg, out):
    """One token of one kv-head: dense [C/2], scales [3] (fp16 bits), counts [C/64] and its
    block's sparse entries from index e -> out [D] float32 (D a multiple of 64, starting at
    segment first_seg). Returns e past this token's entries.

    Both passes are branch-free (random sign and group bits would mispredict): every value is
    first decoded as a middle value, a segment at a time (_decode_middle); then the sparse entries
    overwrite their slots: with AVX-512 sixteen at a time by vector gathers and scatters
    (_scatter_entries), elsewhere in a scalar loop (_write_entries)."""
    s_lo, t_lo, t_hi, s_hi = thr[0], thr[1], thr[2], thr[3]
    half = SEGMENT // 2
    num_seg = out.shape[0] // SEGMENT
    s0 = fp16_to_f32(scales[0])
    lo_base, hi_base = t_lo - MIDDLE_OFFSET * s0, t_hi + MIDDLE_OFFSET * s0  # levels (m + offset) * step
    _decode_middle(out, dense, first_seg * half, s0, lo_base, hi_base)
    s1, s2 = fp16_to_f32(scales[1]), fp16_to_f32(scales[2])
    for seg in range(first_seg):
        e += counts[seg]
    for seg in range(num_seg):
        n = counts[first_seg + seg]
        if _MASKED_ENTRIES:
            for k in range(e, e + n, _LANES):
                _scatter_entries(out, seg * SEGMENT, dense, (first_seg + seg) * half, sparse, k, e + n - k,
                                 s_lo, s_hi, s1, s2)
        else:
            _write_entries(out, seg * SEGMENT, dense, (first_seg + seg) * half, sparse, e, n, s_lo, s_hi, s1, s2)
        e += n
    for seg in range(first_seg + num_seg, counts.shape[0]):
        e += counts[seg]
    return e


@njit(cache=True, nogil=True, inline="always")
def dequantize_block(dense, scales, counts, sparse, thr, first_seg, width, out):
    """Rows 0..width-1 of one block (dense [bs, C/2], scales [bs, 3], counts [bs, C/64],
    sparse [budget]) for one kv-head -> out [bs, D] float32; see decode_token."""
    e = 0
    for t in range(width):
        e = decode_token(dense[t], scales[t], counts[t], sparse, e, thr, first_seg, out[t])


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
def load_block(parts, block, thr, first_seg, width, out):
    """Rows 0..width-1 of `block` for one kv-head -> out [bs, D] float32. parts = (dense, scales,
    counts, sparse, tail, tail_of): a block still filling lives in full precision in
    tail[tail_of[block]] ([bs, C] float32); any other block is decoded (dequantize_block)."""
    dense, scales, counts, sparse, tail, tail_of = parts
    slot = tail_of[block]
    if slot >= 0:
        first = first_seg * SEGMENT
        for t in range(width):
            out[t, :] = tail[slot, t, first:first + out.shape[1]]
    else:
        dequantize_block(dense[block], scales[block], counts[block], sparse[block], thr, first_seg, width, out)


@njit(cache=True, nogil=True, inline="always")
def prefetch_block(parts, block, first_seg, head_dim):
    """Start loading every line load_block will read of `block` for one kv-head: its rows' nibbles,
    scales and counts, and the block's sparse entries (the store's arrays start on a line, so a
    head's run of nibbles, head_dim / 2 bytes at a multiple of that, lies in one line per 64
    bytes). A sequence's blocks lie anywhere in the pool, so the hardware prefetchers stop at every
    block; asked for the next block ahead, the exact kernel at 8 x 32k went ~52 -> ~36 ms."""
    dense, scales, counts, sparse = parts[0], parts[1], parts[2], parts[3]
    at = first_seg * (SEGMENT // 2)
    for t in range(dense.shape[1]):
        for x in range(at, at + head_dim // 2, 64):
            prefetch(dense, (block, t, x))
    for t in range(0, dense.shape[1], 4):
        prefetch(scales, (block, t, 0))
        prefetch(counts, (block, t, 0))
    for e in range(0, sparse.shape[1], 32):
        prefetch(sparse, (block, e))


@njit(cache=True, nogil=True, inline="always")
def load_row(parts, block, thr, first_seg, offset, e, out):
    """Row `offset` of `block` for one kv-head -> out [D] float32, for a block that is not still
    filling (its rows are quantized; see load_block); e = row_entries(counts[block], offset). No tail
    check here: with it (a branch around the decoder) LLVM compiles the decoder ~2.5x slower, 100 vs
    40 ns per sampled row."""
    dense, scales, counts, sparse = parts[0], parts[1], parts[2], parts[3]
    decode_token(dense[block, offset], scales[block, offset], counts[block, offset], sparse[block], e, thr, first_seg, out)


VNNI = host_has("avx512bw", "avx512vnni", "avx512vbmi2")
"""Whether the exact kernel works on full blocks in AVX-512 int16 dot products (vnni_block_scores,
vnni_add_weighted_rows; VBMI2 for vpexpandw)."""
AVX2 = host_has("avx2", "fma", "f16c")
"""Whether it can at least do so in AVX2 (avx2_block_scores, avx2_add_weighted_rows)."""
_MASKED_ENTRIES = host_has("avx512f")
"""Whether decode_token writes sparse entries by masked gathers and scatters (_scatter_entries), which are single
instructions only with AVX-512; elsewhere by a scalar loop (_write_entries)."""
INT16 = VNNI or AVX2
"""Whether full blocks go through int16 dot products at all; elsewhere they are decoded to floats."""
CODE_MAX = 16383
"""|code| and |query code| bound of vnni_block_scores: a product is < 2^28, six per lane and segment stay < 2^31."""
ROWS = 16  # rows of a block vnni_block_scores scores: the lanes of its vectors


def query_codes(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q [..., D] float32 -> (codes int16 [..., D], scales float32 [...]): q ~ codes * scales, |codes| <= CODE_MAX."""
    rows = np.ascontiguousarray(q, np.float32).reshape(-1, q.shape[-1])
    codes, scales = np.empty(rows.shape, np.int16), np.empty(len(rows), np.float32)
    _query_codes(rows, codes, scales)
    return codes.reshape(q.shape), scales.reshape(q.shape[:-1])


@njit(cache=True, nogil=True)
def _query_codes(q, codes, scales):
    """query_codes on rows [N, D], in one loop: NumPy's five passes took ~6 us for a decode batch."""
    for r in range(q.shape[0]):
        top = np.float32(1e-30)
        for i in range(q.shape[1]):
            top = max(top, abs(q[r, i]))
        scale = top / np.float32(CODE_MAX)
        scales[r] = scale
        for i in range(q.shape[1]):  # rint as an add and a subtract (|x| <= CODE_MAX < 2^22): np.rint is a call a value
            codes[r, i] = np.int16((q[r, i] / scale + _RINT) - _RINT)


_RINT = np.float32(3 << 22)  # x + _RINT - _RINT rounds a float32 |x| < 2^22 to the nearest integer, ties to even


binding.initialize_native_asmparser()  # _dpwssd's inline assembly (Numba readies the target, not its parser)


def _dpwssd(builder, acc, x, y):
    """acc + the pairwise int16 dot products of x and y (<16 x i32> each): one vpdpwssd, as inline
    assembly. Called as the intrinsic, LLVM's machine combiner splits most into vpmaddwd + vpaddd
    (a shorter chain for one product, two uops for every one): the kernels here are bound by uops.
    Without VNNI, two AVX2 vpmaddwd and vpaddd (_pmaddwd)."""
    vec = ir.VectorType(_I32, 16)
    if not VNNI:
        halves = [ir.Constant(ir.VectorType(_I32, 8), list(range(k, k + 8))) for k in (0, 8)]
        sums = [_pmaddwd(builder, *(builder.shuffle_vector(v, v, half) for v in (x, y))) for half in halves]
        return builder.add(acc, builder.shuffle_vector(sums[0], sums[1], ir.Constant(vec, list(range(16)))))
    return builder.asm(ir.FunctionType(vec, [vec] * 3), "vpdpwssd $2, $1, $0", "=v,v,v,0", [x, y, acc], False)


def _pmaddwd(builder, x, y):
    """The pairwise int16 dot products of x and y (<8 x i32> each, int16 pairs) as <8 x i32>: one AVX2 vpmaddwd."""
    words, dwords = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    fn = _llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", dwords, [words, words])
    return builder.call(fn, [builder.bitcast(x, words), builder.bitcast(y, words)])


class _RowCodes:
    """LLVM IR shared by vnni_block_scores and vnni_add_weighted_rows: one full block's rows of one
    kv-head as int16 codes. Each row's 16 levels (8 middle magnitudes either side, dequantize_token)
    and its sparse values are int16 multiples of a per-row unit, its largest possible |value| /
    CODE_MAX; the per-row scalars are computed for all 16 rows at once, a row a lane."""

    def __init__(self, builder, dense, scales, counts, sparse, thr):
        """dense, scales, counts, sparse, thr: the arrays' structs (make_array)."""
        self.builder = b = builder
        f32, i1, i8, i16, i32, i64 = _F32, _I1, _I8, _I16, _I32, _I64
        vec = ir.VectorType
        self.permw = self.fn("llvm.x86.avx512.permvar.hi.512", vec(i16, 32), [vec(i16, 32)] * 2)
        self.perm2w = self.fn("llvm.x86.avx512.vpermi2var.hi.512", vec(i16, 32), [vec(i16, 32)] * 3)
        self.rint = self.fn("llvm.rint.v16f32", vec(f32, 16), [vec(f32, 16)])
        fabs = self.fn("llvm.fabs.v16f32", vec(f32, 16), [vec(f32, 16)])
        self.masked_load = self.fn("llvm.masked.load.v32i8.p0", vec(i8, 32),
                                   [i8.as_pointer(), i32, vec(i1, 32), vec(i8, 32)])
        self.dense, self.counts = b.ptrtoint(dense.data, i64), b.ptrtoint(counts.data, i64)
        self.sparse = b.ptrtoint(sparse.data, i64)
        self.dense_row, self.counts_row = (cgutils.unpack_tuple(b, a.strides, 2)[0] for a in (dense, counts))
        self.num_counts = cgutils.unpack_tuple(b, counts.shape, 2)[1]
        s_lo, t_lo, t_hi, s_hi = (self.lanes(b.load(b.gep(thr.data, [i64(i)]))) for i in range(4))
        raw = b.load(self.at(b.ptrtoint(scales.data, i64), vec(i16, 3 * ROWS)), align=2)
        s0, s1, s2 = (b.fpext(b.bitcast(b.shuffle_vector(raw, raw, ir.Constant(vec(i32, ROWS), list(range(k, 3 * ROWS, 3)))),
                                        vec(ir.HalfType(), ROWS)), vec(f32, ROWS)) for k in range(3))
        hi_base = b.fadd(t_hi, b.fmul(self.full(f32, float(MIDDLE_OFFSET)), s0))  # levels (m + offset) * step
        lo_base = b.fsub(t_lo, b.fmul(self.full(f32, float(MIDDLE_OFFSET)), s0))
        s0_7, s2_15 = b.fmul(self.full(f32, 7.0), s0), b.fmul(self.full(f32, 15.0), s2)
        top = self.full(f32, 1e-30)
        for x in (hi_base, b.fadd(hi_base, s0_7), lo_base, b.fsub(lo_base, s0_7), b.fadd(s_hi, s2_15), b.fsub(s_lo, s2_15)):
            top = self.vmax(top, b.call(fabs, [x]))
        top = self.vmax(top, b.fmul(self.full(f32, 15.0), s1))
        self.inv = b.fdiv(self.full(f32, float(CODE_MAX)), top)
        self.unit = b.fmul(top, self.full(f32, 1.0 / CODE_MAX))  # [16] the rows' units (a multiply: one division a block)
        # in memory, a row's scalars broadcast from there: the kernels loop over rows at run time (16
        # unrolled rows were ~40 KB of code, more than the L1 instruction cache and the uop cache hold)
        self.per_row = b.ptrtoint(cgutils.alloca_once(b, ir.ArrayType(vec(f32, ROWS), 7)), i64)
        for k, x in enumerate((hi_base, lo_base, s0, s1, s2, s_lo, s_hi)):
            b.store(b.fmul(x, self.inv), self.at(b.add(self.per_row, i64(64 * k)), vec(f32, ROWS)), align=4)
        self.entry_of_row = cgutils.alloca_once(b, i64)  # where the next row's entries start (rows in order)
        self.zero16 = self.full(i16, 0)
        self.widen = ir.Constant(vec(i32, 32), list(range(16)) + [16] * 16)  # <16 x i16> -> <32 x i16>, the rest 0
        self.first16 = ir.Constant(vec(i32, 16), list(range(16)))

    def fn(self, name, ret, params):
        return _llvm_fn(self.builder, name, ret, params)

    def at(self, address, kind):
        return self.builder.inttoptr(address, kind.as_pointer())

    def full(self, kind, x, n=ROWS):
        return ir.Constant(ir.VectorType(kind, n), [x] * n)

    def lanes(self, x):
        return splat(self.builder, x, ROWS)

    def vmax(self, a, b):
        return self.builder.select(self.builder.fcmp_ordered(">", a, b), a, b)

    def to_codes(self, x):  # <16 x float> in units -> <16 x i16>
        b = self.builder
        return b.trunc(b.fptosi(b.call(self.rint, [x]), ir.VectorType(_I32, 16)), ir.VectorType(_I16, 16))

    def first_row(self):
        """Before row 0's walk: its entries start the block's budget."""
        self.builder.store(_I64(0), self.entry_of_row)

    def walk(self, t, entry):
        """Row t's counts (t: i64, rows in order from first_row) -> where the row's entries start in
        the block's budget, stored at `entry` (an i64 pointer)."""
        b = self.builder
        b.store(b.load(self.entry_of_row), entry)
        first = self.at(b.add(self.counts, b.mul(t, self.counts_row)), _I8)
        with cgutils.for_range(b, self.num_counts) as c:  # a GEP: LLVM vectorizes long rows with loads, not gathers
            n = b.zext(b.load(b.gep(first, [c.index])), _I64)
            b.store(b.add(b.load(self.entry_of_row), n), self.entry_of_row)

    def row(self, t, entry, cache=None, fresh=None):
        """Row t's state (t: i64): its levels as codes (<32 x i16>, lanes 16.. unused), where its
        entries start (`entry`, an i64 pointer; each segment moves it on by its count), its scalars,
        its counts' and nibbles' addresses. With `cache` (a buffer of ROWS <32 x i16>) the levels are
        computed where `fresh` (i1) holds and kept there, else loaded from it."""
        f32, i1, i64 = _F32, _I1, _I64
        b = self.builder
        scalars = [self.lanes(b.load(self.at(b.add(self.per_row, b.add(i64(64 * k), b.shl(t, i64(2)))), f32)))
                   for k in range(7)]

        def levels():
            hb, lb, st = scalars[:3]
            steps = ir.Constant(ir.VectorType(f32, 16), [float(n % 8) for n in range(16)])
            negative = ir.Constant(ir.VectorType(i1, 16), [n >= 8 for n in range(16)])
            codes = self.to_codes(b.select(negative, b.fsub(lb, b.fmul(steps, st)), b.fadd(hb, b.fmul(steps, st))))
            return b.shuffle_vector(codes, self.zero16, self.widen)
        if cache is None:
            codes = levels()
        else:
            slot = b.gep(cache, [_I32(0), t])
            with b.if_then(fresh):
                b.store(levels(), slot)
            codes = b.load(slot)
        counts_at = b.add(self.counts, b.mul(t, self.counts_row))
        row_at = b.add(self.dense, b.mul(t, self.dense_row))
        return codes, entry, scalars, counts_at, row_at

    def segment(self, row, seg):
        """Segment seg of the current row (SEGMENT values of its kv-heads, in order) -> (its nibbles:
        values 0..31 and 32..63 as <32 x i16>, the same as level codes, its entry count as i64)."""
        i8, i16, i64 = _I8, _I16, _I64
        b = self.builder
        levels, _, _, counts_at, row_at = row
        nibbles = b.load(self.at(b.add(row_at, b.shl(seg, i64(5))), ir.VectorType(i8, 32)),
                         align=1)
        wide = b.zext(nibbles, ir.VectorType(i16, 32))  # one vpmovzxbw, then both nibbles in 16-bit lanes
        low, high = b.and_(wide, self.full(i16, 15, 32)), b.lshr(wide, self.full(i16, 4, 32))
        n = b.zext(b.load(self.at(b.add(counts_at, seg), i8)), i64)
        return low, high, b.call(self.permw, [levels, low]), b.call(self.permw, [levels, high]), n

    def entry_table(self, row, minus_levels):
        """Row's codes of every value a sparse entry can give, by key = nibble | outer << 4 | negative
        << 5 (entries): (keys 0..31, keys 32..63) as two <32 x i16>, one vpermi2w's table. With
        minus_levels each less the row's level code at the nibble: what the entry adds to the dense value."""
        f32, i32 = _F32, _I32
        b = self.builder
        st1, st2, sl, sh = row[2][3:]
        y = ir.Constant(ir.VectorType(f32, 16), [float(n) for n in range(16)])
        inner, outer = b.fmul(y, st1), b.fmul(y, st2)  # true = (outer ? (negative ? sl : sh) : 0) +- y * step
        words = ir.VectorType(_I16, 32)
        quarters = [b.bitcast(b.fptosi(b.call(self.rint, [x]), ir.VectorType(i32, 16)), words)
                    for x in (inner, b.fadd(sh, outer), b.fneg(inner), b.fsub(sl, outer))]
        low_words = ir.Constant(ir.VectorType(i32, 32), list(range(0, 64, 2)))  # two quarters' codes in one shuffle
        halves = [b.shuffle_vector(quarters[k], quarters[k + 1], low_words) for k in (0, 2)]
        if minus_levels:
            twice = b.shuffle_vector(row[0], row[0], ir.Constant(ir.VectorType(i32, 32), list(range(16)) * 2))
            halves = [b.sub(x, twice) for x in halves]
        return halves

    def entry_key(self, e, nibbles):
        """Entries' bytes e and their nibbles (<32 x i16> each) -> their keys in entry_table: the
        nibble, the group bit (byte bit 6, outer) at 4 and the sign bit (bit 7) at 5."""
        b = self.builder
        return b.or_(nibbles, b.and_(b.lshr(e, self.full(_I16, 2, 32)), self.full(_I16, 48, 32)))

    def entries(self, where, left, low, high, table):
        """Up to 16 sparse entries at address `where` (left of them) -> (lanes in use <32 x i1>, their
        indices j <32 x i16>, their codes from `table` (entry_table) <32 x i16>; lanes past `left`,
        and lanes 16.., 0)."""
        i8, i16, i32, i64 = _I8, _I16, _I32, _I64
        b = self.builder
        vec = ir.VectorType
        left = b.select(b.icmp_signed("<", left, i64(16)), left, i64(16))
        # lanes in use as a mask from the count (one kmovd): a vector compare would take the shuffle port
        mask = b.bitcast(b.sub(b.shl(i32(1), b.trunc(left, i32)), i32(1)), vec(_I1, 32))
        e = b.zext(b.call(self.masked_load, [self.at(where, i8), i32(1), mask, self.full(i8, 0, 32)]), vec(i16, 32))
        j = b.and_(e, self.full(i16, 63, 32))
        key = self.entry_key(e, b.call(self.perm2w, [low, j, high]))  # the nibbles at the indices
        return mask, j, b.select(mask, b.call(self.perm2w, [table[0], key, table[1]]), self.full(i16, 0, 32))


@intrinsic
def vnni_block_scores(typingctx, s, qi, qscale, dense, scales, counts, sparse, thr, scale, acc):
    """s[h, t] = scale * q_h . k_t for the 16 rows of one full, quantized block, every query head h
    against its kv-head's keys, in integer dot products on the store's codes: no row is decoded to floats.

    The rows as _RowCodes writes them; the queries as int16 multiples of their own scale (qi,
    qscale: query_codes). Rows go in pairs, side by side in each vector: 16 channels of one row in
    lanes 0..15 and the same 16 of the other in 16..31, so that one vpermw looks up both rows'
    levels (from a table of both rows' 16), one vpdpwssd against the query's 16 codes, broadcast to
    both halves, adds both rows' products, and a lane of the sums holds one row. The sparse entries
    (up to 16 a row and segment, the pair's in one vector) add (true code - level code) times the
    query's codes at their indices, gathered from registers (vpermi2w) once for both rows, with one
    more vpdpwssd: the level's product comes out, the true value's goes in. A row's levels and
    scalars serve all its kv-heads. Exact in int32: a lane sums four level products and two
    entries' (|delta| <= 2 * CODE_MAX), < 8 * CODE_MAX^2 < 2^31, the other four level products
    apart. Each pair's sums go to acc [Hq, 16, 16] (8 vectors a head); a shuffle tree of three
    rounds sums each row's 8 lanes, and they are scaled by the rows' units (one row a pass, the
    sums took a 4-round tree and each entry gather was done twice). Both roundings are to
    1 / 16383 of the row's or the query's largest value (scores within ~2e-4 of the largest one,
    tests/test_kv_formats.py).

    s [Hq, 16], qi [Hq, D] int16, qscale [Hq], dense [16, C/2], scales [16, 3] (fp16 bits), counts
    [16, C/64], sparse [budget] (the block's), thr [4]; D a multiple of 64, Hq a multiple of C/D.
    Needs AVX512-BW and -VNNI (VNNI); compiled elsewhere it traps, and the kernel never calls it there."""
    if not _scores_args(s, qi, qscale, dense, scales, counts, sparse, thr, acc):
        return None

    def codegen(context, builder, signature, args):
        f32, i16, i32, i64 = _F32, _I16, _I32, _I64
        vec = ir.VectorType
        if not VNNI:
            return _trap(context, builder)
        arrays, base, heads, dim, (segs_per_head, kv_heads, group), s_row, scale = _scores_setup(
            context, builder, signature, args)
        rc = _RowCodes(builder, *(arrays[i] for i in (3, 4, 5, 6, 7)))
        q_row = builder.shl(dim, i64(1))

        def partials_at(h, p):  # query head h's sums of rows 2p, 2p + 1 (8 lanes each) in acc [Hq, 16, 16]
            return rc.at(builder.add(base[9], builder.shl(builder.add(builder.mul(h, i64(ROWS)), p), i64(6))),
                         vec(f32, 16))

        def dot(x, y, acc=None):
            x, y = (builder.bitcast(v, vec(i32, 16)) for v in (x, y))
            return _dpwssd(builder, acc or rc.full(i32, 0), x, y)

        def both(x, y):  # two <n x T> side by side
            n = x.type.count
            return builder.shuffle_vector(x, y, ir.Constant(vec(i32, 2 * n), list(range(2 * n))))

        def load(address, kind, align):
            return builder.load(rc.at(address, kind), align=align)

        def words(n):
            return rc.full(i16, n, 32)

        i8 = _I8
        upper = ir.Constant(vec(i16, 32), [0] * 16 + [16] * 16)  # the second row's lanes: its half of a pair's table
        in_second = ir.Constant(vec(_I1, 32), [False] * 16 + [True] * 16)
        low16 = rc.fn("llvm.masked.load.v16i8.p0", vec(i8, 16), [i8.as_pointer(), i32, vec(_I1, 16), vec(i8, 16)])
        starts = [cgutils.alloca_once(builder, i64) for _ in (0, 1)]  # each row's next entry
        rc.first_row()
        with cgutils.for_range(builder, i64(ROWS // 2)) as pair_loop:
            p = pair_loop.index
            ts = [builder.add(builder.shl(p, i64(1)), i64(r)) for r in (0, 1)]
            for t, at in zip(ts, starts):
                rc.walk(t, at)
            rows = [rc.row(t, at) for t, at in zip(ts, starts)]
            tables = [rc.entry_table(row, True) for row in rows]
            levels = builder.shuffle_vector(rows[0][0], rows[1][0],  # both rows' 16 levels
                                            ir.Constant(vec(i32, 32), list(range(16)) + list(range(32, 48))))

            def lanes_of(n):  # the lanes of a row's first `n` (i64) entries, at most 16, as an i16 mask
                n = builder.trunc(builder.select(builder.icmp_signed("<", n, i64(16)), n, i64(16)), i32)
                return builder.trunc(builder.sub(builder.shl(i32(1), n), i32(1)), _I16)

            def entries(at, nibbles):
                """Entries of the pair's rows, lanes 0..15 the first's and 16..31 the second's (`at`: each
                row's address and i16 lane mask) -> (true - level codes, their indices), <32 x i16> each."""
                masks = [builder.bitcast(m, vec(_I1, 16)) for _, m in at]
                e = both(*(builder.call(low16, [rc.at(a, i8), i32(1), m, rc.full(i8, 0, 16)])
                           for (a, _), m in zip(at, masks)))
                e = builder.zext(e, vec(i16, 32))
                j = builder.and_(e, words(63))
                # the nibble of (row, j): lane j & 15 of the row's half, in the vector of channel j's sixteen
                where = builder.or_(builder.and_(j, words(15)), builder.shl(builder.and_(j, words(16)), words(1)))
                where = builder.or_(where, upper)
                first, second = (builder.call(rc.perm2w, [nibbles[k], where, nibbles[k + 1]]) for k in (0, 2))
                key = rc.entry_key(e, builder.select(builder.icmp_unsigned("!=", builder.and_(j, words(32)), words(0)),
                                                     second, first))
                delta = builder.select(in_second, builder.call(rc.perm2w, [tables[1][0], key, tables[1][1]]),
                                       builder.call(rc.perm2w, [tables[0][0], key, tables[0][1]]))
                return builder.select(builder.bitcast(both(*masks), vec(_I1, 32)), delta, words(0)), j

            with cgutils.for_range(builder, kv_heads) as kvh, cgutils.for_range(builder, segs_per_head) as seg_loop:
                local = seg_loop.index
                seg = builder.add(builder.mul(kvh.index, segs_per_head), local)
                head0 = builder.mul(kvh.index, group)  # the kv-head's first query head
                q_seg = builder.add(base[1], builder.shl(local, i64(7)))

                def query(g):  # query head0 + g: its address and 64 codes in two vectors
                    h = builder.add(head0, g)
                    q_at = builder.add(q_seg, builder.mul(h, q_row))
                    return h, q_at, [load(builder.add(q_at, i64(64 * k)), vec(i16, 32), 2) for k in (0, 1)]
                # the rows' nibbles side by side: bytes 0..15, then 16..31, of each row's segment
                at = builder.shl(seg, i64(5))
                halves = [builder.zext(both(*(load(builder.add(row[4], builder.add(at, i64(off))), vec(i8, 16), 1)
                                              for row in rows)), vec(i16, 32)) for off in (0, 16)]
                nibbles = [builder.and_(halves[0], words(15)), builder.and_(halves[1], words(15)),
                           builder.lshr(halves[0], words(4)), builder.lshr(halves[1], words(4))]
                codes = [builder.call(rc.permw, [levels, builder.or_(x, upper)]) for x in nibbles]  # channels 16k..
                ns = [builder.zext(load(builder.add(row[3], seg), i8, 1), i64) for row in rows]
                at = [builder.add(rc.sparse, builder.load(e)) for e in starts]
                delta, jj = entries([(a, lanes_of(n)) for a, n in zip(at, ns)], nibbles)
                first = builder.icmp_unsigned("==", local, i64(0))
                with cgutils.for_range(builder, group) as g:
                    h, q_at, (q0, q1) = query(g.index)
                    # channels 16k..16k+15 of the query in both halves (a 256-bit broadcast load)
                    chunks = [load(builder.add(q_at, i64(32 * k)), vec(i16, 16), 2) for k in range(4)]
                    chunks = [both(x, x) for x in chunks]
                    # two integer sums: a lane adds 8 level products and 2 entries', past 2^31 in one
                    part0 = dot(codes[1], chunks[1], dot(codes[0], chunks[0]))
                    part1 = dot(codes[3], chunks[3], dot(codes[2], chunks[2]))
                    part1 = dot(delta, builder.call(rc.perm2w, [q0, jj, q1]), part1)
                    total = builder.fadd(builder.sitofp(part0, vec(f32, 16)), builder.sitofp(part1, vec(f32, 16)))
                    out = partials_at(h, p)
                    earlier = builder.select(first, rc.full(f32, 0.0), builder.load(out, align=4))
                    builder.store(builder.fadd(total, earlier), out, align=4)
                none = ir.Constant(_I16, 0)
                for r in (0, 1):  # a segment with more than 16 entries in a row: the rest in passes of 16, in its half
                    with cgutils.for_range_slice(builder, i64(16), ns[r], i64(16)) as (k, _):
                        rest = (builder.add(at[r], k), lanes_of(builder.sub(ns[r], k)))
                        delta, jj = entries([rest, (rest[0], none)] if r == 0 else [(rest[0], none), rest], nibbles)
                        with cgutils.for_range(builder, group) as g:
                            h, _, (q0, q1) = query(g.index)
                            total = builder.sitofp(dot(delta, builder.call(rc.perm2w, [q0, jj, q1])), vec(f32, 16))
                            out = partials_at(h, p)
                            builder.store(builder.fadd(total, builder.load(out, align=4)), out, align=4)
                for e, n in zip(starts, ns):
                    builder.store(builder.add(builder.load(e), n), e)
        # lane k of the pair sums: row 2k (k < 8) or 2(k - 8) + 1; to rows in order
        order = ir.Constant(vec(i32, 16), [t // 2 + 8 * (t % 2) for t in range(ROWS)])
        with cgutils.for_range(builder, heads) as g:
            pairs = [builder.load(partials_at(g.index, i64(p)), align=4) for p in range(ROWS // 2)]
            sums = lane_sums(builder, pairs)  # lane k + 8 g: group g (row 2k + g) of pair k
            sums = builder.shuffle_vector(sums, sums, order)
            factor = builder.fmul(scale, builder.load(builder.gep(arrays[2].data, [g.index])))
            scores = builder.fmul(builder.fmul(sums, rc.unit), rc.lanes(factor))
            builder.store(scores, rc.at(builder.add(base[0], builder.mul(g.index, s_row)), vec(f32, 16)), align=4)
        return context.get_dummy_value()
    return types.none(s, qi, qscale, dense, scales, counts, sparse, thr, scale, acc), codegen


MAX_HEADS = 256
"""The most query heads vnni_add_weighted_rows takes (its weight codes live in a fixed buffer)."""
WEIGHT_MAX = 8191
"""|weight code| bound of vnni_add_weighted_rows: a product with a value code is < 2^27; the eight a lane gets from
four row pairs stay < 2^30, and each four pairs' sums are added as floats."""


@intrinsic
def vnni_add_weighted_rows(typingctx, acc, w, dense, scales, counts, sparse, thr):
    """acc[h] += sum_t w[h, t] * v_t over the 16 rows of one full, quantized block, every query head
    h over its kv-head's values (the p.v of attend_scores), in integer dot products on the store's
    codes: no row is decoded to floats.

    Each row is built in registers as _RowCodes's int16 codes: its nibbles look up its levels
    (vpermw), and its sparse values, in index order as the quantizer writes them, are put in their
    lanes by masked expands (vpexpandw) whose mask has a bit at each entry's index. Each
    query's weights times the rows' units are rounded to int16 multiples of their largest value /
    WEIGHT_MAX; two rows' codes interleaved channel by channel make vpdpwssd add w_t v_t + w_t+1
    v_t+1 into each channel's lane. A row's levels, computed for its first segment, are kept for the
    others. acc [Hq, D], w [Hq, 16] float32, Hq <= MAX_HEADS; the rest as vnni_block_scores."""
    if not _weighted_args(acc, w, dense, scales, counts, sparse, thr):
        return None

    def codegen(context, builder, signature, args):
        f32, i1, i16, i32, i64 = _F32, _I1, _I16, _I32, _I64
        vec = ir.VectorType
        if not VNNI:
            return _trap(context, builder)
        arrays, heads, (segs_per_head, kv_heads, group), (acc_base, acc_row), (w_base, w_row) = \
            _weighted_setup(context, builder, signature, args)
        rc = _RowCodes(builder, *(arrays[i] for i in (2, 3, 4, 5, 6)))
        expand = rc.fn("llvm.x86.avx512.mask.expand.v32i16", vec(i16, 32), [vec(i16, 32), vec(i16, 32), vec(i1, 32)])
        any_bits = rc.fn("llvm.vector.reduce.or.v16i64", i64, [vec(i64, 16)])
        popcount = rc.fn("llvm.ctpop.i64", i64, [i64])
        interleaved = cgutils.alloca_once(builder, ir.ArrayType(vec(i32, 16), 2 * ROWS))  # row pairs x 4 vectors
        iota = ir.Constant(vec(i16, 32), list(range(32)))
        code = [cgutils.alloca_once(builder, vec(i16, 32)) for _ in (0, 1)]
        one, zero64 = rc.full(i64, 1), rc.full(i64, 0)
        # two rows' codes interleaved within each 128-bit lane (vpunpcklwd / vpunpckhwd, one uop each; a
        # channel-ordered interleave was a vpermt2w, three): vector k of half h holds channel 32 h + 8 L + 4 k + i
        # in lane 4 L + i; `natural` puts each half's two vectors back in channel order, once a head and segment
        channels = [ir.Constant(vec(i32, 32), [x for lane in range(4) for i in range(4 * k, 4 * k + 4)
                                               for x in (8 * lane + i, 32 + 8 * lane + i)]) for k in (0, 1)]
        natural = [ir.Constant(vec(i32, 16), [4 * (2 * m + j // 8) + j % 8 % 4 + 16 * (j % 8 // 4) for j in range(16)])
                   for m in (0, 1)]
        starts = cgutils.alloca_once(builder, i64, ROWS)  # each row's next entry: walked once, moved on by segment
        # every query head's weights as codes first (independent chains: computed where each head's
        # dots wait on them, their max, division and rounding stalled the dots, ~11 % of the kernel)
        pair_codes, units = _weight_codes(builder, rc, heads, w_base, w_row)
        levels = cgutils.alloca_once(builder, ir.ArrayType(vec(i16, 32), ROWS))
        tables = cgutils.alloca_once(builder, ir.ArrayType(vec(i16, 32), 2 * ROWS))  # each row's entry_table
        rc.first_row()
        with cgutils.for_range(builder, kv_heads) as kvh, cgutils.for_range(builder, segs_per_head) as seg_loop:
            local = seg_loop.index
            seg = builder.add(builder.mul(kvh.index, segs_per_head), local)
            head0 = builder.mul(kvh.index, group)  # the kv-head's first query head
            first = builder.icmp_unsigned("==", seg, i64(0))
            with cgutils.for_range(builder, i64(ROWS // 2)) as pair_loop:
                p = pair_loop.index
                for t in (0, 1):  # rows 2p and 2p + 1
                    row_index = builder.add(builder.shl(p, i64(1)), i64(t))
                    start_at = builder.gep(starts, [row_index])
                    with builder.if_then(first):  # rows in order, once
                        rc.walk(row_index, start_at)
                    row = rc.row(row_index, start_at, levels, first)
                    slots = [builder.gep(tables, [i32(0), builder.add(builder.shl(row_index, i64(1)), i64(h))])
                             for h in (0, 1)]
                    with builder.if_then(first):
                        for slot, half in zip(slots, rc.entry_table(row, False)):
                            builder.store(half, slot)
                    table = [builder.load(slot) for slot in slots]
                    low, high, code0, code1, n = rc.segment(row, seg)
                    builder.store(code0, code[0])
                    builder.store(code1, code[1])
                    start = builder.add(rc.sparse, builder.load(row[1]))
                    with cgutils.for_range_slice(builder, i64(0), n, i64(16)) as (k, _):
                        mask, j, values = rc.entries(builder.add(start, k), builder.sub(n, k), low, high, table)
                        bit = builder.shl(one, builder.zext(builder.shuffle_vector(j, j, rc.first16), vec(i64, 16)))
                        bits = builder.call(any_bits, [builder.select(builder.shuffle_vector(mask, mask, rc.first16), bit, zero64)])
                        # from registers; a vpexpandw from the values just stored to memory took a row ~72
                        # cycles instead of ~63 (one kv-head, 3 queries, blocks in cache)
                        past = builder.trunc(builder.call(popcount, [builder.and_(bits, i64(0xFFFFFFFF))]), i16)
                        later = builder.call(rc.permw, [values, builder.add(iota, splat(builder, past, 32))])
                        for h, (x, part) in enumerate(((values, bits), (later, builder.lshr(bits, i64(32))))):
                            lanes = builder.bitcast(builder.trunc(part, i32), vec(i1, 32))
                            builder.store(builder.call(expand, [x, builder.load(code[h]), lanes]), code[h])
                    builder.store(builder.add(builder.load(row[1]), n), row[1])
                    current = [builder.load(c) for c in code]
                    if t:
                        for h in (0, 1):
                            for k, lanes in enumerate(channels):
                                pair = builder.shuffle_vector(earlier[h], current[h], lanes)
                                at = builder.add(builder.shl(p, i64(2)), i64(2 * h + k))
                                slot = builder.gep(interleaved, [i32(0), at])
                                builder.store(builder.bitcast(pair, vec(i32, 16)), slot)
                    earlier = current
            with cgutils.for_range(builder, group) as g:
                h = builder.add(head0, g.index)
                # each row pair's two codes broadcast from memory (a load); from a register, each is a vpermd
                # on the shuffle port. The address goes through an empty asm block, or LLVM forwards the store.
                at = builder.asm(ir.FunctionType(i64, [i64]), "", "=r,0",
                                 [builder.ptrtoint(builder.gep(pair_codes, [h]), i64)], False)
                sums = [None] * 4
                for pairs in (range(ROWS // 4), range(ROWS // 4, ROWS // 2)):  # two integer sums: no overflow
                    part = [rc.full(i32, 0)] * 4
                    for p in pairs:
                        both = splat(builder, builder.load(rc.at(builder.add(at, i64(4 * p)), i32), align=4), 16)
                        for k in range(4):
                            x = builder.load(builder.gep(interleaved, [i32(0), i32(4 * p + k)]))
                            part[k] = _dpwssd(builder, part[k], x, both)
                    part = [builder.sitofp(x, vec(f32, 16)) for x in part]
                    sums = part if sums[0] is None else [builder.fadd(x, y) for x, y in zip(sums, part)]
                unit = rc.lanes(builder.load(builder.gep(units, [h])))
                row_at = builder.add(acc_base, builder.mul(h, acc_row))
                sums = [builder.shuffle_vector(sums[k - k % 2], sums[k - k % 2 + 1], natural[k % 2]) for k in range(4)]
                for k in range(4):
                    out = rc.at(builder.add(row_at, builder.shl(builder.add(builder.mul(local, i64(SEGMENT)), i64(16 * k)),
                                                                i64(2))), vec(f32, 16))
                    total = builder.fadd(builder.load(out, align=4), builder.fmul(sums[k], unit))
                    builder.store(total, out, align=4)
        return context.get_dummy_value()
    return types.none(acc, w, dense, scales, counts, sparse, thr), codegen


def _weight_codes(builder, rc, heads, w_base, w_row):
    """LLVM IR: each query head's 16 weights (rows of w at w_base, w_row bytes apart) times the
    rows' units, as int16 codes of their largest value / WEIGHT_MAX -> (codes [MAX_HEADS] <8 x i32>,
    each row pair's two codes a dword; units [MAX_HEADS] float32, a code's value). In fixed buffers
    in the entry block (the IR lands in the caller's loop, where a sized alloca grew the stack every call)."""
    f32, i32 = _F32, _I32
    vec = ir.VectorType
    pair_codes = cgutils.alloca_once(builder, vec(i32, 8), size=MAX_HEADS)
    units = cgutils.alloca_once(builder, f32, size=MAX_HEADS)
    with cgutils.for_range(builder, heads) as h:
        weights = builder.load(rc.at(builder.add(w_base, builder.mul(h.index, w_row)), vec(f32, 16)), align=4)
        weights = builder.fmul(weights, rc.unit)
        top = weights
        for span in (8, 4, 2, 1):
            turned = ir.Constant(vec(i32, 16), [(i + span) % 16 for i in range(16)])
            top = rc.vmax(top, builder.shuffle_vector(top, top, turned))
        top = rc.vmax(builder.extract_element(top, i32(0)), f32(1e-30))
        codes = rc.to_codes(builder.fmul(weights, rc.lanes(builder.fdiv(f32(float(WEIGHT_MAX)), top))))
        builder.store(builder.bitcast(codes, vec(i32, 8)), builder.gep(pair_codes, [h.index]))
        builder.store(builder.fmul(top, f32(1.0 / WEIGHT_MAX)), builder.gep(units, [h.index]))
    return pair_codes, units


_FIXED_ENTRIES = 8  # entries of a segment _Avx2Rows.codes takes without a branch (past its count, to a sink)


class _Avx2Rows:
    """LLVM IR shared by avx2_block_scores and avx2_add_weighted_rows: one full block's rows as
    _RowCodes's int16 codes, built with AVX2 (no vpermw or vpexpandw). Each row's 16 level codes
    are split into their low and high bytes, two 16-byte tables that vpshufb looks the nibbles up in;
    the two bytes of each value, interleaved (vpunpck[lh]bw), are its code. A segment's 32 bytes of
    nibbles are first put in the order [0..7, 16..23 | 8..15, 24..31] (one vpermq), so that the codes
    come out in channel order, 16 a vector. The sparse entries write (true - level) codes into a
    zeroed buffer of the segment's 64 channels, one scalar store each (the first eight without a
    branch: those past the count go to a sink), and the four vectors of it are added to the codes:
    the row's true codes, exact. On a Zen 1 the entries are about half of each kernel's time (keys
    ~48 ns a kv-head's row, ~21 without them); neither store forwarding (their stores made a block
    ahead) nor their nibbles' loads (from a byte buffer) changed that (bench_oaken_rows)."""

    def __init__(self, builder, dense, scales, counts, sparse, thr):
        i8, i16, i64 = _I8, _I16, _I64
        vec = ir.VectorType
        self.builder = b = builder
        self.rc = rc = _RowCodes(builder, dense, scales, counts, sparse, thr)
        self.pshufb = rc.fn("llvm.x86.avx2.pshuf.b", vec(i8, 32), [vec(i8, 32)] * 2)
        self.bytes = cgutils.alloca_once(b, ir.ArrayType(vec(i8, 32), 2 * ROWS))  # each row's low, high byte tables
        self.deltas = cgutils.alloca_once(b, ir.ArrayType(vec(i16, 64), ROWS))  # each row's entry_table, less levels
        self.starts = cgutils.alloca_once(b, i64, ROWS)  # each row's next entry: moved on segment by segment
        # a segment's (true - level) codes, zero elsewhere; past the channels, the sink. Zeroed once, in the
        # function's entry block (alloca_once): every codes() zeroes the channels it read again
        self.patch = cgutils.alloca_once(b, vec(i16, 2 * SEGMENT))
        twice = ir.Constant(vec(_I32, 32), list(range(16)) * 2)
        rc.first_row()
        with cgutils.for_range(b, i64(ROWS)) as loop:
            t = loop.index
            start = b.gep(self.starts, [t])
            rc.walk(t, start)
            row = rc.row(t, start)
            levels = b.shuffle_vector(row[0], row[0], twice)  # <32 x i16>: the 16 codes twice
            for k, x in enumerate((levels, b.lshr(levels, rc.full(i16, 8, 32)))):
                b.store(b.trunc(x, vec(i8, 32)), b.gep(self.bytes, [_I32(0), b.add(b.shl(t, i64(1)), i64(k))]))
            low, high = rc.entry_table(row, True)
            b.store(b.shuffle_vector(low, high, ir.Constant(vec(_I32, 64), list(range(64)))),
                    b.gep(self.deltas, [_I32(0), t]))

    def codes(self, t, seg):
        """Row t's true codes of segment seg (t, seg: i64; a row's segments in order) -> four <16 x i16>,
        channels 0..15, 16..31, 32..47, 48..63."""
        i8, i16, i32, i64 = _I8, _I16, _I32, _I64
        b, rc = self.builder, self.rc
        vec = ir.VectorType
        row_at = b.add(b.add(rc.dense, b.mul(t, rc.dense_row)), b.shl(seg, i64(5)))
        raw = b.load(rc.at(row_at, vec(i64, 4)), align=1)
        x = b.bitcast(b.shuffle_vector(raw, raw, ir.Constant(vec(i32, 4), [0, 2, 1, 3])), vec(i8, 32))
        fifteen = rc.full(i8, 15, 32)
        tables = [b.load(b.gep(self.bytes, [i32(0), b.add(b.shl(t, i64(1)), i64(k))])) for k in (0, 1)]
        unpack = [ir.Constant(vec(i32, 32), [x for lane in (0, 16) for i in range(first, first + 8)
                                             for x in (lane + i, 32 + lane + i)]) for first in (0, 8)]
        words = []
        for nibbles in (b.and_(x, fifteen), b.and_(b.lshr(x, rc.full(i8, 4, 32)), fifteen)):
            low, high = (b.call(self.pshufb, [table, nibbles]) for table in tables)
            words += [b.bitcast(b.shuffle_vector(low, high, mask), vec(i16, 16)) for mask in unpack]
        # the entries, one scalar store each into the patch (branch-free per entry)
        start_at = b.gep(self.starts, [t])
        first = b.load(start_at)
        n = b.zext(b.load(rc.at(b.add(b.add(rc.counts, b.mul(t, rc.counts_row)), seg), i8)), i64)
        deltas = b.bitcast(b.gep(self.deltas, [i32(0), t]), i16.as_pointer())
        patch = b.bitcast(self.patch, i16.as_pointer())

        def entry(k, e, sink=False):  # entry k (e: i64) of the segment: its (true - level) code into the patch
            j = b.and_(e, i64(63))
            if sink:  # past the segment's count: to a slot past the channels (64)
                j = b.select(b.icmp_unsigned("<", k, n), j, i64(SEGMENT))
            byte = b.zext(b.load(rc.at(b.add(row_at, b.and_(j, i64(31))), i8)), i64)  # value j's nibble, as stored
            nibble = b.and_(b.lshr(byte, b.shl(b.lshr(j, i64(5)), i64(2))), i64(15))
            key = b.or_(nibble, b.and_(b.lshr(e, i64(2)), i64(48)))  # entry_key's
            b.store(b.load(b.gep(deltas, [key])), b.gep(patch, [j]))
        for k in range(0, _FIXED_ENTRIES, 8):  # eight entries a load (the slack: OakenKVStore.sparse)
            eight = b.load(rc.at(b.add(rc.sparse, b.add(first, i64(k))), i64), align=1)
            for i in range(8):
                entry(i64(k + i), b.and_(b.lshr(eight, i64(8 * i)), i64(255)), sink=True)
        with cgutils.for_range_slice(b, i64(_FIXED_ENTRIES), n, i64(1)) as (k, _):
            entry(k, b.zext(b.load(rc.at(b.add(rc.sparse, b.add(first, k)), i8)), i64))
        b.store(b.add(first, n), start_at)
        out = []
        for k in range(4):
            at = b.bitcast(b.gep(patch, [i64(16 * k)]), vec(i16, 16).as_pointer())
            out.append(b.add(words[k], b.load(at, align=2)))
            b.store(rc.full(i16, 0, 16), at, align=2)
        return out


@intrinsic
def avx2_block_scores(typingctx, s, qi, qscale, dense, scales, counts, sparse, thr, scale, acc):
    """vnni_block_scores with AVX2: s[h, t] = scale * q_h . k_t for the 16 rows of one full,
    quantized block, in int16 dot products on _Avx2Rows's codes (vpmaddwd against the query's codes,
    a row at a time: a lane sums 8 products, < 8 * CODE_MAX^2 < 2^31). Each (head, row)'s 8 lanes go
    to acc as floats, and a shuffle tree (lane_sums) sums them. Arguments as vnni_block_scores'."""
    if not _scores_args(s, qi, qscale, dense, scales, counts, sparse, thr, acc):
        return None

    def codegen(context, builder, signature, args):
        f32, i16, i32, i64 = _F32, _I16, _I32, _I64
        vec = ir.VectorType
        if not AVX2:
            return _trap(context, builder)
        b = builder
        arrays, base, heads, dim, (segs_per_head, kv_heads, group), s_row, scale = _scores_setup(
            context, b, signature, args)
        rows = _Avx2Rows(b, *(arrays[i] for i in (3, 4, 5, 6, 7)))
        rc = rows.rc
        floats = vec(f32, 8)

        def partial_at(h, t):  # (head h, row t)'s 8 lanes in acc [Hq, 16, 16]
            return rc.at(b.add(base[9], b.shl(b.add(b.mul(h, i64(ROWS)), t), i64(6))), floats)

        with cgutils.for_range(b, kv_heads) as kvh, cgutils.for_range(b, i64(ROWS)) as row_loop, \
                cgutils.for_range(b, segs_per_head) as seg_loop:
            t, local = row_loop.index, seg_loop.index
            codes = rows.codes(t, b.add(b.mul(kvh.index, segs_per_head), local))
            first = b.icmp_unsigned("==", local, i64(0))
            q_seg = b.add(base[1], b.shl(local, i64(7)))
            with cgutils.for_range(b, group) as g:
                h = b.add(b.mul(kvh.index, group), g.index)
                q_at = b.add(q_seg, b.mul(h, b.shl(dim, i64(1))))
                total = None
                for k in range(4):
                    y = b.load(rc.at(b.add(q_at, i64(32 * k)), vec(i16, 16)), align=2)
                    x = _pmaddwd(b, codes[k], y)
                    total = x if total is None else b.add(total, x)
                out = partial_at(h, t)
                earlier = b.select(first, ir.Constant(floats, [0.0] * 8), b.load(out, align=4))
                b.store(b.fadd(b.sitofp(total, floats), earlier), out, align=4)
        with cgutils.for_range(b, heads) as g:
            sums = [lane_sums(b, [b.load(partial_at(g.index, i64(t)), align=4) for t in range(first, first + 8)])
                    for first in (0, 8)]
            sums = b.shuffle_vector(sums[0], sums[1], ir.Constant(vec(i32, 16), list(range(16))))
            factor = b.fmul(scale, b.load(b.gep(arrays[2].data, [g.index])))
            scores = b.fmul(b.fmul(sums, rc.unit), rc.lanes(factor))
            b.store(scores, rc.at(b.add(base[0], b.mul(g.index, s_row)), vec(f32, 16)), align=4)
        return context.get_dummy_value()
    return types.none(s, qi, qscale, dense, scales, counts, sparse, thr, scale, acc), codegen


@intrinsic
def avx2_add_weighted_rows(typingctx, acc, w, dense, scales, counts, sparse, thr):
    """vnni_add_weighted_rows with AVX2: acc[h] += sum_t w[h, t] * v_t over the 16 rows of one full,
    quantized block, in int16 dot products on _Avx2Rows's codes. Two rows' codes interleaved channel
    by channel (vpunpck[lh]wd) make vpmaddwd add w_t v_t + w_t+1 v_t+1 into each channel's lane; a
    lane sums the 16 rows' products, < 16 * CODE_MAX * WEIGHT_MAX < 2^31. Arguments as
    vnni_add_weighted_rows'."""
    if not _weighted_args(acc, w, dense, scales, counts, sparse, thr):
        return None

    def codegen(context, builder, signature, args):
        f32, i32, i64 = _F32, _I32, _I64
        vec = ir.VectorType
        if not AVX2:
            return _trap(context, builder)
        b = builder
        arrays, heads, (segs_per_head, kv_heads, group), (acc_base, acc_row), (w_base, w_row) = \
            _weighted_setup(context, b, signature, args)
        rows = _Avx2Rows(b, *(arrays[i] for i in (2, 3, 4, 5, 6)))
        rc = rows.rc
        pair_codes, units = _weight_codes(b, rc, heads, w_base, w_row)
        dwords, floats = vec(i32, 8), vec(f32, 8)
        # row pairs x 8 vectors: vector 2k + m holds, for channels 16k + 4m + [0..3 | 8..11], both rows' codes
        interleaved = cgutils.alloca_once(b, ir.ArrayType(dwords, 4 * ROWS))
        unpack = [ir.Constant(vec(i32, 16), [x for lane in (0, 8) for i in range(first, first + 4)
                                             for x in (lane + i, 16 + lane + i)]) for first in (0, 4)]
        natural = [ir.Constant(vec(i32, 8), [first + i + 8 * m for m in (0, 1) for i in range(4)]) for first in (0, 4)]
        with cgutils.for_range(b, kv_heads) as kvh, cgutils.for_range(b, segs_per_head) as seg_loop:
            local = seg_loop.index
            seg = b.add(b.mul(kvh.index, segs_per_head), local)
            with cgutils.for_range(b, i64(ROWS // 2)) as pair_loop:
                p = pair_loop.index
                both = [rows.codes(b.add(b.shl(p, i64(1)), i64(r)), seg) for r in (0, 1)]
                for k in range(4):
                    for m, mask in enumerate(unpack):
                        x = b.bitcast(b.shuffle_vector(both[0][k], both[1][k], mask), dwords)
                        b.store(x, b.gep(interleaved, [i32(0), b.add(b.shl(p, i64(3)), i64(2 * k + m))]))
            with cgutils.for_range(b, group) as g:
                h = b.add(b.mul(kvh.index, group), g.index)
                # each row pair's two codes broadcast from memory (see vnni_add_weighted_rows)
                at = b.asm(ir.FunctionType(i64, [i64]), "", "=r,0", [b.ptrtoint(b.gep(pair_codes, [h]), i64)], False)
                sums = [None] * 8
                for p in range(ROWS // 2):
                    weights = splat(b, b.load(rc.at(b.add(at, i64(4 * p)), i32), align=4), 8)
                    for k in range(8):
                        x = _pmaddwd(b, b.load(b.gep(interleaved, [i32(0), i32(8 * p + k)])), weights)
                        sums[k] = x if sums[k] is None else b.add(sums[k], x)
                unit = splat(b, b.load(b.gep(units, [h])), 8)
                sums = [b.fmul(b.sitofp(x, floats), unit) for x in sums]
                row_at = b.add(acc_base, b.add(b.mul(h, acc_row), b.shl(local, i64(8))))
                for k in range(4):
                    for half, mask in enumerate(natural):  # channels 16k + 8 half + 0..7
                        out = rc.at(b.add(row_at, i64(64 * k + 32 * half)), floats)
                        x = b.shuffle_vector(sums[2 * k], sums[2 * k + 1], mask)
                        b.store(b.fadd(b.load(out, align=4), x), out, align=4)
        return context.get_dummy_value()
    return types.none(acc, w, dense, scales, counts, sparse, thr), codegen


int16_block_scores = vnni_block_scores if VNNI else avx2_block_scores
int16_add_weighted_rows = vnni_add_weighted_rows if VNNI else avx2_add_weighted_rows
"""The int16 kernels this CPU runs (the exact kernel, bench_oaken_rows): resolved once, at import."""


def _block_arrays(dense, scales, counts, sparse, thr) -> bool:
    return (c_array(dense, 2, types.uint8) and c_array(scales, 2, types.uint16) and c_array(counts, 2, types.uint8)
            and c_array(sparse, 1, types.uint8) and c_array(thr, 1, types.float32))


def _scores_args(s, qi, qscale, dense, scales, counts, sparse, thr, acc) -> bool:
    """Typing check of vnni_block_scores and avx2_block_scores."""
    return (c_array(s, 2, types.float32) and c_array(qi, 2, types.int16) and c_array(qscale, 1, types.float32)
            and _block_arrays(dense, scales, counts, sparse, thr) and c_array(acc, 3, types.float32))


def _weighted_args(acc, w, dense, scales, counts, sparse, thr) -> bool:
    """Typing check of vnni_add_weighted_rows and avx2_add_weighted_rows."""
    return (c_array(acc, 2, types.float32) and c_array(w, 2, types.float32)
            and _block_arrays(dense, scales, counts, sparse, thr))


def _scores_setup(context, builder, signature, args):
    """LLVM IR: vnni_block_scores's or avx2_block_scores's arguments -> (their arrays by position,
    the arrays' data addresses, query heads, head_dim, _head_layout, s's row stride, scale)."""
    arrays = {i: context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 4, 5, 6, 7, 9)}
    base = {i: builder.ptrtoint(a.data, _I64) for i, a in arrays.items()}
    heads, dim = cgutils.unpack_tuple(builder, arrays[1].shape, 2)
    s_row = cgutils.unpack_tuple(builder, arrays[0].strides, 2)[0]
    scale = context.cast(builder, args[8], signature.args[8], types.float32)
    return arrays, base, heads, dim, _head_layout(builder, heads, dim, arrays[3]), s_row, scale


def _weighted_setup(context, builder, signature, args):
    """LLVM IR: vnni_add_weighted_rows's or avx2_add_weighted_rows's arguments -> (their arrays by
    position, query heads, _head_layout, acc's and w's (data address, row stride))."""
    arrays = {i: context.make_array(signature.args[i])(context, builder, args[i]) for i in range(7)}
    heads, dim = cgutils.unpack_tuple(builder, arrays[0].shape, 2)
    ends = [(builder.ptrtoint(arrays[i].data, _I64), cgutils.unpack_tuple(builder, arrays[i].strides, 2)[0])
            for i in (0, 1)]
    return (arrays, heads, _head_layout(builder, heads, dim, arrays[2])) + tuple(ends)


def _head_layout(builder, heads, dim, dense):
    """LLVM IR: (segments a head, kv-heads, query heads a kv-head) of a block kernel's call, from its
    query heads, head_dim and the block's dense nibbles (C / 2 bytes a row)."""
    i64 = _I64
    kv_heads = builder.udiv(builder.shl(cgutils.unpack_tuple(builder, dense.shape, 2)[1], i64(1)), dim)
    return builder.udiv(dim, i64(SEGMENT)), kv_heads, builder.udiv(heads, kv_heads)


def _trap(context, builder):
    builder.call(_llvm_fn(builder, "llvm.trap", ir.VoidType(), []), [])
    return context.get_dummy_value()


@intrinsic
def _add_turned_rows(typingctx, rows, width, c, cos_b, sin_b, cos_o, sin_o, blk, off0):
    """rows[t] += c[0] * [cos(p), cos(p)] + c[1] * [sin(p), sin(p)] for t < width, at the positions
    p = blk * bs + off0 + t of one block, each angle put together from the block start's (cos_b,
    sin_b [> blk, D / 2]) and the offset's (cos_o, sin_o [bs, D / 2]): cos(a + b) = cos a cos b -
    sin a sin b, sin(a + b) = sin a cos b + cos a sin b. rows [>= width, D], c [2, D], all float32
    C arrays, D a multiple of 16 (OakenKVStore's head_dim is one of 64).

    In LLVM IR because Numba's loop, vectorized, ran its aliasing checks and loop set-up again for
    every 64-value row: here each 8-wide chunk of c is turned to the block start once (the terms
    that multiply cos b and sin b of the offset) and the rows stream past it, two FMAs a value."""
    if not f32_matrices(rows, c, cos_b, sin_b, cos_o, sin_o) or \
            not all(isinstance(x, types.Integer) for x in (width, blk, off0)):
        return None

    def codegen(context, builder, signature, args):
        f32, i64 = _F32, _I64
        vec = ir.VectorType(f32, 8)
        fmuladd = fmuladd8(builder)
        base, row_bytes, shapes = matrix_args(context, builder, signature, args, (0, 2, 3, 4, 5, 6))
        half = builder.lshr(shapes[0][1], i64(1))
        width, blk, off0 = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 7, 8))

        def load(array, row, at):
            address = builder.add(builder.add(base[array], builder.mul(row, row_bytes[array])), at)
            return builder.load(builder.inttoptr(address, vec.as_pointer()), align=4)

        with cgutils.for_range_slice(builder, i64(0), half, i64(8)) as (i, _):
            lo, hi = builder.shl(i, i64(2)), builder.shl(builder.add(i, half), i64(2))
            c0, c1 = [load(1, i64(0), at) for at in (lo, hi)], [load(1, i64(1), at) for at in (lo, hi)]
            cb, sb = load(2, blk, lo), load(3, blk, lo)
            # c0 cos(a + b) + c1 sin(a + b) = cos b (c0 cos a + c1 sin a) + sin b (c1 cos a - c0 sin a)
            on_cos = [builder.call(fmuladd, [c0[j], cb, builder.fmul(c1[j], sb)]) for j in range(2)]
            on_sin = [builder.call(fmuladd, [c1[j], cb, builder.fneg(builder.fmul(c0[j], sb))]) for j in range(2)]
            with cgutils.for_range(builder, width) as t:
                off = builder.add(off0, t.index)
                co, so = load(4, off, lo), load(5, off, lo)
                row = builder.add(base[0], builder.mul(t.index, row_bytes[0]))
                for j, at in enumerate((lo, hi)):
                    ptr = builder.inttoptr(builder.add(row, at), vec.as_pointer())
                    x = builder.call(fmuladd, [on_sin[j], so, builder.load(ptr, align=4)])
                    builder.store(builder.call(fmuladd, [on_cos[j], co, x]), ptr, align=4)
        return context.get_dummy_value()
    return types.none(rows, width, c, cos_b, sin_b, cos_o, sin_o, blk, off0), codegen


@njit(cache=True, nogil=True, inline="always")
def add_key_center(rows, pos0, width, center, kvh):
    """rows[t] += the key center of kv-head kvh turned to position pos0 + t, for t < width, rows
    that lie in one store block (pos0 // bs == (pos0 + width - 1) // bs): c * cos + rotate_half(c)
    * sin (RoPE's rotate-half layout). center = (c [Hkv, 2, D] holding c and rotate_half(c) in
    the store's key space, then cos and sin at the block starts [> pos0 / bs, D / 2] and at the
    offsets in a block [bs, D / 2]); a no-op when the tables are empty (no centering). A table
    with a row per position is 16x larger, and every (sequence, kv-head) of the exact kernel
    streamed it from L3: a fifth of that kernel's time at 16 x 8k."""
    c, cos_b, sin_b, cos_o, sin_o = center
    if cos_b.shape[0]:
        bs = cos_o.shape[0]
        _add_turned_rows(rows, width, c[kvh], cos_b, sin_b, cos_o, sin_o, pos0 // bs, pos0 % bs)


@njit(cache=True, nogil=True, inline="always")
def turn_center_terms(qc, center, j, qcb):
    """qcb [group, D] = the center terms qc (A, B) turned to block j's start (see add_center_scores)."""
    cos_b, sin_b = center[0], center[1]
    half = qcb.shape[1] // 2
    for g in range(qcb.shape[0]):
        for i in range(half):
            a, b, c, t = qc[g, i], qc[g, half + i], cos_b[j, i], sin_b[j, i]
            qcb[g, i] = a * c + b * t
            qcb[g, half + i] = b * c - a * t


@njit(cache=True, nogil=True)
def center_terms(q, center, out):
    """q [B, Hq, D] in store space -> out [B, Hq, D]: per query the terms A (first half) and B of
    q . R(p) c = sum_i A_i cos(w_i p) + B_i sin(w_i p), c the key center of its kv-head (center [Hkv, 2, D]
    holds c and rotate_half(c)): A_i = q_i c_i + q_i+D/2 c_i+D/2, B_i the same with rotate_half(c)."""
    half, group = q.shape[2] // 2, q.shape[1] // center.shape[0]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            c = center[h // group]
            for i in range(half):
                x, y = q[b, h, i], q[b, h, half + i]
                out[b, h, i] = x * c[0, i] + y * c[0, half + i]
                out[b, h, half + i] = x * c[1, i] + y * c[1, half + i]


@njit(cache=True, nogil=True)
def decode_queries(q, key_scales, rotation, key_center, turned, center, codes, scales):
    """One decode step's queries as oaken_decode_attention takes them, in one call (the same steps
    as OakenKVStore's _store_queries and _rotate, center_terms and query_codes, which took ~30 us
    as NumPy and Numba calls at 8 sequences): q [B, Hq, D] -> turned = q * key_scales (store space,
    key_scales [Hkv, D]) times the rotation [D, D] (none when empty); center = the center terms of
    the unturned store-space q (center_terms against key_center [Hkv, 2, D]; skipped when center is
    empty, keys not centered); codes, scales = query_codes(turned) (skipped when codes is empty)."""
    num_seqs, num_heads, dim = q.shape
    group = num_heads // key_scales.shape[0]
    for b in range(num_seqs):
        for h in range(num_heads):
            for d in range(dim):
                turned[b, h, d] = q[b, h, d] * key_scales[h // group, d]
    if center.shape[0]:
        center_terms(turned, key_center, center)
    rows = turned.reshape(num_seqs * num_heads, dim)
    turn_rows(rows, rows.shape[0], rotation, np.empty((_TURN_ROWS, dim), np.float32))
    if codes.shape[0]:
        _query_codes(rows, codes.reshape(rows.shape), scales.reshape(rows.shape[0]))


@njit(cache=True, nogil=True)
def decode_outputs(out, unrotation, value_scales):
    """decode_queries's counterpart, in place: out [B, Hq, D] over the store's values -> over the
    true values (turned back by unrotation, none when empty, then times value_scales [Hkv, D])."""
    num_seqs, num_heads, dim = out.shape
    rows = out.reshape(num_seqs * num_heads, dim)
    turn_rows(rows, rows.shape[0], unrotation, np.empty((_TURN_ROWS, dim), np.float32))
    group = num_heads // value_scales.shape[0]
    for b in range(num_seqs):
        for h in range(num_heads):
            for d in range(dim):
                out[b, h, d] *= value_scales[h // group, d]


@njit(cache=True, nogil=True, inline="always")
def add_center_scores(s, qc, center, j, width, scale, qcb, sc):
    """s[g, t] += scale * (q_g . the key center turned to position j * bs + t), for the rows t <
    width of block j, in the score domain: the store's keys stay as decoded (they may be rotated,
    their center is not). qc [group, D] holds, for each query, the terms A (first half) and B
    (second) of q . R(p) c = sum_i A_i cos(w_i p) + B_i sin(w_i p) (center_terms, decode_queries);
    center = (cos_b, sin_b [> j, D / 2] at the block starts, cs [bs, D] = [cos | sin] at the
    offsets in a block, then the same as vnni_center_scores's pairs). Turning A and B to the block
    start once makes the rest one dot product per row against the fixed table cs, as q . k is
    (block_scores). Scratch qcb [group, D], sc [group, bs]."""
    turn_center_terms(qc, center, j, qcb)
    block_scores(qcb, center[2], width, scale, sc)
    for g in range(qcb.shape[0]):
        for t in range(width):
            s[g, t] += sc[g, t]


@njit(cache=True, nogil=True, inline="always")
def center_scales(qc, scale, inv, factor):
    """For center_codes, per query: inv = CODE_MAX / r, r the largest |(A_i, B_i)| of its center terms
    qc [group, D] (no turn changes it), and factor = scale * r / CODE_MAX^2 (the offsets' codes are
    multiples of 1 / CODE_MAX): once per task of the exact kernel, for all its query heads."""
    half = qc.shape[1] // 2
    for g in range(qc.shape[0]):
        r = np.float32(1e-30)
        for i in range(half):
            r = max(r, np.sqrt(qc[g, i] * qc[g, i] + qc[g, half + i] * qc[g, half + i]))
        inv[g] = np.float32(CODE_MAX) / r
        factor[g] = scale * r / (np.float32(CODE_MAX) * np.float32(CODE_MAX))


@njit(cache=True, nogil=True, inline="always")
def center_codes(qc, center, j, inv, abq):
    """add_center_scores's A and B turned to block j's start (turn_center_terms), as
    vnni_center_scores takes them: abq [group, D] int16, multiples of 1 / inv (center_scales)."""
    _center_codes(abq, qc, center[0], center[1], j, inv)


@intrinsic
def _center_codes(typingctx, abq, qc, cos_b, sin_b, j, inv):
    """center_codes in LLVM IR, sixteen channels at a time: A c + B s and B c - A s, rounded to the
    nearest int16 code (x * inv, ties to even), 32 channels' codes joined by one shuffle (D / 2 a
    multiple of 32). Numba's loops stayed scalar: ~35 ns a block (3 x 64)."""
    if not (c_array(abq, 2, types.int16) and f32_matrices(qc, cos_b, sin_b) and c_array(inv, 1, types.float32)
            and isinstance(j, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        f32, i16, i32, i64 = _F32, _I16, _I32, _I64
        floats = ir.VectorType(f32, 16)
        sig = signature.args
        arrays = [context.make_array(sig[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 5)]
        out_base, q_base, cos_base, sin_base = (builder.ptrtoint(a.data, i64) for a in arrays[:4])
        groups, dim = cgutils.unpack_tuple(builder, arrays[0].shape, 2)
        half = builder.lshr(dim, i64(1))
        row = builder.mul(context.cast(builder, args[4], sig[4], types.intp), builder.shl(half, i64(2)))
        rint = _llvm_fn(builder, "llvm.rint.v16f32", floats, [floats])
        at = lambda base, k: builder.inttoptr(builder.add(base, k), floats.as_pointer())
        words = ir.VectorType(i16, 32)
        low_words = ir.Constant(ir.VectorType(i32, 32), list(range(0, 64, 2)))
        with cgutils.for_range(builder, groups) as g:
            q_row = builder.add(q_base, builder.mul(g.index, builder.shl(dim, i64(2))))
            out_row = builder.add(out_base, builder.mul(g.index, builder.shl(dim, i64(1))))
            f = splat(builder, builder.load(builder.gep(arrays[4].data, [g.index])), 16)
            with cgutils.for_range_slice(builder, i64(0), half, i64(32)) as (i, _):  # 32 channels of A and of B
                turned = ([], [])
                for first in (i, builder.add(i, i64(16))):
                    k = builder.shl(first, i64(2))
                    a, b = (builder.load(at(q_row, x), align=4) for x in (k, builder.add(k, builder.shl(half, i64(2)))))
                    c, t = (builder.load(at(base, builder.add(row, k)), align=4) for base in (cos_base, sin_base))
                    for x, to in zip((builder.fadd(builder.fmul(a, c), builder.fmul(b, t)),
                                      builder.fsub(builder.fmul(b, c), builder.fmul(a, t))), turned):
                        codes = builder.fptosi(builder.call(rint, [builder.fmul(x, f)]), ir.VectorType(i32, 16))
                        to.append(builder.bitcast(codes, words))
                for x, to in zip(turned, (i, builder.add(i, half))):  # two vectors' codes joined by one shuffle
                    builder.store(builder.shuffle_vector(x[0], x[1], low_words),
                                  builder.inttoptr(builder.add(out_row, builder.shl(to, i64(1))), words.as_pointer()), align=2)
        return context.get_dummy_value()
    return types.none(abq, qc, cos_b, sin_b, j, inv), codegen


_CENTER_PAIRS = 4  # channel pairs vnni_center_scores sums in integers before adding them as floats (< 2^31)
_CENTER_QUERIES = 3  # query heads vnni_center_scores takes at once: each pair's 16 rows loaded once for them


@intrinsic
def vnni_center_scores(typingctx, s, abq, factor, pairs):
    """s[g, t] += factor[g] * sum_i abq[g, i] * offsets[t, i] for the 16 rows of a block: the keys'
    centers in the score domain (add_center_scores) in int16 dot products. pairs [D / 2, 32] int16:
    for each two channels, the 16 rows' codes of both side by side (OakenKVStore._offset_pairs), so
    one vpdpwssd against the query's two codes, broadcast, adds both channels to every row's lane.
    Three query heads at a time share each pair's row load (one head at a time: ~133 ns a block of
    9 heads, bound by two loads a vpdpwssd). Without VNNI each vpdpwssd is two AVX2 vpmaddwd (_dpwssd).
    s [G, 16] float32, abq [G, D] int16, factor [G]."""
    if not (c_array(s, 2, types.float32) and c_array(abq, 2, types.int16) and c_array(factor, 1, types.float32)
            and c_array(pairs, 2, types.int16)):
        return None

    def codegen(context, builder, signature, args):
        f32, i32, i64 = _F32, _I32, _I64
        vec = ir.VectorType(i32, 16)
        if not INT16:
            return _trap(context, builder)
        sig = signature.args
        arrays = [context.make_array(sig[i])(context, builder, args[i]) for i in range(4)]
        base = [builder.ptrtoint(a.data, i64) for a in arrays]
        groups, dim = cgutils.unpack_tuple(builder, arrays[1].shape, 2)
        s_row, q_row = (cgutils.unpack_tuple(builder, arrays[i].strides, 2)[0] for i in (0, 1))
        floats = ir.VectorType(f32, 16)
        totals = cgutils.alloca_once(builder, floats, _CENTER_QUERIES)

        def heads_from(h0, count):  # query heads h0 .. h0 + count - 1, each pair's rows loaded once for all
            q_at = [builder.add(base[1], builder.mul(builder.add(h0, i64(c)), q_row)) for c in range(count)]
            slots = [builder.gep(totals, [i32(c)]) for c in range(count)]
            for slot in slots:
                builder.store(ir.Constant(floats, [0.0] * 16), slot)
            with cgutils.for_range_slice(builder, i64(0), builder.lshr(dim, i64(1)), i64(_CENTER_PAIRS)) as (p, _):
                rows = [builder.load(builder.inttoptr(builder.add(base[3], builder.shl(builder.add(p, i64(k)), i64(6))),
                                                      vec.as_pointer()), align=2) for k in range(_CENTER_PAIRS)]
                for at, slot in zip(q_at, slots):
                    acc = ir.Constant(vec, [0] * 16)
                    for k in range(_CENTER_PAIRS):
                        both = builder.load(builder.inttoptr(builder.add(at, builder.shl(builder.add(p, i64(k)), i64(2))),
                                                             i32.as_pointer()), align=2)
                        acc = _dpwssd(builder, acc, rows[k], splat(builder, both, 16))
                    builder.store(builder.fadd(builder.load(slot), builder.sitofp(acc, floats)), slot)
            for c, slot in enumerate(slots):
                h = builder.add(h0, i64(c))
                out = builder.inttoptr(builder.add(base[0], builder.mul(h, s_row)), floats.as_pointer())
                f = splat(builder, builder.load(builder.gep(arrays[2].data, [h])), 16)
                builder.store(builder.fadd(builder.load(out, align=4), builder.fmul(builder.load(slot), f)), out, align=4)
        whole = builder.udiv(groups, i64(_CENTER_QUERIES))
        with cgutils.for_range(builder, whole) as chunk:
            heads_from(builder.mul(chunk.index, i64(_CENTER_QUERIES)), _CENTER_QUERIES)
        with cgutils.for_range_slice(builder, builder.mul(whole, i64(_CENTER_QUERIES)), groups, i64(1)) as (h, _):
            heads_from(h, 1)
        return context.get_dummy_value()
    return types.none(s, abq, factor, pairs), codegen


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def oaken_decode_attention(q, k_parts, v_parts, thr_k, thr_v, q_center, center, q_codes, block_tables, seq_lens, scale,
                           out, lse, scores, kb, vb, m, l, parts, qcb, sc, kacc, centers):
    """paged_decode_attention (cpu_attn/kernels.py) over an Oaken store: each block's K and V rows
    of one kv-head are decoded into small scratch (kb, vb: [U, block_size, D], L1-sized) and used
    at once; no full-precision copy of the cache is ever made. Scratch and states are per unit, a
    (sequence, kv-head, part) as in paged_decode_attention, but a parallel task is a (sequence,
    part) that takes every kv-head of each of its blocks: a row holds all kv-heads, so the block's
    lines are fetched once (8k x 8: 4.97-5.05 -> 4.39-4.52 ms against a unit per task), and the int16
    kernels take all kv-heads of a block in one call (a row's levels made once, not once a kv-head).
    A task's units are consecutive (unit = (b * splits + part) * Hkv + kvh), so its scores, kacc
    and outputs are [Hq, ...] arrays.
    k_parts, v_parts: (dense, scales, counts, sparse, tail, tail_of) of one layer (see load_block);
    thr_k, thr_v: [4]; q_center [B, Hq, D] and center: the keys' centers in the score domain (see
    add_center_scores; q_center [0, 0, 0]: keys not centered); scratch qcb [U, group, D], sc
    [U, group, bs]. q_codes = (codes [B, Hq, D] int16, scales [B, Hq]): the queries as
    vnni_block_scores takes them; then every full quantized block is not decoded: its keys are
    scored by vnni_block_scores (scratch kacc [U, group, 16, 16]), their centers by
    vnni_center_scores (scratch centers = (codes [U, group, D] int16, factor, inv [U, group]); see
    center_codes) and its values summed by vnni_add_weighted_rows. codes [0, 0, 0]: every block is decoded."""
    num_seqs, num_heads, head_dim = q.shape
    block_size = k_parts[0].shape[1]
    num_kv_heads = k_parts[0].shape[2] * 2 // head_dim
    group = num_heads // num_kv_heads
    splits = parts.shape[0] // (num_seqs * num_kv_heads)
    qi, qscale = q_codes
    int_dots = qi.shape[0] > 0
    for task in prange(num_seqs * splits):  # a part of one sequence, every kv-head of each of its blocks in turn
        b, part = task // splits, task % splits
        n = seq_lens[b]
        first, end = part_blocks(n, block_size, splits, part)
        units = slice(task * num_kv_heads, (task + 1) * num_kv_heads)  # the task's kv-heads: one unit each
        task_scores = scores[units].reshape((num_heads, block_size))
        task_acc = parts[units].reshape((num_heads, head_dim))
        task_m, task_l = m[units].reshape(num_heads), l[units].reshape(num_heads)
        attend_begin(task_acc, task_m, task_l)
        if int_dots:
            task_kacc = kacc[units].reshape((num_heads, ROWS, 16))
        centered = int_dots and q_center.shape[0] > 0
        if centered:
            abq = centers[0][units].reshape((num_heads, head_dim))
            factor, inv = centers[1][units].reshape(num_heads), centers[2][units].reshape(num_heads)
            center_scales(q_center[b], scale, inv, factor)
        for j in range(first, end):
            block = block_tables[b, j]
            width = min(block_size, n - j * block_size)
            if j + 1 < end:
                prefetch_block(k_parts, block_tables[b, j + 1], 0, num_kv_heads * head_dim)
                prefetch_block(v_parts, block_tables[b, j + 1], 0, num_kv_heads * head_dim)
            if int_dots and width == block_size and k_parts[5][block] < 0:  # full and quantized, K and V alike
                # the block's lines, loaded once, serve every kv-head; each step one call for all query heads
                int16_block_scores(task_scores, qi[b], qscale[b], k_parts[0][block], k_parts[1][block],
                                   k_parts[2][block], k_parts[3][block], thr_k, scale, task_kacc)
                if centered:
                    center_codes(q_center[b], center, j, inv, abq)
                    vnni_center_scores(task_scores, abq, factor, center[3])
                softmax_rows16(task_scores, task_acc, task_m, task_l)
                int16_add_weighted_rows(task_acc, task_scores, v_parts[0][block], v_parts[1][block],
                                        v_parts[2][block], v_parts[3][block], thr_v)
                continue
            for kvh in range(num_kv_heads):
                unit = task * num_kv_heads + kvh
                heads = slice(kvh * group, (kvh + 1) * group)
                first_seg = kvh * head_dim // SEGMENT
                load_block(k_parts, block, thr_k, first_seg, width, kb[unit])
                block_scores(q[b, heads], kb[unit], width, scale, scores[unit])
                if q_center.shape[0]:
                    add_center_scores(scores[unit], q_center[b, heads], center, j, width, scale, qcb[unit], sc[unit])
                load_block(v_parts, block, thr_v, first_seg, width, vb[unit])
                attend_scores(scores[unit], vb[unit], width, parts[unit], m[unit], l[unit])
        for kvh in range(num_kv_heads):
            heads = slice(kvh * group, (kvh + 1) * group)
            finish_unit(parts, m, l, out, lse, task * num_kv_heads + kvh, splits, b, heads)
    merge_parts(parts, m, l, out, lse, num_kv_heads, kv_inner=True)


@njit(cache=True, nogil=True, parallel=True)
def dequantize_blocks(parts, thr, blocks, num_tokens, out):
    """First num_tokens positions of a sequence's blocks -> out [len(blocks), Hkv, block_size, D]
    float32 (the context of a later prefill chunk); rows past num_tokens are left unset.
    parts as in load_block."""
    num_kv_heads, head_dim, block_size = out.shape[1], out.shape[3], parts[0].shape[1]
    for item in prange(blocks.shape[0] * num_kv_heads):
        j, kvh = item // num_kv_heads, item % num_kv_heads
        load_block(parts, blocks[j], thr, kvh * head_dim // SEGMENT, min(block_size, num_tokens - j * block_size),
                   out[j, kvh])
