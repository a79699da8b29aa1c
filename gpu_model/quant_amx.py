"""The integer-dot layout's weights (gpu_model/quant_vnni.py) multiplied by AMX-BF16 tiles, for steps of a few rows.

`vpdpwssd` does 32 multiply-adds an instruction, so past a few rows of x the VNNI kernels are bound by the
CPU: a decode step's linears take ~4x at 16 rows what they take at one. An AMX tile multiply
(`tdpbf16ps`) does 16 x 16 x 32. Here each block of a group's 16 weight rows becomes one tile of its
small integers (exact in bf16) and meets up to 16 rows of x at once; the block's scales are applied
to the tile's float32 sums, so the weights are used exactly and only x is rounded (to bf16, round to
nearest even: a relative error of 2^-9, as the bf16 linears that larger steps use):

    B tile [16 pairs, 16 rows, 2] bf16   row t = V_t of the VNNI layout (lane l: row l's integers 2t, 2t + 1),
                                         4- and 6-bit codes looked up in tables of bf16 words (vpermw, vpermi2w)
    A tile [rows of x, 32] bf16          x's 32 columns of the block, read in place (row stride K)
    C tile [rows of x, 16] float32       the block's 16 integer dots per row of x, zeroed, stored each block
    out[i, n] = sum_b  d[n, b] * C_b[i, n]  +  m[n, b] * sum(x[i, b])      (Q8_0: no m; MX: d = 2^(s - 127 - k))

A tile load does not take data from the store buffer, so B tiles are decoded CHUNK blocks ahead of
their loads, and each stored C tile is read RING - 1 blocks later: a load right after the stores it
needs waited for them to reach the cache. Linux hands the tile registers to a process that asks
(arch_prctl ARCH_REQ_XCOMP_PERM), which `is_available` does; it must run before any kernel here.
"""
from __future__ import annotations

import ctypes
import functools
import platform

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import _as_f32, c_array, host_has, prefetch_ir
from gpu_model.quant import BLOCK, PREFETCH_BYTES
from gpu_model.quant_vnni import (_BLOCK_BYTES, MX_KINDS, NO_NORM, ROWS, VnniWeight, _hadamard_blocks, _input_row,
                                  _mx_table, _splat, _vload, block_arrays, gguf_scale_bytes, gguf_scale_vectors, is_x8,
                                  kind_codegen, matvec)

TILE_ROWS = 16  # rows of x a tile holds
CHUNK = 4  # blocks whose B tiles are decoded before the first of them is loaded
RING = 4  # C tiles kept in memory, each read RING - 1 blocks after it was stored
_B, _A = 2, 1  # the tiles: C 0, A 1, B 2
PARTS = 16
"""A matmul's groups go to the threads in this many parts, each part one call (one tile configuration): on 2 cores
2 to 16 parts took the same time, 64 parts ~1.3x (a fixed number: numba.get_num_threads() in the kernel would
keep Numba from caching it)."""


class _BFloat(ir.types._BaseFloatType):
    """LLVM's bfloat (llvmlite has no such type): the target of fptrunc, which AVX512-BF16 does in one instruction."""

    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat._create_instance()


@functools.cache
def is_available() -> bool:
    """Whether this CPU and OS run the tile kernels: AMX-BF16 (with AVX512-BF16 for the rounding) and Linux's
    permission for the process to use the tile registers (asked for here, once)."""
    if not (host_has("amx-tile", "amx-bf16", "avx512bf16", "avx512vnni", "avx512bw") and platform.system() == "Linux"
            and platform.machine() == "x86_64"):
        return False
    arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
    return ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, req_xcomp_perm, xtiledata) == 0


@njit(cache=True, nogil=True)
def round_row_bf16(x, i, norm, eps, gated, hadamard, xb, xsum):
    """Row i of x: [M, K] float32 (or [M, 2K] gate | up) -> the input row (quant_vnni._input_row, turned per block
    with `hadamard`) rounded to bf16 bits (round to nearest even; NaN stays NaN) in xb[i] uint16, and the sums of
    the rounded values per block of 32 in xsum[i] (Q4_1's m term)."""
    row = np.empty(xb.shape[1], np.float32)
    _input_row(x, i, norm, eps, gated, row)
    if hadamard:
        _hadamard_blocks(row)
    bits = row.view(np.uint32)
    for b in range(xsum.shape[1]):
        total = np.float32(0.0)
        for j in range(b * BLOCK, (b + 1) * BLOCK):
            u = bits[j]
            r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            r = np.uint32(0x7FC0) if u & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000) else r  # NaN
            xb[i, j] = np.uint16(r)
            total += _as_f32(r << np.uint32(16))
        xsum[i, b] = total


_F32, _I8, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_VF, _VI = ir.VectorType(_F32, ROWS), ir.VectorType(_I32, ROWS)
_W8, _WI, _WF = ir.VectorType(_I8, 2 * ROWS), ir.VectorType(_I16, 2 * ROWS), ir.VectorType(_F32, 2 * ROWS)
_WB = ir.VectorType(_BFloat(), 2 * ROWS)
_BYTES = _I8.as_pointer()


def _bf16_bits(values) -> list[int]:
    """The bf16 bit patterns of small integers (exact)."""
    return [int(v) for v in (np.asarray(values, np.float32).view(np.uint32) >> 16)]


def _amx(builder, name: str, *args) -> None:
    """LLVM IR: call the AMX intrinsic llvm.x86.`name` (tile numbers as i8 constants)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [a.type for a in args]),
                                        f"llvm.x86.{name}")
    builder.call(fn, list(args))


def _int8_bf16(builder, codes):
    """LLVM IR: <32 x i8> -> the bf16 bits of the integers (exact). With AVX512-FP16: int16 -> fp16 in one instruction
    (vcvtw2ph), then the fp16 bits moved to bf16's exponent bias (a magnitude of at most 128 has no more than bf16's
    8 significant bits), zero kept; else through float32."""
    if not host_has("avx512fp16"):
        return builder.bitcast(builder.fptrunc(builder.sitofp(codes, _WF), _WB), _WI)
    half = builder.bitcast(builder.sitofp(builder.sext(codes, _WI), ir.VectorType(ir.HalfType(), 2 * ROWS)), _WI)
    splat = lambda v: ir.Constant(_WI, [v] * 32)  # noqa: E731
    magnitude = builder.and_(half, splat(0x7FFF))
    bf16 = builder.or_(builder.add(builder.lshr(magnitude, splat(3)), splat((127 - 15) << 7)),
                       builder.and_(half, splat(0x8000)))
    return builder.select(builder.icmp_unsigned("==", magnitude, splat(0)), splat(0), bf16)


def _tile_vectors(builder, kind: str, qa, q_at, k: int):
    """LLVM IR: V_k and V_k+8 of the block at element q_at of qs (quant_vnni's layout) as <32 x i16> bf16 bits of
    their integers I (Q4_1: q; Q8_0: q; MX: element x 2^k), exact: 4- and 6-bit codes looked up in a table of
    bf16 words (vpermw, vpermi2w), 8-bit ones converted (_int8_bf16)."""
    at = lambda offset: builder.gep(qa.data, [builder.add(q_at, _I64(offset))])  # noqa: E731
    if kind in ("q8_0", "mxint8"):
        return [_int8_bf16(builder, _vload(builder, at(32 * t), _W8)) for t in (k, k + 8)]
    lookup = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_WI, [_WI, _WI]),
                                            "llvm.x86.avx512.permvar.hi.512")
    raw = builder.zext(_vload(builder, at(32 * k), _W8), _WI)
    low, high = builder.and_(raw, ir.Constant(_WI, [15] * 32)), builder.lshr(raw, ir.Constant(_WI, [4] * 32))
    if kind == "q4_1":
        table = ir.Constant(_WI, _bf16_bits(list(range(16)) * 2))
        return [builder.call(lookup, [table, v]) for v in (low, high)]
    ints = np.array(_mx_table(kind), np.uint8).view(np.int8)
    if kind == "mxfp4":
        table = ir.Constant(_WI, _bf16_bits(list(ints) * 2))
        return [builder.call(lookup, [table, v]) for v in (low, high)]
    # mxfp6: the top two bits of each code from the plane after the nibbles (quant_vnni's layout)
    top16 = builder.zext(_vload(builder, at(256 + 16 * k), ir.VectorType(_I8, 16)), ir.VectorType(_I16, 16))
    pairs = builder.shuffle_vector(top16, builder.lshr(top16, ir.Constant(ir.VectorType(_I16, 16), [4] * 16)),
                                   ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    low = builder.or_(low, builder.shl(builder.and_(pairs, ir.Constant(_WI, [3] * 32)), ir.Constant(_WI, [4] * 32)))
    high = builder.or_(high, builder.shl(builder.and_(builder.lshr(pairs, ir.Constant(_WI, [2] * 32)),
                                                      ir.Constant(_WI, [3] * 32)), ir.Constant(_WI, [4] * 32)))
    lookup2 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_WI, [_WI, _WI, _WI]),
                                             "llvm.x86.avx512.vpermi2var.hi.512")
    bits = _bf16_bits(list(ints))
    tables = [ir.Constant(_WI, bits[:32]), ir.Constant(_WI, bits[32:])]
    return [builder.call(lookup2, [tables[0], v, tables[1]]) for v in (low, high)]


def _codegen(kind: str):
    """LLVM IR of out[i, ROWS g : ROWS (g + 1)] for the up to TILE_ROWS rows i of x (bf16 bits) and the groups g of a
    range (module docstring): per CHUNK blocks, their B tiles decoded; then per block its product stored to the
    ring, and the block RING - 1 before it scaled into the rows' sums (Q4_1: plus m times the row's block sum)."""
    is_mx = kind in MX_KINDS

    def codegen(context, builder, signature, args):
        xa, xsa, sa, qa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in range(4))
        out = context.make_array(signature.args[6])(context, builder, args[6])
        first_group, end_group = args[4], args[5]
        num_x, width = cgutils.unpack_tuple(builder, xa.shape, 2)
        num_blocks = cgutils.unpack_tuple(builder, qa.shape, 4)[1]
        num_out = cgutils.unpack_tuple(builder, out.shape, 2)[1]
        block_bytes = _BLOCK_BYTES[kind]
        nscales = 2 if kind == "q4_1" else 1
        item = 1 if is_mx else gguf_scale_bytes(signature, 2)  # bytes of one scale
        scale_bytes = ROWS * nscales * item
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")

        def buffer(size):
            b = cgutils.alloca_once(builder, ir.ArrayType(_I8, size))
            b.align = 64
            return builder.bitcast(b, _BYTES)

        cfg = buffer(64)
        builder.store(ir.Constant(ir.ArrayType(_I8, 64), [0] * 64), builder.bitcast(cfg, ir.ArrayType(_I8, 64).as_pointer()))
        builder.store(_I8(1), cfg)  # palette 1
        rows = builder.trunc(num_x, _I8)
        for tile in range(3):  # bytes 16 + 2 t: the tile's bytes a row; byte 48 + t: its rows
            builder.store(_I16(64), builder.bitcast(builder.gep(cfg, [_I64(16 + 2 * tile)]), _I16.as_pointer()))
            builder.store(_I8(ROWS) if tile == _B else rows, builder.gep(cfg, [_I64(48 + tile)]))
        _amx(builder, "ldtilecfg", cfg)
        tile_b = buffer(64 * ROWS * CHUNK)  # the B tiles of CHUNK blocks, decoded before any is multiplied
        ring = buffer(64 * TILE_ROWS * RING)  # C tiles of the latest RING blocks, read RING - 1 blocks after stored
        sums = builder.bitcast(buffer(64 * TILE_ROWS), _VF.as_pointer())
        x_bytes = builder.bitcast(xa.data, _BYTES)
        x_stride = builder.mul(width, _I64(2))

        def b_slot(b):
            return builder.gep(tile_b, [builder.mul(builder.urem(b, _I64(CHUNK)), _I64(64 * ROWS))])

        def slot(b):
            return builder.gep(ring, [builder.mul(builder.and_(b, _I64(RING - 1)), _I64(64 * TILE_ROWS))])

        def decode(group, b):  # block b's B tile into its chunk slot
            at = builder.add(builder.mul(group, num_blocks), b)
            q_at = builder.mul(at, _I64(block_bytes))
            s_at = builder.mul(at, _I64(ROWS * nscales))
            for array, offset, size, step in ((qa, q_at, 1, block_bytes), (sa, s_at, item, scale_bytes)):
                ahead = PREFETCH_BYTES * step // block_bytes
                byte = builder.mul(offset, _I64(size))
                for line in range(0, step, 64):
                    prefetch_ir(builder, array.data, builder.add(byte, _I64(ahead + line)))
            for k in range(8):
                for t, v in zip((k, k + 8), _tile_vectors(builder, kind, qa, q_at, k)):
                    builder.store(v, builder.bitcast(builder.gep(b_slot(b), [_I64(64 * t)]), _WI.as_pointer()),
                                  align=64)

        def multiply(b):  # block b's products into its ring slot
            _amx(builder, "tileloadd64", _I8(_B), b_slot(b), _I64(64))
            _amx(builder, "tileloadd64", _I8(_A), builder.gep(x_bytes, [builder.mul(b, _I64(2 * BLOCK))]), x_stride)
            _amx(builder, "tilezero", _I8(0))
            _amx(builder, "tdpbf16ps", _I8(0), _I8(_A), _I8(_B))
            _amx(builder, "tilestored64", _I8(0), slot(b), _I64(64))

        def scale(group, b):  # block b's products from its ring slot, scaled, into the sums
            s_at = builder.mul(builder.add(builder.mul(group, num_blocks), b), _I64(ROWS * nscales))
            if is_mx:
                e8m0 = builder.zext(_vload(builder, builder.gep(sa.data, [s_at]), ir.VectorType(_I8, ROWS)), _VI)
                d = builder.fmul(builder.bitcast(builder.shl(e8m0, ir.Constant(_VI, [23] * ROWS)), _VF),
                                 ir.Constant(_VF, [2.0 ** -MX_KINDS[kind]] * ROWS))
                m = None
            else:
                d, m = (gguf_scale_vectors(builder, sa, s_at, nscales, item) + [None])[:2]
            c = builder.bitcast(slot(b), _VF.as_pointer())
            with cgutils.for_range(builder, num_x) as row:
                i = row.index
                acc = builder.call(fma, [_vload(builder, builder.gep(c, [i]), _VF, 64), d,
                                         builder.load(builder.gep(sums, [i]))])
                if m is not None:
                    xsum = builder.load(builder.gep(xsa.data, [builder.add(builder.mul(i, num_blocks), b)]))
                    acc = builder.call(fma, [m, _splat(builder, xsum, _VF), acc])
                builder.store(acc, builder.gep(sums, [i]))

        with cgutils.for_range_slice(builder, first_group, end_group, _I64(1)) as (group, _):
            with cgutils.for_range(builder, num_x) as row:
                builder.store(ir.Constant(_VF, [0.0] * ROWS), builder.gep(sums, [row.index]))
            with cgutils.for_range_slice(builder, _I64(0), num_blocks, _I64(CHUNK)) as (start, _):
                stop = builder.add(start, _I64(CHUNK))
                stop = builder.select(builder.icmp_unsigned("<", stop, num_blocks), stop, num_blocks)
                with cgutils.for_range_slice(builder, start, stop, _I64(1)) as (b, _):
                    decode(group, b)
                with cgutils.for_range_slice(builder, start, stop, _I64(1)) as (b, _):
                    multiply(b)
                    with builder.if_then(builder.icmp_unsigned(">=", b, _I64(RING - 1))):
                        scale(group, builder.sub(b, _I64(RING - 1)))
            with cgutils.for_range_slice(builder, builder.sub(num_blocks, builder.select(
                    builder.icmp_unsigned("<", num_blocks, _I64(RING - 1)), num_blocks, _I64(RING - 1))),
                    num_blocks, _I64(1)) as (b, _):
                scale(group, b)
            with cgutils.for_range(builder, num_x) as row:
                at = builder.add(builder.mul(row.index, num_out), builder.mul(group, _I64(ROWS)))
                builder.store(builder.load(builder.gep(sums, [row.index])),
                              builder.bitcast(builder.gep(out.data, [at]), _VF.as_pointer()), align=4)
        _amx(builder, "tilerelease")
        return context.get_dummy_value()
    return codegen


@intrinsic
def _groups(typingctx, xb, xsum, scales, qs, first, end, out):
    """out[i, ROWS g : ROWS (g + 1)] for the up to TILE_ROWS rows of xb and groups first <= g < end (_codegen); the
    weights' kind from the arrays' types (quant_vnni.kind_codegen). Where the CPU has no AMX it compiles to nothing
    (callers check is_available)."""
    checks = (c_array(xb, 2, types.uint16), c_array(xsum, 2, types.float32), block_arrays(scales, qs),
              isinstance(first, types.Integer), isinstance(end, types.Integer), c_array(out, 2, types.float32))
    if not all(checks):
        return None
    signature = types.none(xb, xsum, scales, qs, first, end, out)
    if not host_has("amx-tile", "amx-bf16", "avx512bf16"):
        return signature, lambda context, builder, signature, args: context.get_dummy_value()
    return signature, kind_codegen(_codegen, scales, qs, 3)


@njit(cache=True, nogil=True, inline="always")
def matvec_tiles(x, norm, eps, gated, hadamard, scales, qs, out):
    """out = (x, normed or gated, and turned, as round_row_bf16 says) @ W.T by AMX tiles: a group of ROWS weight
    rows at a time in parallel (in the parallel function this is inlined into), the rows of x TILE_ROWS at a time."""
    xb = np.empty((x.shape[0], qs.shape[1] * BLOCK), np.uint16)
    xsum = np.empty((x.shape[0], qs.shape[1]), np.float32)
    if hadamard and x.shape[0] > 1:  # the butterfly is scalar: rows in parallel
        for i in prange(x.shape[0]):
            round_row_bf16(x, i, norm, eps, gated, hadamard, xb, xsum)
    else:  # vectorized: ~10 us for 5 rows of 1536, less than a parallel region's start
        for i in range(x.shape[0]):
            round_row_bf16(x, i, norm, eps, gated, hadamard, xb, xsum)
    num_groups = qs.shape[0]
    num_parts = min(num_groups, PARTS)
    for p in prange(num_parts):
        first, end = p * num_groups // num_parts, (p + 1) * num_groups // num_parts
        for i in range(0, x.shape[0], TILE_ROWS):
            _groups(xb[i:i + TILE_ROWS], xsum[i:i + TILE_ROWS], scales, qs, first, end, out[i:i + TILE_ROWS])


@njit(cache=True, nogil=True, inline="always")
def block_matvec(x, norm, eps, gated, hadamard, scales, qs, out, tile_rows):
    """out = x @ W.T for integer-dot weights (quant_vnni.matvec's arguments): by AMX tiles when x has at least
    `tile_rows` rows (tile_rows > 0; is_available() must be true) and the weights are not in the x8 layout, else by
    quant_vnni.matvec."""
    if 0 < tile_rows <= x.shape[0] and not is_x8(qs):
        matvec_tiles(x, norm, eps, gated, hadamard, scales, qs, out)
    else:
        matvec(x, norm, eps, gated, hadamard, scales, qs, out)


@njit(cache=True, nogil=True, parallel=True)
def parallel_matvec(x, norm, eps, gated, hadamard, scales, qs, out, tile_rows):
    """block_matvec as a parallel function of its own (one compiled copy per weight kind), for block_matmul and
    for Numba code that runs one matvec after another (cpu_decode.decode_layers)."""
    block_matvec(x, norm, eps, gated, hadamard, scales, qs, out, tile_rows)


def block_matmul(x: torch.Tensor, w: VnniWeight, tile_rows: int, norm: torch.Tensor | None = None, eps: float = 0.0,
                 gated: bool = False) -> torch.Tensor:
    """x @ W.T as block_matvec (`norm`, `eps`, `gated` as quant_vnni.vnni_matmul) -> [M, N] float32."""
    xn = np.ascontiguousarray(x.detach().numpy())
    out = np.empty((xn.shape[0], w.shape[0]), np.float32)
    parallel_matvec(xn, NO_NORM if norm is None else norm.detach().numpy(), eps, gated, w.rotated, w.scales, w.qs, out,
                  tile_rows)
    return torch.from_numpy(out)
