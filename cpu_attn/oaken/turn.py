"""Rows turned by the store's Hadamard rotation (turn_rows, turn_heads), and a decode step's
rows written into their blocks' full-precision tails, or their blocks, in store space (write_decode_rows)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import _F32, _I64, c_array, splat
from cpu_attn.oaken.codec import quantize_into_block


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
    operations as write_decode_rows turns its rows (so every write path stores the same bits): a
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
def write_decode_rows(k, v, positions, slot_mapping, block_size, transform, tails, stamp, k_parts, v_parts, scratch):
    """A decode step's rows, one per sequence (no two in one block), written into one layer in store space:
    (k - R(p) key_bias) / key_scales (key_bias [0, C]: no centering) and v / value_scales, with the same float32
    operations, in the same order, as OakenKVStore.write's NumPy path, then each head times `rotation` ([0, 0]:
    none). As that path routes them (OakenKVStore._route_to_tails), in its order: rows that go on filling their
    block's tail first (stamps stamp + 1 ..), then the others one by one: a row that fills its tail quantizes the
    tail into its block and frees the slot; a row that starts a block takes a free slot, or the least recently
    written one, quantized first; a row in a block already quantized in part (a compacted one) is quantized
    into it, after the others. k, v [T, Hkv * D]; positions, slot_mapping [T] int64; transform:
    records.RowTransform; tails: records.TailSlots (none held); k_parts, v_parts: the layer's records.OakenParts;
    scratch: records.TokenScratch. Returns (0, the store's new write count) when written; (-1, _) when two rows
    share a block, or (the number of rows with NaN or inf, _); then nothing is written."""
    key_scales, value_scales, key_bias, rotation, cos, sin = transform
    tail, tail_of, tail_len, tail_stamp, tail_block = tails
    n, c = k.shape
    half = cos.shape[1]
    for i in range(n):
        for j in range(i):
            if slot_mapping[j] // block_size == slot_mapping[i] // block_size:
                return -1, stamp
    bad = 0
    for i in range(n):
        finite = True
        for j in range(c):
            finite &= np.isfinite(k[i, j]) and np.isfinite(v[i, j])
        bad += not finite
    if bad:
        return bad, stamp
    dim = rotation.shape[0]
    tmp = np.empty((_TURN_ROWS, dim), np.float32)
    row = np.empty((2, c), np.float32)  # a row quantized where it lands
    direct = np.zeros(n, np.bool_)
    writes = stamp
    for going_on in (True, False):
        for i in range(n):
            block, offset = slot_mapping[i] // block_size, slot_mapping[i] % block_size
            slot = tail_of[block]
            if going_on != (slot >= 0 and offset < block_size - 1):
                continue
            if slot < 0:
                if offset != 0 or block_size == 1:
                    direct[i] = True  # into its block, below
                    continue
                slot = _take_tail(block, tails, k_parts, v_parts, scratch)
            _store_row(k, v, i, positions[i], key_scales, value_scales, key_bias, cos, sin, half,
                       tail[:, slot, offset])
            if dim:
                for kv in range(2):
                    turn_rows(tail[kv, slot, offset].reshape(c // dim, dim), c // dim, rotation, tmp)
            writes += 1
            tail_len[slot], tail_stamp[slot] = offset + 1, writes
            if offset == block_size - 1:
                _flush_tail(slot, tails, k_parts, v_parts, scratch)
    for i in np.flatnonzero(direct):
        block, offset = slot_mapping[i] // block_size, slot_mapping[i] % block_size
        _store_row(k, v, i, positions[i], key_scales, value_scales, key_bias, cos, sin, half, row)
        if dim:
            for kv in range(2):
                turn_rows(row[kv].reshape(c // dim, dim), c // dim, rotation, tmp)
        quantize_into_block(row[0:1], k_parts, block, offset, scratch)
        quantize_into_block(row[1:2], v_parts, block, offset, scratch)
    return 0, writes


@njit(cache=True, nogil=True, inline="always")
def _store_row(k, v, i, p, key_scales, value_scales, key_bias, cos, sin, half, into):
    """Row i of k, v in store space (before any rotation) into `into` [2, C]."""
    for j in range(k.shape[1]):
        key = k[i, j] / key_scales[0, j]
        if key_bias.shape[0]:
            d = j % (2 * half)
            t = d % half
            turned = -key_bias[0, j + half] if d < half else key_bias[0, j - half]
            key -= (key_bias[0, j] * cos[p, t] + turned * sin[p, t]) / key_scales[0, j]
        into[0, j] = key
        into[1, j] = v[i, j] / value_scales[0, j]


@njit(cache=True, nogil=True)
def _take_tail(block, tails, k_parts, v_parts, scratch):
    """OakenKVStore._take_tail: the first free slot, else the least recently written one, flushed; now `block`'s."""
    tail_of, tail_stamp, tail_block = tails[1], tails[3], tails[4]
    slot = -1
    for s in range(tail_block.shape[0]):
        if tail_block[s] < 0:
            slot = s
            break
    if slot < 0:
        slot = np.argmin(tail_stamp)
        _flush_tail(slot, tails, k_parts, v_parts, scratch)
    tail_block[slot], tail_of[block] = block, slot
    return slot


@njit(cache=True, nogil=True)
def _flush_tail(slot, tails, k_parts, v_parts, scratch):
    """OakenKVStore._flush_tail of a slot not held: its rows quantized into its block, the slot free."""
    tail, tail_of, tail_len, tail_block = tails[0], tails[1], tails[2], tails[4]
    block = tail_block[slot]
    tail_of[block] = -1
    quantize_into_block(tail[0, slot, :tail_len[slot]], k_parts, block, 0, scratch)
    quantize_into_block(tail[1, slot, :tail_len[slot]], v_parts, block, 0, scratch)
    tail_block[slot] = -1
