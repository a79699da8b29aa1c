"""LLVM IR of the MX kernels (gpu_model/mx_kernels.py): a block of 32 codes decoded in registers
into two <16 x float>, and the two intrinsics built on it.

A block decodes to values I, exact in float32 (integers but for mxfp8), with element = I x 2^-k, so weight = I x
2^(scale - 127 - k), one float32 product per weight, the same rounding as mx.decode's element x
2^(scale - 127) (the scale table passed in holds 2^(s - 127 - k), NaN at 255):

    mxfp4   k = 1  16-entry byte table (pshufb) of 2 x element, per nibble
    mxfp6   k = 3  8 x element: two 16-entry tables (pshufb) for the 5-bit magnitude, then the sign
    mxfp8   k = 0  the element itself, through float16 bits and F16C (_fp8_floats); codes S.1111.111: NaN
    mxint8  k = 6  the code itself

Where integers are converted (mxint8; mxfp4 and mxfp6 without AVX-512), negative zero decodes to +0
(integers have no -0); a dot product's sum does not change. pshufb is SSSE3 and vcvtph2ps F16C, so
every x86-64 CPU with AVX2 and F16C runs these. With AVX-512, mxfp4 and mxfp6 look their
elements up as float32 instead: the block's table of (element x 2^k) x scale, 16 (vpermps) or 32
(vpermi2ps, the sign bit or-ed in after) entries, one multiply per table rather than one per weight
(the same exact products), and no integer-to-float conversions.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils

from cpu_attn.llvm_ir import _llvm_fn, host_has, splat
from gpu_model import mx

KINDS = ("mxfp8", "mxfp6", "mxfp4", "mxint8")
SCALE_SHIFT = {"mxfp8": 0, "mxfp6": 3, "mxfp4": 1, "mxint8": 6}
"""k: element = I x 2^-k."""

_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
_VF, _VB, _VI = ir.VectorType(_F32, 16), ir.VectorType(_I8, 16), ir.VectorType(_I32, 16)


def scale_table(fmt: str) -> np.ndarray:
    """[256] float32: 2^(s - 127 - k) for E8M0 code s, NaN at 255."""
    s = np.arange(256)
    return np.where(s == mx.SCALE_NAN, np.nan, np.ldexp(1.0, s - 127 - SCALE_SHIFT[fmt])).astype(np.float32)


def _int_table(fmt: str, first: int) -> list[int]:
    """16 entries of I (= element x 2^k) for the codes first .. first + 15."""
    values = mx.element_values(mx.get_format(fmt))[first:first + 16] * 2 ** SCALE_SHIFT[fmt]
    return [int(v) for v in values]


def _bytes(values) -> ir.Constant:
    return ir.Constant(_VB, [v & 0xFF for v in values])


def load(builder, base, kind, i):
    """LLVM IR: the `kind` value at element i of the pointer base (unaligned)."""
    value = builder.load(builder.bitcast(builder.gep(base, [i]), kind.as_pointer()))
    value.align = 1
    return value


def _pshufb(builder, table: ir.Constant, index):
    return builder.call(_llvm_fn(builder, "llvm.x86.ssse3.pshuf.b.128", _VB, [_VB, _VB]), [table, index])


def _fp4_ints(builder, block):
    p = load(builder, block, _VB, _I64(0))
    table = _bytes(_int_table("mxfp4", 0))
    return [_pshufb(builder, table, builder.and_(p, _bytes([15] * 16))),
            _pshufb(builder, table, builder.lshr(p, _bytes([4] * 16)))]


def _fp6_high(builder, block):
    """The block's uint64 of high bit pairs broadcast to sixteen 32-bit lanes: lane l holds its low
    (l even) or high (l odd) half, where lane l's pairs sit (mx.FP6_HIGH_BITS)."""
    word = load(builder, block, ir.VectorType(_I32, 2), _I64(16))
    return builder.shuffle_vector(word, word, ir.Constant(ir.VectorType(_I32, 16), [0, 1] * 8))


def _fp6_pair_bit(h: int, l: int) -> int:
    """Bit of lane l's dword where element 16 h + l's pair starts."""
    return 16 * h + 2 * (l >> 1)


def _fp6_codes(builder, block):
    """A block's 32 six-bit codes as two <16 x i8> (elements 0..15, 16..31) from its two planes."""
    low = builder.zext(load(builder, block, _VB, _I64(0)), _VI)
    high = _fp6_high(builder, block)
    codes = []
    for h in (0, 1):
        nibble = builder.and_(builder.lshr(low, ir.Constant(_VI, [4 * h] * 16)), ir.Constant(_VI, [15] * 16))
        pair = builder.and_(builder.lshr(high, ir.Constant(_VI, [_fp6_pair_bit(h, l) for l in range(16)])),
                            ir.Constant(_VI, [3] * 16))
        codes.append(builder.trunc(builder.or_(nibble, builder.shl(pair, ir.Constant(_VI, [4] * 16))), _VB))
    return codes


def _fp6_ints(builder, block):
    halves = []
    for code in _fp6_codes(builder, block):
        index = builder.and_(code, _bytes([15] * 16))
        small, large = (_pshufb(builder, _bytes(_int_table("mxfp6", first)), index) for first in (0, 16))
        zero = ir.Constant(_VB, [0] * 16)
        mag = builder.select(builder.icmp_unsigned("!=", builder.and_(code, _bytes([16] * 16)), zero), large, small)
        is_neg = builder.icmp_unsigned("!=", builder.and_(code, _bytes([32] * 16)), zero)
        halves.append(builder.select(is_neg, builder.sub(zero, mag), mag))
    return halves


def _float_table(builder, fmt: str, first: int, scale):
    """LLVM IR: (element x 2^k) x scale for the codes first .. first + 15 (-0 kept)."""
    values = mx.element_values(mx.get_format(fmt))[first:first + 16] * 2 ** SCALE_SHIFT[fmt]
    return builder.fmul(ir.Constant(_VF, [float(v) for v in values]), scale)


def _fp4_avx512(builder, block, scale):
    codes = builder.zext(load(builder, block, _VB, _I64(0)), _VI)
    table = _float_table(builder, "mxfp4", 0, scale)
    permute = _llvm_fn(builder, "llvm.x86.avx512.permvar.sf.512", _VF, [_VF, _VI])  # index bits 0..3
    high = builder.lshr(codes, ir.Constant(_VI, [4] * 16))
    return [builder.call(permute, [table, codes]), builder.call(permute, [table, high])]


def _fp6_avx512(builder, block, scale):
    """Elements in 32-bit lanes: lane l of half h takes its low nibble from byte l of the first plane
    and its pair from the broadcast uint64 (_fp6_high), turned into place: bit 4 (the table's top
    index bit) and bit 31 (the float's sign)."""
    tables = [_float_table(builder, "mxfp6", first, scale) for first in (0, 16)]
    permute = _llvm_fn(builder, "llvm.x86.avx512.vpermi2var.ps.512", _VF, [_VF, _VI, _VF])  # index bits 0..4
    rotate = _llvm_fn(builder, "llvm.fshl.v16i32", _VI, [_VI] * 3)
    c = lambda values: ir.Constant(_VI, values)  # noqa: E731
    low = builder.zext(load(builder, block, _VB, _I64(0)), _VI)
    high = _fp6_high(builder, block)
    out = []
    for h in (0, 1):
        nibble = low if h == 0 else builder.lshr(low, c([4] * 16))
        bits = [_fp6_pair_bit(h, l) for l in range(16)]
        bit4 = builder.call(rotate, [high, high, c([(4 - b) % 32 for b in bits])])
        index = builder.or_(builder.and_(nibble, c([~16] * 16)), builder.and_(bit4, c([16] * 16)))
        sign = builder.and_(builder.call(rotate, [high, high, c([(30 - b) % 32 for b in bits])]), c([-2**31] * 16))
        mag = builder.bitcast(builder.call(permute, [tables[0], index, tables[1]]), _VI)
        out.append(builder.bitcast(builder.or_(mag, sign), _VF))
    return out


def _fp8_floats(builder, block):
    """E4M3 codes moved into float16 bits (sign to bit 15, exponent and mantissa to bits 7..13) read
    as element x 2^-8, subnormals included; widened by F16C's vcvtph2ps and multiplied by 2^8, both
    exact. Codes S.1111.111 are NaN."""
    lanes16 = ir.VectorType(ir.IntType(16), 16)
    c = lambda v: ir.Constant(lanes16, [v] * 16)  # noqa: E731
    out = []
    for h in (0, 1):
        z = builder.zext(load(builder, block, _VB, _I64(16 * h)), lanes16)
        bits = builder.or_(builder.and_(builder.shl(z, c(7)), c(0x3F80)), builder.and_(builder.shl(z, c(8)), c(0x8000)))
        f = builder.fmul(builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), _VF),
                         ir.Constant(_VF, [256.0] * 16))
        is_nan = builder.icmp_unsigned("==", builder.and_(z, c(127)), c(127))
        out.append(builder.select(is_nan, ir.Constant(_VF, [float("nan")] * 16), f))
    return out


class Blocks:
    """LLVM IR: the blocks of a weight (codes [N, K/32, B] uint8, scales [N, K/32] uint8; the arrays'
    structs) in format `fmt`, a block at a time in two <16 x float> (exact weights)."""

    def __init__(self, builder, fmt: str, codes, scales, table):
        self.builder, self.fmt, self.codes, self.scales, self.table = builder, fmt, codes, scales, table
        self.num_blocks = cgutils.unpack_tuple(builder, scales.shape, 2)[1]
        self.block_bytes = _I64(mx.get_format(fmt).block_bytes)
        self.avx512 = host_has("avx512f")

    def weights(self, n, b):
        """Row n's block b -> [elements 0..15, 16..31] as <16 x float>."""
        builder = self.builder
        at = builder.add(builder.mul(n, self.num_blocks), b)
        block = builder.gep(self.codes.data, [builder.mul(at, self.block_bytes)])
        code = builder.zext(builder.load(builder.gep(self.scales.data, [at])), _I64)
        scale = splat(builder, builder.load(builder.gep(self.table.data, [code])), 16)
        if self.fmt in ("mxfp4", "mxfp6") and self.avx512:
            return (_fp4_avx512 if self.fmt == "mxfp4" else _fp6_avx512)(builder, block, scale)
        if self.fmt == "mxfp8":
            halves = _fp8_floats(builder, block)
        else:
            ints = {"mxfp4": _fp4_ints, "mxfp6": _fp6_ints}[self.fmt](builder, block) if self.fmt != "mxint8" else \
                [load(builder, block, _VB, _I64(16 * h)) for h in (0, 1)]
            halves = [builder.sitofp(v, _VF) for v in ints]
        return [builder.fmul(h, scale) for h in halves]


def hsum(builder, v):
    """LLVM IR: the sum of a <16 x float>'s lanes, as a tree of adds."""
    for lanes in (8, 4, 2, 1):
        kind = ir.VectorType(_I32, lanes)
        v = builder.fadd(builder.shuffle_vector(v, v, ir.Constant(kind, list(range(lanes)))),
                         builder.shuffle_vector(v, v, ir.Constant(kind, list(range(lanes, 2 * lanes)))))
    return builder.extract_element(v, _I32(0))
