"""Numba kernels of x @ W.T for MX weights (gpu_model/mx.py) at 1 to 64 rows of x, parallel over
tiles of TILE output rows.

- Up to MATVEC_MAX_ROWS rows of x (mx_matvec): a thread decodes its tile's four weight rows a block
  at a time in registers (mx_ir.Blocks) and multiplies them into 4 x 2 vector sums per pair of rows
  of x: eight independent FMA chains, so the loads and the decoding bind, not an FMA's latency.
- More rows (mx_matmul): the tile's rows are decoded once into float32 scratch (TILE x K, L1-sized)
  and dotted with every row of x, two rows of x against the four weight rows at a time.

Weights are decoded exactly (element x 2^(scale - 127) in float32, as mx.decode); only the order of
the dot products' sums differs from a float32 matmul of the decoded weights.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import _FAST, _llvm_fn, c_array
from gpu_model.mx_ir import _I64, _VF, Blocks, hsum, load

TILE = 4
MATVEC_MAX_ROWS = 2
KIND_FP8, KIND_FP6, KIND_FP4, KIND_INT8, KIND_FP6_E3M2 = 0, 1, 2, 3, 4
KIND_FORMATS = ("mxfp8", "mxfp6", "mxfp4", "mxint8", "mxfp6_e3m2")


def _arrays(context, builder, signature, args, which):
    return [context.make_array(signature.args[i])(context, builder, args[i]) for i in which]


def _weight_args(codes, scales, table) -> bool:
    return c_array(codes, 3, types.uint8) and c_array(scales, 2, types.uint8) and c_array(table, 1, types.float32)


def _make_decode_row(fmt: str):
    @intrinsic
    def decode_row(typingctx, codes, scales, table, n, w):
        """w[:K padded] = row n of the weight, decoded exactly (mx_ir.Blocks)."""
        if not (_weight_args(codes, scales, table) and c_array(w, 1, types.float32) and isinstance(n, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            ca, sa, ta, wa = _arrays(context, builder, signature, args, (0, 1, 2, 4))
            n = context.cast(builder, args[3], signature.args[3], types.intp)
            blocks = Blocks(builder, fmt, ca, sa, ta)
            with cgutils.for_range(builder, blocks.num_blocks) as loop:
                for h, v in enumerate(blocks.weights(n, loop.index)):
                    at = builder.add(builder.mul(loop.index, _I64(32)), _I64(16 * h))
                    store = builder.store(v, builder.bitcast(builder.gep(wa.data, [at]), _VF.as_pointer()))
                    store.align = 4
            return context.get_dummy_value()
        return types.none(codes, scales, table, n, w), codegen
    return decode_row


def _dot4_codegen(fmt: str):
    """LLVM IR of out[i, n0 + r] = x[i] . W[n0 + r] for the one or two rows i of x and r < width."""
    def codegen(context, builder, signature, args):
        xa, ca, sa, ta, oa = _arrays(context, builder, signature, args, (0, 1, 2, 3, 6))
        n0, width = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (4, 5))
        num_x, kx = cgutils.unpack_tuple(builder, xa.shape, 2)
        num_rows = cgutils.unpack_tuple(builder, sa.shape, 2)[0]
        blocks = Blocks(builder, fmt, ca, sa, ta)
        last = builder.sub(num_rows, _I64(1))
        rows = [builder.select(builder.icmp_signed("<", builder.add(n0, _I64(r)), num_rows),
                               builder.add(n0, _I64(r)), last) for r in range(4)]
        fma = _llvm_fn(builder, "llvm.fmuladd.v16f32", _VF, [_VF] * 3)

        def body(count):
            sums = [cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * 16)) for _ in range(4 * count)]
            with cgutils.for_range(builder, blocks.num_blocks) as loop:
                col = builder.mul(loop.index, _I64(32))
                at = [builder.add(builder.mul(_I64(i), kx), col) for i in range(count)]
                xs = [[load(builder, xa.data, _VF, builder.add(a, _I64(16 * h))) for h in (0, 1)] for a in at]
                for r in range(4):
                    w = blocks.weights(rows[r], loop.index)
                    for i in range(count):
                        acc = sums[r * count + i]
                        v = builder.call(fma, [w[0], xs[i][0], builder.load(acc)])
                        builder.store(builder.call(fma, [w[1], xs[i][1], v]), acc)
            for r in range(4):
                with builder.if_then(builder.icmp_signed("<", _I64(r), width)):
                    for i in range(count):
                        at = builder.add(builder.mul(_I64(i), num_rows), builder.add(n0, _I64(r)))
                        builder.store(hsum(builder, builder.load(sums[r * count + i])), builder.gep(oa.data, [at]))

        with builder.if_else(builder.icmp_signed(">", num_x, _I64(1))) as (pair, single):
            with pair:
                body(2)
            with single:
                body(1)
        return context.get_dummy_value()
    return codegen


def _make_dot4(fmt: str):
    @intrinsic
    def dot4(typingctx, x, codes, scales, table, n0, width, out):
        """out[i, n0 + r] = x[i] . W[n0 + r] for every row i of x (at most 2) and r < width (<= 4)."""
        if not (_weight_args(codes, scales, table) and c_array(x, 2, types.float32) and c_array(out, 2, types.float32)
                and isinstance(n0, types.Integer) and isinstance(width, types.Integer)):
            return None
        return types.none(x, codes, scales, table, n0, width, out), _dot4_codegen(fmt)
    return dot4


_dot4_fp8, _dot4_fp6, _dot4_fp4, _dot4_int8 = (_make_dot4(f) for f in KIND_FORMATS[:4])
_decode_fp8, _decode_fp6, _decode_fp4, _decode_int8 = (_make_decode_row(f) for f in KIND_FORMATS[:4])


@njit(cache=True, nogil=True)
def _decode_fp6_table(codes, table, scales, n, w):
    """w[:] = row n of an FP6 weight from a 64-entry table of exact weights / 2^(s - 127 - k) (any FP6
    variant; scalar code, for E3M2)."""
    for b in range(codes.shape[1]):
        s = table[64 + scales[n, b]]
        for q in range(4):
            for j in range(8):
                low = (codes[n, b, 8 * (q & 1) + j] >> (4 * (q >> 1))) & 15
                high = (codes[n, b, 16 + j] >> (2 * q)) & 3
                w[b * 32 + 8 * q + j] = table[low | (high << 4)] * s


@njit(cache=True, nogil=True)
def decode_row(kind, codes, scales, table, n, w):
    """w: [K padded to 32] float32 <- row n of the weight, exactly as mx.decode. table: the kind's
    scale table (mx_ir.scale_table; E3M2: 64 element values, then the 256 scales)."""
    if kind == KIND_FP8:
        _decode_fp8(codes, scales, table, n, w)
    elif kind == KIND_FP6:
        _decode_fp6(codes, scales, table, n, w)
    elif kind == KIND_FP4:
        _decode_fp4(codes, scales, table, n, w)
    elif kind == KIND_INT8:
        _decode_int8(codes, scales, table, n, w)
    else:
        _decode_fp6_table(codes, table, scales, n, w)


@njit(cache=True, nogil=True)
def _dot4(kind, x, codes, scales, table, n0, width, out):
    if kind == KIND_FP8:
        _dot4_fp8(x, codes, scales, table, n0, width, out)
    elif kind == KIND_FP6:
        _dot4_fp6(x, codes, scales, table, n0, width, out)
    elif kind == KIND_FP4:
        _dot4_fp4(x, codes, scales, table, n0, width, out)
    else:
        _dot4_int8(x, codes, scales, table, n0, width, out)


@njit(cache=True, nogil=True, parallel=True)
def mx_matvec(x, kind, codes, scales, table, out):
    """x: [M, K padded to 32] float32; codes [N, K/32, B] uint8, scales [N, K/32] uint8 (mx.py); table:
    the kind's scale table -> out: [M, N], in registers, a pair of rows of x at a time (not E3M2)."""
    num_rows = scales.shape[0]
    for tile in prange((num_rows + TILE - 1) // TILE):
        n0 = tile * TILE
        for i in range(0, x.shape[0], 2):
            _dot4(kind, x[i:i + 2], codes, scales, table, n0, min(TILE, num_rows - n0), out[i:i + 2])


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST)
def _dot_tile(x, w, out, n0, width):
    """out[i, n0 + r] = x[i] . w[r] for every row i of x, r < width (<= TILE): two rows of x against
    four weight rows at a time, eight accumulators. An odd last row pairs with itself."""
    for i in range(0, x.shape[0], 2):
        i2 = min(i + 1, x.shape[0] - 1)
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for c in range(x.shape[1]):
            xv, yv = x[i, c], x[i2, c]
            w0, w1, w2, w3 = w[0, c], w[1, c], w[2, c], w[3, c]
            a0 += xv * w0
            a1 += xv * w1
            a2 += xv * w2
            a3 += xv * w3
            b0 += yv * w0
            b1 += yv * w1
            b2 += yv * w2
            b3 += yv * w3
        for r, (a, b) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3))):
            if r < width:
                out[i, n0 + r] = a
                out[i2, n0 + r] = b


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def mx_matmul(x, kind, codes, scales, table, out, tiles):
    """As mx_matvec, any number of rows: each tile decoded once into tiles[thread] ([num_threads, TILE,
    K padded] float32 scratch) and dotted with every row of x."""
    num_rows = scales.shape[0]
    for tile in prange((num_rows + TILE - 1) // TILE):
        w = tiles[get_thread_id()]
        n0 = tile * TILE
        width = min(TILE, num_rows - n0)
        for r in range(TILE):
            if r < width:
                decode_row(kind, codes, scales, table, n0 + r, w[r])
            else:
                w[r, :] = 0.0
        _dot_tile(x, w, out, n0, width)
