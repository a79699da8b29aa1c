"""Rows turned by the store's Hadamard rotation (turn_rows, turn_heads), and a decode step's
rows written into their blocks' full-precision tails in store space (write_tail_rows)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import _F32, _I64, c_array, splat


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
def write_tail_rows(k, v, positions, slot_mapping, block_size, transform, tails, stamp):
    """A decode step's rows, one per sequence, each going on filling its block's tail slot without
    filling it up, written into one layer's tails in store space: (k - R(p) key_bias) / key_scales
    (key_bias [0, C]: no centering) and v / value_scales, with the same float32 operations, in the
    same order, as OakenKVStore.write's NumPy path, then each head times `rotation` ([0, 0]:
    none). k, v [T, Hkv * D]; positions, slot_mapping [T] int64; transform: records.RowTransform;
    tails: records.TailSlots (stamps stamp + 1 ..).
    Returns 0 when written; -1 when a row is not such a row, or the number of rows with NaN or
    inf; then nothing is written."""
    key_scales, value_scales, key_bias, rotation, cos, sin = transform
    tail, tail_of, tail_len, tail_stamp = tails
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
