"""Numba kernels of x @ W.T for MX weights (gpu_model/mx.py) at 1 to 64 rows of x, parallel over
tiles of TILE output rows.

- Up to MATVEC_MAX_ROWS rows of x (mx_matvec): a thread decodes its tile's four weight rows a block
  at a time in registers (mx_ir.Blocks) and multiplies them into 4 x 2 vector sums per pair of rows
  of x: eight independent FMA chains, so the loads and the decoding bind, not an FMA's latency.
- More rows (mx_matmul): the tile's rows are decoded once into float32 scratch (TILE x K, L1-sized)
  and dotted with every row of x, four rows of x against the four weight rows at a time (_dot_rows).

Weights are decoded exactly (element x 2^(scale - 127) in float32, as mx.decode); only the order of
the dot products' sums differs from a float32 matmul of the decoded weights.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import _llvm_fn, by_row_count, c_array
from gpu_model.mx_ir import _I64, _VF, Blocks, hsum, load

# Numba revalidates a cached kernel by its own file only: these kernels are cached apart, under a hash
# of every file whose code they compile in, so a change to the IR (mx_ir.py) recompiles them.
_SOURCES = [Path(__file__), Path(__file__).with_name("mx_ir.py"), Path(__file__).with_name("mx.py")]
_DIGEST = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()[:16]
_OUTER_CACHE_DIR = numba.config.CACHE_DIR
_BASE = Path(_OUTER_CACHE_DIR).parent if _OUTER_CACHE_DIR else Path.home() / ".cache" / "hetserve" / "numba"
numba.config.CACHE_DIR = str(_BASE / f"mx-{_DIGEST}")

TILE = 4
MATVEC_MAX_ROWS = 2
ROWS_PER_PASS = 4  # rows of x the tile kernel multiplies at a time: 16 vector sums
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


def _dot_rows(builder, xa, oa, num_blocks, weights, n0, width, max_rows: int):
    """LLVM IR of out[i, n0 + r] = x[i] . W[n0 + r] for every row i of x (at most `max_rows`) and r <
    width (<= 4); weights(r, b): W[n0 + r]'s block b as two <16 x float>. Each block's four weight
    rows are multiplied into 4 x rows vector sums: independent FMA chains."""
    num_x, kx = cgutils.unpack_tuple(builder, xa.shape, 2)
    out_stride = cgutils.unpack_tuple(builder, oa.shape, 2)[1]
    fma = _llvm_fn(builder, "llvm.fmuladd.v16f32", _VF, [_VF] * 3)

    def body(count):
        sums = [cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * 16)) for _ in range(4 * count)]
        with cgutils.for_range(builder, num_blocks) as loop:
            col = builder.mul(loop.index, _I64(32))
            at = [builder.add(builder.mul(_I64(i), kx), col) for i in range(count)]
            xs = [[load(builder, xa.data, _VF, builder.add(a, _I64(16 * h))) for h in (0, 1)] for a in at]
            for r in range(4):
                w = weights(r, loop.index)
                for i in range(count):
                    acc = sums[r * count + i]
                    v = builder.call(fma, [w[0], xs[i][0], builder.load(acc)])
                    builder.store(builder.call(fma, [w[1], xs[i][1], v]), acc)
        for r in range(4):
            with builder.if_then(builder.icmp_signed("<", _I64(r), width)):
                for i in range(count):
                    at = builder.add(builder.mul(_I64(i), out_stride), builder.add(n0, _I64(r)))
                    builder.store(hsum(builder, builder.load(sums[r * count + i])), builder.gep(oa.data, [at]))

    by_row_count(builder, num_x, max_rows, body)


def _dot4_codegen(fmt: str):
    """LLVM IR of out[i, n0 + r] = x[i] . W[n0 + r] for the one or two rows i of x and r < width, the
    weights decoded in registers (Blocks)."""
    def codegen(context, builder, signature, args):
        xa, ca, sa, ta, oa = _arrays(context, builder, signature, args, (0, 1, 2, 3, 6))
        n0, width = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (4, 5))
        num_rows = cgutils.unpack_tuple(builder, sa.shape, 2)[0]
        blocks = Blocks(builder, fmt, ca, sa, ta)
        last = builder.sub(num_rows, _I64(1))
        rows = [builder.select(builder.icmp_signed("<", builder.add(n0, _I64(r)), num_rows),
                               builder.add(n0, _I64(r)), last) for r in range(4)]
        _dot_rows(builder, xa, oa, blocks.num_blocks, lambda r, b: blocks.weights(rows[r], b), n0, width, 2)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _dot_tile_ir(typingctx, x, tile, n0, width, out):
    """out[i, n0 + r] = x[i] . tile[r] for every row i of x (at most ROWS_PER_PASS) and r < width."""
    if not (c_array(x, 2, types.float32) and c_array(tile, 2, types.float32) and c_array(out, 2, types.float32)
            and isinstance(n0, types.Integer) and isinstance(width, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        xa, wa, oa = _arrays(context, builder, signature, args, (0, 1, 4))
        n0, width = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (2, 3))
        kw = cgutils.unpack_tuple(builder, wa.shape, 2)[1]
        num_blocks = builder.sdiv(kw, _I64(32))

        def weights(r, b):
            at = builder.add(builder.mul(_I64(r), kw), builder.mul(b, _I64(32)))
            return [load(builder, wa.data, _VF, builder.add(at, _I64(16 * h))) for h in (0, 1)]
        _dot_rows(builder, xa, oa, num_blocks, weights, n0, width, ROWS_PER_PASS)
        return context.get_dummy_value()
    return types.none(x, tile, n0, width, out), codegen


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
        high = np.uint64(0)
        for k in range(8):
            high |= np.uint64(codes[n, b, 16 + k]) << np.uint64(8 * k)
        for i in range(32):
            h, lane = i // 16, i % 16
            pair = (high >> np.uint64(32 * (lane & 1) + 16 * h + 2 * (lane >> 1))) & np.uint64(3)
            low = (codes[n, b, lane] >> (4 * h)) & 15
            w[b * 32 + i] = table[np.int64(low) | (np.int64(pair) << 4)] * s


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


@njit(cache=True, nogil=True, parallel=True)
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
        for i in range(0, x.shape[0], ROWS_PER_PASS):
            _dot_tile_ir(x[i:i + ROWS_PER_PASS], w, n0, width, out[i:i + ROWS_PER_PASS])


numba.config.CACHE_DIR = _OUTER_CACHE_DIR
