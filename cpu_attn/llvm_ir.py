"""LLVM IR building blocks the kernels share: bit casts, loads and prefetches Numba does not
emit, typing checks of array arguments, splats, fused multiply-adds, shuffle-tree sums, and what
the host CPU has."""
from __future__ import annotations

import numba
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


# Reassociation lets LLVM vectorize the dot products; no 'nnan'/'ninf': the online softmax
# starts from -inf. tests/test_cpu_attn.py bounds the error against a float64 reference.
_FAST = {"reassoc", "contract", "arcp", "nsz"}


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


def _prefetch_typing(ary, index, locality: int):
    """The typing and code of the prefetch intrinsics below."""
    if not isinstance(ary, types.Array) or not isinstance(index, types.BaseTuple) or len(index) != ary.ndim:
        return None

    def codegen(context, builder, signature, args):
        array_type, index_type = signature.args
        array = context.make_array(array_type)(context, builder, args[0])
        indices = [context.cast(builder, i, t, types.intp)
                   for i, t in zip(cgutils.unpack_tuple(builder, args[1], len(index_type)), index_type)]
        prefetch_ir(builder, cgutils.get_item_pointer(context, builder, array_type, array, indices, wraparound=False),
                    locality=locality)
        return context.get_dummy_value()
    return types.none(ary, index), codegen


@intrinsic
def prefetch(typingctx, ary, index):
    """prefetch(ary, (i, j, ...)): ask the CPU to start loading the cache line of ary[i, j, ...]
    and go on (LLVM's prefetch hint: it never faults, and it returns nothing). For gathers whose
    addresses are known ahead, so their misses overlap instead of coming one at a time."""
    return _prefetch_typing(ary, index, 3)


@intrinsic
def prefetch_l2(typingctx, ary, index):
    """prefetch, hinting that the line need not go to L1 (locality 2): for the next block of a stream, whose
    lines would take L1 from the block in use (kernels.prefetch_rows)."""
    return _prefetch_typing(ary, index, 2)


def by_row_count(builder, num_rows, most: int, body) -> None:
    """LLVM IR: body(count) for count = min(num_rows, most) (num_rows an i64 value >= 1), as a chain of
    branches from `most` down to 1, so that each count's code is generated for its own constant."""
    if most == 1:
        body(1)
        return
    with builder.if_else(builder.icmp_signed(">=", num_rows, ir.IntType(64)(most))) as (enough, fewer):
        with enough:
            body(most)
        with fewer:
            by_row_count(builder, num_rows, most - 1, body)


def prefetch_ir(builder, pointer, offset=None, locality: int = 3) -> None:
    """LLVM IR: the prefetch hint (read, data; locality 3: keep in all cache levels) for the byte `offset` (an i64
    value) past `pointer`, or for `pointer` itself."""
    i32, byte_pointer = ir.IntType(32), ir.IntType(8).as_pointer()
    hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer] + [i32] * 3),
                                          "llvm.prefetch.p0")
    at = builder.bitcast(pointer, byte_pointer)
    builder.call(hint, [at if offset is None else builder.gep(at, [offset]), i32(0), i32(locality), i32(1)])


def host_has(*features: str) -> bool:
    """Whether Numba compiles for this CPU (NUMBA_CPU_NAME unset) and the CPU has `features`."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return False
    host = binding.get_host_cpu_features()
    return all(host.get(f, False) for f in features)


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


def _llvm_fn(builder, name, ret, params):
    """LLVM IR: the intrinsic `name` (declared in the module on first use)."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)


def _half(builder, v, first: int, n: int):
    """LLVM IR: lanes first .. first + n - 1 of vector v."""
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(first, first + n))))


def _joined(builder, lo, hi):
    """LLVM IR: vectors lo and hi (of n lanes each) as one of 2n lanes."""
    n = lo.type.count
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def pmaddwd_pairs(builder, acc, x, y):
    """LLVM IR: acc + the pairwise int16 dot products of x and y (<16 x i32> each, lane l: an int16 pair) in
    AVX2, vpdpwssd's result without AVX-512: two vpmaddwd on the halves, two vpaddd. The sums wrap as
    vpdpwssd's do; a pair of products overflows only where both are (-2^15)^2."""
    words, dwords = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    madd = _llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", dwords, [words, words])
    sums = [builder.call(madd, [builder.bitcast(_half(builder, v, k, 8), words) for v in (x, y)]) for k in (0, 8)]
    return builder.add(acc, _joined(builder, *sums))


def pmaddubsw_quads(builder, u, x):
    """LLVM IR: the <32 x i16> pairwise products of unsigned bytes u and signed bytes x (<64 x i8> each) by AVX2's
    vpmaddubsw on each half: lane k = u[2k] x[2k] + u[2k + 1] x[2k + 1], saturated to int16 (callers keep the
    products small enough not to be)."""
    b32, w16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(_I16, 16)
    madd = _llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", w16, [b32, b32])
    halves = [builder.call(madd, [_half(builder, u, k, 32), _half(builder, x, k, 32)]) for k in (0, 32)]
    return _joined(builder, *halves)


def pmaddwd_ones(builder, v):
    """LLVM IR: <32 x i16> v -> <16 x i32> whose lane l is v[2l] + v[2l + 1] (AVX2's vpmaddwd by ones on each half)."""
    words, dwords = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    madd = _llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", dwords, [words, words])
    ones = ir.Constant(words, [1] * 16)
    return _joined(builder, *(builder.call(madd, [_half(builder, v, k, 16), ones]) for k in (0, 16)))


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (LLVM's readcyclecounter: rdtsc on x86, constant rate), to split one kernel call's
    time between its parts."""
    def codegen(context, builder, signature, args):
        return builder.call(_llvm_fn(builder, "llvm.readcyclecounter", ir.IntType(64), []), [])
    return types.int64(), codegen
