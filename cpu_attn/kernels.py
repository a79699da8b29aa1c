"""Numba kernels over the paged KV store.

Numba has no float16 on the CPU, so an fp16 cache is stored as its raw uint16 bits and widened
a block at a time: by F16C's vcvtph2ps where the CPU has it (F16C), else with integer and float
operations (exact, subnormals, inf and nan included; both tested against numpy for all 65536 bit
patterns, F16C's NaNs up to their quiet bit).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from llvmlite import binding, ir
from numba.extending import intrinsic, overload

_F16_REBIAS = np.float32(2.0**112)  # 2^(127 - 15): moves a half's exponent to float32's bias

# Reassociation lets LLVM vectorize the dot products; no 'nnan'/'ninf': the online softmax
# starts from -inf. tests/test_cpu_attn.py bounds the error against a float64 reference.
_FAST = {"reassoc", "contract", "arcp", "nsz"}

_LINE = 64  # bytes of a cache line


def zeros_aligned(shape: tuple[int, ...], dtype, slack: int = 0) -> np.ndarray:
    """np.zeros starting on a cache line. A large np.zeros starts 16 bytes into a page, so a row of
    64 values had its vector loads split across two lines (and an Oaken head's 32 nibble bytes half
    the time); like np.zeros, pages are mapped only once written. `slack` bytes past the end stay
    readable (for kernels that read a few bytes past what they use)."""
    dtype = np.dtype(dtype)
    raw = np.zeros(int(np.prod(shape)) * dtype.itemsize + _LINE + slack, np.uint8)
    skip = -raw.ctypes.data % _LINE
    return raw[skip:skip + raw.size - _LINE - slack].view(dtype).reshape(shape)


@njit(cache=True, nogil=True)
def write_kv(k_cache, v_cache, slot_mapping, k, v):
    """Scatter new rows into one layer's cache.

    k_cache, v_cache: [num_blocks, Hkv, block_size, D] (float32, or uint16 holding fp16 bits)
    slot_mapping: [T] int64, slot = block * block_size + offset; k, v: [T, Hkv, D] same dtype as the cache
    """
    block_size = k_cache.shape[2]
    for t in range(slot_mapping.shape[0]):
        block, offset = slot_mapping[t] // block_size, slot_mapping[t] % block_size
        for h in range(k_cache.shape[1]):
            k_cache[block, h, offset, :] = k[t, h, :]
            v_cache[block, h, offset, :] = v[t, h, :]


@intrinsic
def _as_f32(typingctx, x):
    """Reinterpret uint32 bits as float32 (a register bitcast LLVM vectorizes)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _as_u32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def load_u32(typingctx, ary, at):
    """The 4 bytes ary[at : at + 4] of a C-contiguous uint8 array as one little-endian uint32: a
    single unaligned load where four byte loads, shifts and ors are what Numba makes of it. The
    caller keeps at + 4 within the array (no bounds check)."""
    if not (isinstance(ary, types.Array) and ary.dtype == types.uint8 and ary.layout == "C"
            and isinstance(at, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        i8, i32 = ir.IntType(8), ir.IntType(32)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.gep(builder.bitcast(data, i8.as_pointer()),
                              [context.cast(builder, args[1], signature.args[1], types.intp)])
        value = builder.load(builder.bitcast(pointer, i32.as_pointer()))
        value.align = 1
        return value
    return types.uint32(ary, at), codegen


@intrinsic
def prefetch(typingctx, ary, index):
    """prefetch(ary, (i, j, ...)): ask the CPU to start loading the cache line of ary[i, j, ...]
    and go on (LLVM's prefetch hint: it never faults, and it returns nothing). For gathers whose
    addresses are known ahead, so their misses overlap instead of coming one at a time."""
    if not isinstance(ary, types.Array) or not isinstance(index, types.BaseTuple) or len(index) != ary.ndim:
        return None

    def codegen(context, builder, signature, args):
        array_type, index_type = signature.args
        array = context.make_array(array_type)(context, builder, args[0])
        indices = [context.cast(builder, i, t, types.intp)
                   for i, t in zip(cgutils.unpack_tuple(builder, args[1], len(index_type)), index_type)]
        pointer = cgutils.get_item_pointer(context, builder, array_type, array, indices, wraparound=False)
        i32 = ir.IntType(32)
        byte_pointer = ir.IntType(8).as_pointer()
        hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer] + [i32] * 3),
                                              "llvm.prefetch.p0")
        builder.call(hint, [builder.bitcast(pointer, byte_pointer), i32(0), i32(3), i32(1)])  # read, keep in all levels, data cache
        return context.get_dummy_value()
    return types.none(ary, index), codegen


@njit(cache=True, nogil=True, inline="always")
def fp16_to_f32(h):
    """Exact float16 bits -> float32: put exponent and mantissa where float32 keeps them, multiply
    by 2^112 to rebias (the float multiply also normalizes subnormals), all exponent bits for
    inf/nan, then the sign."""
    u32 = np.uint32  # every step cast back: Numba computes uint32 & int as uint64, and vectors of that are half as wide
    h = u32(h)
    f = _as_f32(u32(u32(h & 0x7FFF) << 13)) * _F16_REBIAS
    special = u32(0x7F800000) if u32(h & 0x7C00) == u32(0x7C00) else u32(0)
    return _as_f32(u32(u32(_as_u32(f) | u32(u32(h & 0x8000) << 16)) | special))


def host_has(*features: str) -> bool:
    """Whether Numba compiles for this CPU (NUMBA_CPU_NAME unset) and the CPU has `features`."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return False
    host = binding.get_host_cpu_features()
    return all(host.get(f, False) for f in features)


F16C = host_has("f16c")
"""Whether fp16 rows are widened by vcvtph2ps (_widen_f16c); elsewhere by fp16_to_f32."""


@intrinsic
def _widen_f16c(typingctx, src, width, out):
    """out[:width] = src[:width] as float32, sixteen values an instruction (LLVM's fpext of <16 x
    half>: vcvtph2ps). src [R, D] uint16 fp16 bits and out [R, D] float32, C arrays, D a multiple
    of 16. NaNs come out quiet (their payload's top bit set): a signalling NaN's bits change."""
    if not (c_array(src, 2, types.uint16) and c_array(out, 2, types.float32) and isinstance(width, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        if not F16C:  # never called there (widen_block); without F16C, LLVM would call a runtime routine
            builder.call(_llvm_fn(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        (src_at, out_at), _, shapes = matrix_args(context, builder, signature, args, (0, 2))
        total = builder.mul(context.cast(builder, args[1], signature.args[1], types.intp), shapes[0][1])
        halves, floats = ir.VectorType(ir.HalfType(), 16), ir.VectorType(ir.FloatType(), 16)
        with cgutils.for_range_slice(builder, i64(0), total, i64(16)) as (i, _):
            x = builder.load(builder.inttoptr(builder.add(src_at, builder.shl(i, i64(1))), halves.as_pointer()), align=2)
            builder.store(builder.fpext(x, floats),
                          builder.inttoptr(builder.add(out_at, builder.shl(i, i64(2))), floats.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(src, width, out), codegen


def widen_block(src, width, out):
    """src [block_size, D]: a block's cache rows of one kv-head -> its first `width` rows as float32:
    src itself for a float32 cache (no copy), else out [block_size, D] float32, filled."""


@overload(widen_block, jit_options={"nogil": True, "fastmath": _FAST})
def _widen_block_impl(src, width, out):
    if src.dtype == types.float32:
        return lambda src, width, out: src

    def widen_fp16(src, width, out):
        if F16C and src.shape[1] % 16 == 0:
            _widen_f16c(src, width, out)
        else:  # a row at a time: the same bits, slower (Numba's loop over 64 values is set up per row)
            for t in range(width):
                for d in range(src.shape[1]):
                    out[t, d] = fp16_to_f32(src[t, d])
        return out
    return widen_fp16


@njit(cache=True, nogil=True)
def widen(src, out):
    """Test hook: src [R, D] uint16 fp16 bits or float32 -> out [R, D] float32, all R rows (widen_block)."""
    out[:] = widen_block(src, src.shape[0], out)


@njit(cache=True, nogil=True)
def widen_exact(src, out):
    """Test hook: src [N] uint16 fp16 bits -> out [N] float32 by fp16_to_f32 (the path without F16C)."""
    for i in range(src.shape[0]):
        out[i] = fp16_to_f32(src[i])


# fast_exp's constants (_exp16 takes the same, 16 lanes at a time): log2(e), ln 2 in two parts
# (hi - lo: r = x - n hi + n lo), and Cephes' polynomial for e^r, highest degree first
_LOG2E = 1.44269504
_LN2 = (0.693359375, 2.12194440e-4)
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


@njit(cache=True, nogil=True, inline="always")
def fast_exp(x):
    """exp(x) for x <= 88 (-inf included), relative error ~1e-7, in operations that vectorize
    (there is no vector exp without Intel's SVML): x = n ln2 + r, |r| <= ln2 / 2, Cephes' degree-6
    polynomial for e^r, 2^n built in the exponent bits. Below -87 it returns ~2^-126, not 0."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(_LOG2E) + np.float32(0.5))
    r = x - n * np.float32(_LN2[0]) + n * np.float32(_LN2[1])
    p = np.float32(_EXP_POLY[0])
    p = p * r + np.float32(_EXP_POLY[1])
    p = p * r + np.float32(_EXP_POLY[2])
    p = p * r + np.float32(_EXP_POLY[3])
    p = p * r + np.float32(_EXP_POLY[4])
    p = p * r + np.float32(_EXP_POLY[5])
    p = p * r * r + r + np.float32(1.0)
    return p * _as_f32(np.uint32(np.int32(n) + 127) << np.uint32(23))


_F32, _I1, _I8, _I16, _I32, _I64 = (ir.FloatType(), ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32),
                                    ir.IntType(64))  # the IR kernels' types


def splat(builder, x, lanes: int):
    """LLVM IR: a vector of `lanes` copies of the scalar x."""
    kind, zeros = ir.VectorType(x.type, lanes), ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    one = builder.insert_element(ir.Constant(kind, ir.Undefined), x, ir.IntType(32)(0))
    return builder.shuffle_vector(one, ir.Constant(kind, ir.Undefined), zeros)


def c_array(a, ndim: int, dtype) -> bool:
    """Typing check of the IR helpers: `a` is a C-contiguous array of `ndim` dimensions and `dtype`."""
    return isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C" and a.dtype == dtype


def f32_matrices(*arrays) -> bool:
    return all(c_array(a, 2, types.float32) for a in arrays)


def matrix_args(context, builder, signature, args, which):
    """LLVM IR: the arguments at indices `which` (2-D C arrays) -> their data addresses (i64), row
    strides in bytes and shapes, as three lists."""
    arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in which]
    return ([builder.ptrtoint(a.data, ir.IntType(64)) for a in arrays],
            [cgutils.unpack_tuple(builder, a.strides, 2)[0] for a in arrays],
            [cgutils.unpack_tuple(builder, a.shape, 2) for a in arrays])


def row_kernel_args(context, builder, signature, args):
    """LLVM IR of the row kernels, whose arguments are three float32 matrices and a row count: the
    8-wide float vector type, llvm.fmuladd on it, matrix_args of the three, the row count (i64)."""
    base, row_bytes, shapes = matrix_args(context, builder, signature, args, (0, 1, 2))
    width = context.cast(builder, args[3], signature.args[3], types.intp)
    return ir.VectorType(ir.FloatType(), 8), fmuladd8(builder), base, row_bytes, shapes, width


def fmuladd8(builder):
    """LLVM IR: llvm.fmuladd on <8 x float>, a * b + c, fused where the CPU has FMA."""
    vec = ir.VectorType(ir.FloatType(), 8)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]), "llvm.fmuladd.v8f32")


_ROW_VECTORS = 8  # vectors of 8 floats: the 64 values of a row chunk _add_weighted_rows keeps in registers


@intrinsic
def _add_weighted_rows(typingctx, acc, s, rows, width):
    """acc[g, :] += sum over t < width of s[g, t] * rows[t, :]: acc [G, D], s [G, >= width],
    rows [>= width, D], float32 C arrays, D a multiple of 64 (attend_scores checks).

    Written in LLVM IR so that each 64-wide chunk of acc[g] stays in eight vector registers
    while the rows stream past: Numba's loop loads and stores acc[g, d] for every row (LLVM
    cannot tell acc from rows apart), one store-to-load round trip per row and vector.
    llvm.fmuladd fuses where the CPU has FMA."""
    if not f32_matrices(acc, s, rows) or not isinstance(width, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        f32, i64 = ir.FloatType(), ir.IntType(64)
        vec, fmuladd, base, row_bytes, shapes, width = row_kernel_args(context, builder, signature, args)
        groups, dim = shapes[0]
        regs = [cgutils.alloca_once(builder, vec) for _ in range(_ROW_VECTORS)]  # promoted to registers

        def at(kind, address):
            return builder.inttoptr(address, kind.as_pointer())

        with cgutils.for_range(builder, groups) as g:
            with cgutils.for_range_slice(builder, i64(0), dim, i64(8 * _ROW_VECTORS)) as (d, _):
                acc_at = builder.add(builder.add(base[0], builder.mul(g.index, row_bytes[0])), builder.shl(d, i64(2)))
                for i, reg in enumerate(regs):
                    builder.store(builder.load(at(vec, builder.add(acc_at, i64(32 * i))), align=4), reg)
                with cgutils.for_range(builder, width) as t:
                    weight = builder.load(at(f32, builder.add(builder.add(base[1], builder.mul(g.index, row_bytes[1])),
                                                              builder.shl(t.index, i64(2)))), align=4)
                    weight = splat(builder, weight, 8)
                    row_at = builder.add(builder.add(base[2], builder.mul(t.index, row_bytes[2])), builder.shl(d, i64(2)))
                    for i, reg in enumerate(regs):
                        x = builder.load(at(vec, builder.add(row_at, i64(32 * i))), align=4)
                        builder.store(builder.call(fmuladd, [weight, x, builder.load(reg)]), reg)
                for i, reg in enumerate(regs):
                    builder.store(builder.load(reg), at(vec, builder.add(acc_at, i64(32 * i))), align=4)
        return context.get_dummy_value()
    return types.none(acc, s, rows, width), codegen


_SCORE_ROWS = 8  # rows _block_scores scores at once, into one vector of 8 scores


def lane_sums(builder, vectors):
    """LLVM IR: n vectors of n lanes (n a power of two) -> one whose lane r is the sum of vector r's
    lanes: log2(n) rounds of pairwise shuffles and adds, spans of 1, 2, 4, ... lanes (for eight, 21
    operations for the eight sums, where each sum alone takes ~6). With fewer vectors, m of n lanes,
    each vector's n / m lane groups are summed apart: lane r + m g holds group g of vector r."""
    n, span = vectors[0].type.count, 1
    while len(vectors) > 1:
        lo = [k - k % (2 * span) + (k % (2 * span) if k % (2 * span) < span else n + k % (2 * span) - span)
              for k in range(n)]
        masks = [ir.Constant(ir.VectorType(ir.IntType(32), n), [i + shift for i in lo]) for shift in (0, span)]
        vectors = [builder.fadd(*(builder.shuffle_vector(a, b, mask) for mask in masks))
                   for a, b in zip(vectors[::2], vectors[1::2])]
        span *= 2
    return vectors[0]


@intrinsic
def _block_scores(typingctx, s, qs, kb, width, scale):
    """s[g, t] = scale * (qs[g] . kb[t]) for t < width, rounded up to a multiple of 8 (the rows past
    width are scored too: s and kb must hold them). s [G, >= width8], qs [G, D], kb [>= width8, D],
    float32 C arrays, D a multiple of 8 (attend_block checks).

    In LLVM IR so that eight rows are scored at once: eight independent chains of fused
    multiply-adds, then their eight horizontal sums in one shuffle tree (lane_sums). Numba's loop
    summed each row's vector on its own and stored one score at a time."""
    if not f32_matrices(s, qs, kb) or not isinstance(width, types.Integer) or not isinstance(scale, types.Float):
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        vec, fmuladd, base, row_bytes, shapes, width = row_kernel_args(context, builder, signature, args)
        groups, dim = shapes[1]
        factor = splat(builder, context.cast(builder, args[4], signature.args[4], types.float32), 8)
        sums = [cgutils.alloca_once(builder, vec) for _ in range(_SCORE_ROWS)]  # promoted to registers

        def at(array, row, column):
            row_at = builder.add(base[array], builder.mul(row, row_bytes[array]))
            return builder.inttoptr(builder.add(row_at, builder.shl(column, i64(2))), vec.as_pointer())

        with cgutils.for_range_slice(builder, i64(0), width, i64(_SCORE_ROWS)) as (t0, _):
            with cgutils.for_range(builder, groups) as g:
                for acc in sums:
                    builder.store(ir.Constant(vec, [0.0] * 8), acc)
                with cgutils.for_range_slice(builder, i64(0), dim, i64(8)) as (d, _):
                    q = builder.load(at(1, g.index, d), align=4)
                    for r, acc in enumerate(sums):
                        k = builder.load(at(2, builder.add(t0, i64(r)), d), align=4)
                        builder.store(builder.call(fmuladd, [q, k, builder.load(acc)]), acc)
                scores = lane_sums(builder, [builder.load(acc) for acc in sums])
                builder.store(builder.fmul(scores, factor), at(0, g.index, t0), align=4)
        return context.get_dummy_value()
    return types.none(s, qs, kb, width, scale), codegen


@njit(cache=True, nogil=True, inline="always")
def attend_begin(acc, m, l):
    acc[:] = 0.0
    m[:] = -np.inf
    l[:] = 0.0


@njit(cache=True, nogil=True, inline="always")
def block_scores(qs, kb, width, scale, s):
    """s[g, t] = scale * (qs[g] . kb[t]) for t < width: qs [group, D], kb [block_size, D]."""
    group, head_dim = qs.shape
    if head_dim % 8 == 0 and kb.shape[0] % _SCORE_ROWS == 0:
        _block_scores(s, qs, kb, width, np.float32(scale))
    else:
        for t in range(width):
            for g in range(group):
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += qs[g, d] * kb[t, d]
                s[g, t] = dot * scale


@njit(cache=True, nogil=True, inline="always")
def attend_block(qs, kb, vb, width, scale, s, acc, m, l):
    """Advance one work item's online softmax by `width` rows of widened K (kb) and V (vb).

    qs: [group, D] queries sharing a kv-head; kb, vb: [block_size, D]; s: [group, block_size]
    scores scratch; acc: [group, D] unnormalized output; m, l: [group] running max and sum."""
    block_scores(qs, kb, width, scale, s)
    attend_scores(s, vb, width, acc, m, l)


_STALE_MAX = np.float32(8.0)
"""How far a block's scores may rise over the running max m before attend_scores moves m (and
rescales the output and sum). Most blocks do not move it, and rescaling per head and block (a scalar
exp, then acc *= correction) was a third of the softmax's time; weights up to e^8 are safe in float32."""


@njit(cache=True, nogil=True, inline="always")
def attend_scores(s, vb, width, acc, m, l):
    """The online-softmax step of attend_block for given scores s [group, >= width] (overwritten
    with their weights). A score of -inf gets weight 0 (the sampled kernel marks rows a head did
    not retrieve so), but must not be a head's first: m[g] has to be finite. A full block of 16 rows
    takes softmax_rows16 (one vector a head; softmax_weights' loops took ~100 ns a head and block on
    a Zen 3, a third of the fp16 kernel's time)."""
    if width == 16 and s.shape[1] == 16 and acc.shape[1] % 16 == 0:
        softmax_rows16(s, acc, m, l)
    else:
        softmax_weights(s, width, acc, m, l)
    group, head_dim = acc.shape
    if head_dim % (8 * _ROW_VECTORS) == 0:
        _add_weighted_rows(acc, s, vb, width)
        return
    for t in range(width):
        for g in range(group):
            p = s[g, t]
            if p != 0.0:
                for d in range(head_dim):
                    acc[g, d] += p * vb[t, d]


@njit(cache=True, nogil=True, inline="always")
def softmax_weights(s, width, acc, m, l):
    """The softmax half of attend_scores: s [group, >= width] -> the rows' weights (in place), the
    running max m, sum l and output acc moved on; acc += weights @ rows is left to the caller."""
    group, head_dim = acc.shape
    for g in range(group):
        # written so that LLVM vectorizes the max and the exponentials: a compare and select for max
        # (Python's max keeps NaN rules), and the sum in a local (an l[g] += in the loop might alias s)
        new_m = m[g]
        for t in range(width):
            x = s[g, t]
            new_m = x if x > new_m else new_m
        if new_m > m[g] + _STALE_MAX:  # else m stays: weights up to e^_STALE_MAX, no rescaling of acc
            correction = fast_exp(m[g] - new_m)
            for d in range(head_dim):
                acc[g, d] *= correction
            l[g] *= correction
            m[g] = new_m
        top, total = m[g], np.float32(0.0)
        for t in range(width):
            x = s[g, t]
            p = fast_exp(x - top)
            p = p if x > -np.inf else np.float32(0.0)
            s[g, t] = p
            total += p
        l[g] += total


def _llvm_fn(builder, name, ret, params):
    """LLVM IR: the intrinsic `name` (declared in the module on first use)."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)


def _exp16(builder, x):
    """LLVM IR: fast_exp of a <16 x float>, the same steps (its polynomial and exponent bits)."""
    f32, i32 = ir.FloatType(), ir.IntType(32)
    floats, ints = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
    c = lambda v: ir.Constant(floats, [float(v)] * 16)
    mul, add = builder.fmul, builder.fadd
    floor = _llvm_fn(builder, "llvm.floor.v16f32", floats, [floats])
    x = builder.select(builder.fcmp_ordered(">", x, c(-87.0)), x, c(-87.0))
    n = builder.call(floor, [add(mul(x, c(np.float32(_LOG2E))), c(0.5))])
    r = add(builder.fsub(x, mul(n, c(np.float32(_LN2[0])))), mul(n, c(np.float32(_LN2[1]))))
    p = c(np.float32(_EXP_POLY[0]))
    for k in _EXP_POLY[1:]:
        p = add(mul(p, r), c(np.float32(k)))
    p = add(add(mul(mul(p, r), r), r), c(1.0))
    two_n = builder.bitcast(builder.shl(builder.add(builder.fptosi(n, ints), ir.Constant(ints, [127] * 16)),
                                        ir.Constant(ints, [23] * 16)), floats)
    return mul(p, two_n)


@intrinsic
def softmax_rows16(typingctx, s, acc, m, l):
    """softmax_weights for a full block of 16 rows, in LLVM IR: each query head's scores as one
    vector (a max and a sum by shuffle trees, the exponentials 16 at a time). Numba's loops over a
    width known only at run time took ~116 ns for 9 heads (AVX-512 Xeon), ~100 ns a head on a Zen 3.
    s [H, 16] (overwritten with the weights), acc [H, D] (D a multiple of 16), m, l [H] float32."""
    if not (c_array(s, 2, types.float32) and f32_matrices(acc) and c_array(m, 1, types.float32)
            and c_array(l, 1, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        floats = ir.VectorType(f32, 16)
        s_arr, acc_arr, m_arr, l_arr = (context.make_array(t)(context, builder, a)
                                        for t, a in zip(signature.args, args))
        heads, dim = cgutils.unpack_tuple(builder, acc_arr.shape, 2)
        s_row, acc_row = (cgutils.unpack_tuple(builder, a.strides, 2)[0] for a in (s_arr, acc_arr))
        s_base, acc_base = (builder.ptrtoint(a.data, i64) for a in (s_arr, acc_arr))
        at = lambda address: builder.inttoptr(address, floats.as_pointer())

        def fold(x, pick):  # the 16 lanes into lane 0 by a shuffle tree
            for span in (8, 4, 2, 1):
                turn = ir.Constant(ir.VectorType(i32, 16), [(i + span) % 16 for i in range(16)])
                x = pick(x, builder.shuffle_vector(x, x, turn))
            return builder.extract_element(x, i32(0))
        bigger = lambda a, b: builder.select(builder.fcmp_ordered(">", a, b), a, b)
        with cgutils.for_range(builder, heads) as h:
            row = at(builder.add(s_base, builder.mul(h.index, s_row)))
            x = builder.load(row, align=4)
            m_at, l_at = builder.gep(m_arr.data, [h.index]), builder.gep(l_arr.data, [h.index])
            old = builder.load(m_at)
            new = bigger(fold(x, bigger), old)
            moved = builder.fcmp_ordered(">", new, builder.fadd(old, f32(float(_STALE_MAX))))
            with builder.if_then(moved, likely=False):
                correction = _exp16(builder, splat(builder, builder.fsub(old, new), 16))
                correction = splat(builder, builder.extract_element(correction, i32(0)), 16)
                acc_at = builder.add(acc_base, builder.mul(h.index, acc_row))
                with cgutils.for_range_slice(builder, i64(0), dim, i64(16)) as (d, _):
                    out = at(builder.add(acc_at, builder.shl(d, i64(2))))
                    builder.store(builder.fmul(builder.load(out, align=4), correction), out, align=4)
                builder.store(builder.fmul(builder.load(l_at), builder.extract_element(correction, i32(0))), l_at)
                builder.store(new, m_at)
            top = splat(builder, builder.load(m_at), 16)
            p = _exp16(builder, builder.fsub(x, top))
            p = builder.select(builder.fcmp_ordered(">", x, splat(builder, f32(float("-inf")), 16)), p,
                               ir.Constant(floats, [0.0] * 16))
            builder.store(p, row, align=4)
            builder.store(builder.fadd(builder.load(l_at), fold(p, builder.fadd)), l_at)
        return context.get_dummy_value()
    return types.none(s, acc, m, l), codegen


@njit(cache=True, nogil=True, inline="always")
def attend_end(acc, m, l, lse):
    for g in range(acc.shape[0]):
        for d in range(acc.shape[1]):
            acc[g, d] /= l[g]
        lse[g] = m[g] + np.log(l[g])


@njit(cache=True, nogil=True, inline="always")
def attend_merge(parts, m, l, out, lse):
    """Join the online-softmax states of the parts of one item's context: parts [S, group, D]
    unnormalized outputs, m, l [S, group] -> out [group, D], lse [group]. A part with no rows
    (l = 0, m = -inf) adds nothing."""
    for g in range(out.shape[0]):
        top = -np.inf
        for s in range(parts.shape[0]):
            top = max(top, m[s, g])
        for d in range(out.shape[1]):  # a loop, not out[g, :] = 0: in a parallel function that is a parallel region
            out[g, d] = 0.0
        total = np.float32(0.0)
        for s in range(parts.shape[0]):
            w = fast_exp(m[s, g] - top) if l[s, g] > 0.0 else np.float32(0.0)
            total += l[s, g] * w
            for d in range(out.shape[1]):
                out[g, d] += w * parts[s, g, d]
        for d in range(out.shape[1]):
            out[g, d] /= total
        lse[g] = top + np.log(total)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out, lse, scores, kb, vb, m, l, parts):
    """One query token per sequence against its whole paged context.

    q: [B, Hq, D] float32; k_cache, v_cache: [num_blocks, Hkv, block_size, D]
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (tokens incl. the current one)
    out: [B, Hq, D] float32 (written); lse: [B, Hq] float32 (written, natural log)
    scratch (attention_scratch), one slice per unit: scores [U, group, block_size], kb, vb
      [U, block_size, D], m, l [U, group], parts [U, group, D] (float32)

    A (sequence, kv-head) item widens a block's K/V rows once (widen_block: an fp16 cache's into kb,
    vb; a float32 cache's are read where they lie) and uses them for all `group` query heads that
    share them, with an online softmax (running max m, running sum l) advanced block by block. Its
    context is cut into U / (B * Hkv) parts of consecutive blocks, one unit of work each, whose
    states attend_merge joins (split_parts says how many).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    splits = parts.shape[0] // (num_seqs * num_kv_heads)
    for unit in prange(parts.shape[0]):
        item, part = unit // splits, unit % splits
        b, kvh = item // num_kv_heads, item % num_kv_heads
        heads = slice(kvh * group, (kvh + 1) * group)
        acc = parts[unit]
        attend_begin(acc, m[unit], l[unit])
        first, end = part_blocks(seq_lens[b], block_size, splits, part)
        for j in range(first, end):
            block = block_tables[b, j]
            width = min(block_size, seq_lens[b] - j * block_size)
            if j + 1 < end:
                prefetch_rows(k_cache, v_cache, block_tables[b, j + 1], kvh)
            k, v = widen_block(k_cache[block, kvh], width, kb[unit]), widen_block(v_cache[block, kvh], width, vb[unit])
            attend_block(q[b, heads], k, v, width, scale, scores[unit], acc, m[unit], l[unit])
        finish_unit(parts, m, l, out, lse, unit, splits, b, heads)
    merge_parts(parts, m, l, out, lse, num_kv_heads)


@njit(cache=True, nogil=True, inline="always")
def prefetch_rows(k_cache, v_cache, block, kvh):
    """Start loading a block's K and V rows of kv-head kvh (block_size * D values each, contiguous,
    one prefetch a 64-byte line): a sequence's blocks lie anywhere in the pool, where the hardware
    prefetchers stop at every block (oaken.prefetch_block does the same for the Oaken store)."""
    step = 64 // k_cache.itemsize
    for t in range(k_cache.shape[2]):
        for x in range(0, k_cache.shape[3], step):
            prefetch(k_cache, (block, kvh, t, x))
            prefetch(v_cache, (block, kvh, t, x))


@njit(cache=True, nogil=True, inline="always")
def part_blocks(n, block_size, splits, part):
    """The blocks [first, end) of part `part` of `splits` of an n-token context."""
    num_blocks = (n + block_size - 1) // block_size
    per = (num_blocks + splits - 1) // splits
    return min(part * per, num_blocks), min((part + 1) * per, num_blocks)


@njit(cache=True, nogil=True, inline="always")
def finish_unit(parts, m, l, out, lse, unit, splits, b, heads):
    """The end of a unit of work in the kernels' parallel loop: a context in one part (the common
    case, items enough for the threads) is normalized into out right away; parts of a context are
    joined after the loop (merge_parts). Joining every item after the loop, one part or several,
    cost 15-25 us a call at 16 x 16 tokens (against 23 us for the whole kernel before)."""
    if splits == 1:
        attend_merge(parts[unit:unit + 1], m[unit:unit + 1], l[unit:unit + 1], out[b, heads], lse[b, heads])


@njit(cache=True, nogil=True, inline="always")
def merge_parts(parts, m, l, out, lse, num_kv_heads, kv_inner=False):
    """out [B, Hq, D], lse [B, Hq] from the units' states of contexts cut into parts (see
    paged_decode_attention; a no-op with one part, finish_unit did it). On the calling thread: only
    small batches are cut, and a second parallel region costs more than the pass. Units in order
    (sequence, kv-head, part), or (sequence, part, kv-head) with kv_inner."""
    num_seqs, group = out.shape[0], out.shape[1] // num_kv_heads
    splits = parts.shape[0] // max(num_seqs * num_kv_heads, 1)
    if splits == 1:
        return
    for item in range(num_seqs * num_kv_heads):
        b, kvh = item // num_kv_heads, item % num_kv_heads
        start, step = (b * splits * num_kv_heads + kvh, num_kv_heads) if kv_inner else (item * splits, 1)
        units = slice(start, start + splits * step, step)
        heads = slice(kvh * group, (kvh + 1) * group)
        attend_merge(parts[units], m[units], l[units], out[b, heads], lse[b, heads])


_UNITS_PER_THREAD = 4  # units of work split_parts aims at: enough for the threads to end together
_PART_BLOCKS = 32  # the fewest blocks split_parts gives a part (512 tokens at block_size 16)


def split_parts(work: int, seq_lens: np.ndarray, block_size: int) -> int:
    """Into how many parts to cut each of `work` (sequence, kv-head) items. Items alone are too
    few at small batches: one sequence of SmolLM2 has 3 kv-heads, so two threads ran 2 + 1 of
    them (and sixteen threads 3 of 16)."""
    want = -(-_UNITS_PER_THREAD * numba.get_num_threads() // max(work, 1))
    if want <= 1 or work == 0:  # items enough (the common case: no pass over seq_lens)
        return 1
    return max(1, min(want, -(-int(seq_lens.max()) // block_size) // _PART_BLOCKS))


def attention_scratch(work: int, group: int, block_size: int, head_dim: int, splits: int = 1) -> tuple[np.ndarray, ...]:
    """scores, kb, vb, m, l, parts for `work` (sequence, kv-head) items of the decode kernels, each
    cut into `splits` units (split_parts)."""
    units = work * splits
    f32 = np.float32
    return (np.empty((units, group, block_size), f32), np.empty((units, block_size, head_dim), f32),
            np.empty((units, block_size, head_dim), f32), np.empty((units, group), f32), np.empty((units, group), f32),
            np.empty((units, group, head_dim), f32))
