"""fp16 cache rows widened to float32. Numba has no float16 on the CPU, so an fp16 cache is stored
as its raw uint16 bits and widened a block at a time: by F16C's vcvtph2ps where the CPU has it
(F16C), else with integer and float operations (exact, subnormals, inf and nan included; both
tested against numpy for all 65536 bit patterns, F16C's NaNs up to their quiet bit)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from cpu_attn.llvm_ir import _as_f32, _as_u32, _FAST, _llvm_fn, c_array, host_has, matrix_args


_F16_REBIAS = np.float32(2.0**112)  # 2^(127 - 15): moves a half's exponent to float32's bias


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


def kernel_rows(src, width, out):
    """src [block_size, D]: a block's cache rows of one kv-head -> rows the exact kernels' row steps take
    (kernels.attend_block): src itself for a float32 cache, and for fp16 bits where the CPU has F16C (the
    steps widen each row in registers as they read it); else widen_block's float32 copy in out."""


@overload(kernel_rows, jit_options={"nogil": True, "fastmath": _FAST})
def _kernel_rows_impl(src, width, out):
    if src.dtype == types.float32 or F16C:
        return lambda src, width, out: src
    return lambda src, width, out: widen_block(src, width, out)


def to_f32(x):
    """A cache value as float32: fp16 bits (uint16) widened (fp16_to_f32), a float32 as it is."""


@overload(to_f32, jit_options={"nogil": True})
def _to_f32_impl(x):
    if x == types.uint16:
        return lambda x: fp16_to_f32(x)
    return lambda x: np.float32(x)


@njit(cache=True, nogil=True)
def widen(src, out):
    """Test hook: src [R, D] uint16 fp16 bits or float32 -> out [R, D] float32, all R rows (widen_block)."""
    out[:] = widen_block(src, src.shape[0], out)


@njit(cache=True, nogil=True)
def widen_exact(src, out):
    """Test hook: src [N] uint16 fp16 bits -> out [N] float32 by fp16_to_f32 (the path without F16C)."""
    for i in range(src.shape[0]):
        out[i] = fp16_to_f32(src[i])


@njit(cache=True, nogil=True, inline="always")
def f32_to_fp16(f):
    """float32 -> float16 bits, rounded to nearest even as numpy's astype(np.float16) rounds (subnormals, overflow
    to inf, inf and nan, the nan's top payload bits kept and never turned into inf)."""
    u32 = np.uint32
    u = _as_u32(f)
    sign = u32(u32(u >> 16) & 0x8000)
    a = u32(u & 0x7FFFFFFF)
    if a >= u32(0x7F800000):  # inf, nan
        if a == u32(0x7F800000):
            return np.uint16(sign | 0x7C00)
        payload = u32(u32(a & 0x7FFFFF) >> 13)
        return np.uint16(sign | 0x7C00 | (payload if payload != 0 else u32(1)))
    if a >= u32(0x47800000):  # 2^16 and above: past the largest half even before rounding
        return np.uint16(sign | 0x7C00)
    if a >= u32(0x38800000):  # a normal half (rounding may carry into the exponent, up to inf)
        h = u32(u32(u32(a >> 23) - 112) << 10) | u32(u32(a & 0x7FFFFF) >> 13)
        rest = u32(a & 0x1FFF)
        if rest > u32(0x1000) or (rest == u32(0x1000) and u32(h & 1) == u32(1)):
            h += u32(1)
        return np.uint16(sign | h)
    if a < u32(0x33000000):  # at most half the smallest subnormal: zero (the tie rounds to even)
        return np.uint16(sign)
    shift = u32(126 - u32(a >> 23))  # a subnormal half: units of 2^-24
    sig = u32(u32(a & 0x7FFFFF) | 0x800000)
    h = u32(sig >> shift)
    rest = u32(sig & u32(u32(u32(1) << shift) - 1))
    half = u32(u32(1) << u32(shift - 1))
    if rest > half or (rest == half and u32(h & 1) == u32(1)):
        h += u32(1)
    return np.uint16(sign | h)


def narrow_row(src, dst):
    """dst[:] = src: a float32 row [D] into a cache row [D], float32 (a copy) or uint16 fp16 bits (f32_to_fp16)."""


@overload(narrow_row, jit_options={"nogil": True})
def _narrow_row_impl(src, dst):
    if dst.dtype == types.float32:
        def copy(src, dst):
            dst[:] = src
        return copy

    def narrow(src, dst):
        for d in range(dst.shape[0]):
            dst[d] = f32_to_fp16(src[d])
    return narrow


@njit(cache=True, nogil=True)
def narrow(src, out):
    """Test hook: src [N] float32 -> out [N] uint16 fp16 bits (f32_to_fp16)."""
    narrow_row(src, out)
