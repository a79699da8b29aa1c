"""GGUF Q4_1 / Q8_0 weights multiplied with integer dot products (AVX512-VNNI, or AVX2), for decode steps.

The float kernels of gpu_model/quant.py decode every weight to float32 (~10 vector operations a
block of 32): at one row of x they are bound by the CPU, not by memory. Here each row of x is
first rounded to int16 per block of 32 (scale dx = max |x| / 32767, round half to even: a relative
error of 2^-16, where llama.cpp's int8 costs this model 1 % perplexity), and the weights' small
integers meet it in `vpdpwssd` (16 int32 lanes, each summing two products of 16-bit integers). The
result is the exact dot product of the rounded x with the weights (integers exact; the scales
applied in float32):

    out[i, n] = sum_b  d[n, b] * dx[i, b] * (xq[i, b] . q[n, b])  +  m[n, b] * dx[i, b] * sum(xq[i, b])

(Q8_0 has no m term.) The 16 lanes are 16 weight rows: a group of ROWS = 16 rows is stored block by
block, and within a block as 16 vectors V_t whose lane l holds row l's weights 2t, 2t + 1 (as two
16-bit values); `vpdpwssd(acc, V_t, x pair t broadcast)` adds both products to each row's lane (without AVX-512:
`vpmaddwd` on each half of the lanes, then `vpaddd`; the same integers). After
a block's 16 such steps each lane holds its row's whole integer dot for the block, so the float work
(convert, scale by d x dx, Q4_1's m term) is four operations a block for 16 rows, and the 16 sums
are the 16 outputs, stored as one vector. The vectors come straight from the GGUF bytes:

    Q4_1 qs [G, NB, 8, 32] u8: [g, b, t, 2l + e] = GGUF byte 2t + e of row 16 g + l's block b, which holds
         weight 2t + e (low nibble, V_t) and 2t + 16 + e (high nibble, V_t+8): one load widened to 16 bits
         gives V_t (& 15) and V_t+8 (>> 4)
    Q8_0 qs [G, NB, 16, 32] i8: [g, b, t, 2l + e] = weight 2t + e of row 16 g + l's block b
    scales [G, NB, 2 | 1, 16] f16 bits (uint16; float32 where a value is not a float16): d, then Q4_1's m,
         of the group's 16 rows (a GGUF stores them as float16: 5 and 8.5 bits a weight in all, not 6 and 9)

MX weights (gpu_model/mx.py) take the same route: an element is I x 2^-k with I a small integer (mxfp4
2 x E2M1, |I| <= 12, k = 1; mxfp6 8 x E2M3, |I| <= 60, k = 3; mxint8 the code, k = 6), so a block's dot
is again exact in integers and its scale 2^(s - 127 - k) is applied in float32. Their codes keep their
bits per weight, scales included (4.25 / 6.25 / 8.25), in the same vector order:

    mxint8 qs [G, NB, 16, 32] i8: as Q8_0
    mxfp4  qs [G, NB, 8, 32] u8: as Q4_1, each nibble an E2M1 code; V_t = sext(pshufb(table, nibbles))
    mxfp6  qs [G, NB, 12, 32] u8: [.., 0:8, :] the low nibbles of the 6-bit codes as mxfp4's; [.., 8:12, :]
           viewed as [8, 16]: row t's byte j holds the top two code bits of the four nibbles of bytes j
           and j + 16 of row t (bits 0-1: j's low, 2-3: j's high, 4-5: j + 16's low, 6-7: j + 16's high);
           the 6-bit codes are looked up in a 64-byte table (vpermb, AVX512-VBMI)
    scales [G, NB, 1, 16] u8: E8M0 of the group's 16 rows

With 8-bit activations (`x_bits` 8: GGUF blocks on AVX512-VNNI, Q4_1 ones on AVX2) x is rounded to max |x| / 127
per block, as llama.cpp's Q8 activations are, and meets the weights in `vpdpbusd` (16 int32 lanes, each summing
four products of an unsigned byte and a signed one): half the instructions of the int16 dots, where several rows
of x a step make the kernel bound by them (verified draft tokens, many sequences a step). The weights are the
unsigned operand, laid out so that lane l of a 64-byte vector U_t holds four consecutive weights of row l, which
meet x's values 4t .. 4t + 3:

    Q4_1 x8 qs [G, NB, 4, 64] u8: [g, b, s, 4l + j] = GGUF byte 4s + j of row 16 g + l's block b: weight 4s + j
         (low nibble, U_s) and 16 + 4s + j (high nibble, U_s+4)
    Q8_0 x8 qs [G, NB, 8, 64] u8: [g, b, t, 4l + j] = weight 4t + j of row 16 g + l's block b plus 128 (U_t);
         the 128 x sum(xq) this adds leaves through a second scale, m = -128 d, as Q4_1's m term

Without AVX-512 the Q4_1 x8 layout meets x in AVX2's `vpmaddubsw` (pairs of byte products as int16, summed over
the block in int16, then one `vpmaddwd` by ones: the same integers as vpdpbusd); Q8_0 keeps 16-bit x there (its
bytes plus 128 would saturate the int16 pairs).

A group's weights are one sequential stream, read once per pass; the rows of x go X_ROWS at a time,
sharing the widened weights (a second pass over a group finds them in L1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import by_row_count, c_array, host_has, pmaddubsw_quads, pmaddwd_ones, pmaddwd_pairs, prefetch_ir
from cpu_attn.softmax import fast_exp
from gpu_model import mx
from gpu_model.quant import BLOCK, PREFETCH_BYTES, QuantWeight

WIDE = host_has("avx512vnni", "avx512bw")
"""Whether the integer dots run as AVX512-VNNI's vpdpwssd; else as AVX2's vpmaddwd + vpaddd (is_available)."""
ROWS = 16  # weight rows a group: one per lane
X_ROWS = 8 if WIDE else 6
"""Rows of x each pass over a group's weights takes, their sums in registers beside the widened weights (32 vectors
of 16 lanes with AVX-512, 16 of 8 with AVX2: two per row, beside one part's four; on a 2-core Zen 3, 5 and 6 rows
took 0.75x the time with 6 a pass as with 4, 8 rows the same)."""
_PARTS = ((0, 1, 2, 3), (4, 5, 6, 7))
"""The V_k (and V_k+8) widened at a time with AVX-512: 8 live V_t beside X_ROWS rows' sums (AVX2: one k at a time,
_codegen's looped)."""


MX_KINDS = {"mxfp4": 1, "mxfp6": 3, "mxint8": 6}
"""The MX formats these kernels take, with k: element = I x 2^-k (module docstring)."""


def is_available() -> bool:
    """Whether this CPU has the integer dot products the kernels use (AVX512-VNNI, or AVX2 with FMA and F16C)."""
    return WIDE or host_has("avx2", "fma", "f16c")


def x8_available(kind: str = "q4_1") -> bool:
    """Whether this CPU runs GGUF blocks of `kind` with 8-bit activations: Q4_1 with AVX512-VNNI (vpdpbusd) or AVX2
    (vpmaddubsw), Q8_0 with AVX512-VNNI alone (its unsigned bytes would saturate vpmaddubsw's int16 pairs)."""
    return WIDE or (kind == "q4_1" and is_available())


def mx_available(fmt: str) -> bool:
    """Whether this CPU runs MX format `fmt` here (mxfp6 also needs AVX512-VBMI's byte table lookups)."""
    return fmt in MX_KINDS and is_available() and (fmt != "mxfp6" or (WIDE and host_has("avx512vbmi")))


@dataclass(frozen=True)
class VnniWeight:
    """Q4_1 or Q8_0 blocks (or MX codes) in the layout above, loaded as vectors."""

    kind: str
    """q4_1, q8_0, or an MX_KINDS format."""
    scales: np.ndarray  # [G, NB, 2 | 1, ROWS] float16 bits (uint16) or float32; MX: [G, NB, 1, ROWS] uint8 E8M0
    qs: np.ndarray
    """[G, NB, 8, 32] uint8 (Q4_1, mxfp4), [G, NB, 16, 32] int8 (Q8_0, mxint8), [G, NB, 12, 32] uint8 (mxfp6)."""
    rotation: str = "none"
    """MX: none, or hadamard (the codes hold W H: x is turned per block before it is rounded; mx_weight.py)."""
    x_bits: int = 16
    """Bits x is rounded to: 16, or 8 (Q4_1 or Q8_0 in the x8 layouts, module docstring)."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0] * ROWS, self.qs.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.scales.nbytes + self.qs.nbytes

    @property
    def rotated(self) -> bool:
        return self.rotation == "hadamard"

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def matmul(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
               gated: bool = False) -> torch.Tensor:
        """x @ W.T of x's rounding (vnni_matmul: `norm`, `eps`, `gated` as there)."""
        norm_np = None if norm is None else norm.detach().numpy()
        return torch.from_numpy(vnni_matmul(np.ascontiguousarray(x.numpy()), self, norm_np, eps, gated))

    @staticmethod
    def fits(w: QuantWeight) -> bool:
        return w.shape[0] % ROWS == 0

    @staticmethod
    def from_blocks(w: QuantWeight, x_bits: int = 16) -> "VnniWeight":
        """w in the layout above; x_bits 8 (where x8_available) for 8-bit activations. Q8_0 blocks where this CPU has
        no 8-bit kernel for them (AVX2) keep 16-bit activations: a model's head then rounds x to int16."""
        n, nb = w.scales.shape
        g = n // ROWS
        parts = [w.scales] if w.kind == "q8_0" else [w.scales, w.mins]
        if x_bits == 8 and not x8_available(w.kind):
            if not x8_available():
                raise ValueError("8-bit activations need a CPU with AVX512-VNNI or AVX2")
            x_bits = 16
        if x_bits == 8:
            codes = w.qs if w.kind == "q4_1" else w.qs.view(np.uint8) ^ np.uint8(0x80)  # Q8_0: q + 128, unsigned
            # [N, NB, 4T] -> [G, l, NB, T, j] -> [G, NB, T, l, j]: byte (t, 4l + j) is row l's byte 4t + j
            qs = codes.reshape(g, ROWS, nb, -1, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, -1, 4 * ROWS)
            if w.kind == "q8_0":
                parts = [w.scales, np.float32(-128.0) * w.scales.astype(np.float32)]
        else:
            # [N, NB, 2T] -> [G, l, NB, T, e] -> [G, NB, T, l, e]: byte (t, 2l + e) is row l's byte 2t + e
            qs = w.qs.reshape(g, ROWS, nb, -1, 2).transpose(0, 2, 3, 1, 4).reshape(g, nb, -1, 2 * ROWS)
        scales = np.stack([p.astype(np.float32).reshape(g, ROWS, nb).transpose(0, 2, 1) for p in parts], axis=2)
        half = scales.astype(np.float16)
        if np.array_equal(half.astype(np.float32), scales):  # a GGUF's own scales: float16, read as such (fewer bytes)
            scales = half.view(np.uint16)
        return VnniWeight(w.kind, np.ascontiguousarray(scales), np.ascontiguousarray(qs), x_bits=x_bits)

    @staticmethod
    def from_mx(fmt: str, codes: np.ndarray, scales: np.ndarray, rotation: str = "none") -> VnniWeight | None:
        """An MX weight (mx.py's codes [N, NB, B] and scales [N, NB]) in the layout above; None where these
        kernels cannot give its values: N not a multiple of ROWS, or a scale of 255 (NaN) or of 0 in a block
        with nonzero codes (the kernels build 2^(s - 127) as float32 bits, which has no 2^-127)."""
        n, nb = scales.shape
        if fmt not in MX_KINDS or n % ROWS:
            return None
        values = mx.unpack(codes, mx.get_format(fmt)).astype(np.uint8)  # [N, NB, 32]
        magnitude = values & {"mxint8": 0xFF, "mxfp6": 0x1F, "mxfp4": 0x7}[fmt]
        if (scales == mx.SCALE_NAN).any() or ((scales == 0) & magnitude.any(axis=2)).any():
            return None
        g = n // ROWS

        def vectors(block_bytes: np.ndarray) -> np.ndarray:  # [N, NB, 2T] -> [G, NB, T, 32], as from_blocks
            return block_bytes.reshape(g, ROWS, nb, -1, 2).transpose(0, 2, 3, 1, 4).reshape(g, nb, -1, 2 * ROWS)

        def nibbles(v: np.ndarray, bits: int) -> np.ndarray:  # byte j = v_j | v_{j+16} << bits
            return v[..., :16] | v[..., 16:] << bits

        if fmt == "mxint8":
            qs = vectors(values).view(np.int8)
        else:
            qs = vectors(nibbles(values & 15, 4))
            if fmt == "mxfp6":
                pairs = vectors(nibbles(values >> 4, 2))  # [G, NB, 8, 32]: byte p's two nibbles' top bits
                high = (pairs[..., :16] | pairs[..., 16:] << 4).reshape(g, nb, 4, 2 * ROWS)
                qs = np.concatenate([qs, high], axis=2)
        s = scales.reshape(g, ROWS, nb).transpose(0, 2, 1)[:, :, None, :]
        return VnniWeight(fmt, np.ascontiguousarray(s), np.ascontiguousarray(qs), rotation)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _input_row(x, i, norm, eps, gated, row):
    """row[:] = the matmul's input from x[i]: as is, RMS-normalized and times norm (norm.size > 0: the layer's
    rms_norm), or silu(gate) * up of x[i] = gate | up (gated; exp by softmax.fast_exp, which vectorizes)."""
    width = row.shape[0]
    if gated:
        for j in range(width):
            g = x[i, j]
            row[j] = g / (np.float32(1.0) + fast_exp(min(-g, np.float32(88.0)))) * x[i, width + j]
        return
    for j in range(width):
        row[j] = x[i, j]
    if norm.size:
        ss = np.float32(0.0)
        for j in range(width):
            ss += row[j] * row[j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(width) + np.float32(eps))
        for j in range(width):
            row[j] = norm[j] * (row[j] * inv)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _hadamard_blocks(row):
    """row[:] = row H per block of 32 values, H the orthonormal 32 x 32 Sylvester Hadamard matrix (mx_weight.hadamard):
    five butterfly stages, then 1 / sqrt(32)."""
    inv = np.float32(1.0 / np.sqrt(32.0))
    for base in range(0, row.shape[0], BLOCK):
        h = 1
        while h < BLOCK:
            for j in range(base, base + BLOCK, 2 * h):
                for t in range(j, j + h):
                    a, b = row[t], row[t + h]
                    row[t], row[t + h] = a + b, a - b
            h *= 2
        for t in range(base, base + BLOCK):
            row[t] *= inv


@njit(cache=True, nogil=True)
def round_row(x, i, norm, eps, gated, hadamard, qmax, xq, dx, dsum):
    """Row i of x: [M, K] float32 (or [M, 2K] gate | up) -> the input row (_input_row; turned per block by the Hadamard
    matrix with `hadamard`, for weights stored rotated) rounded per block of 32: xq[i] int16, dx[i] each block's scale
    max |v| / qmax (32767; or 127 for 8-bit activations, whose int8 values fill xq[i]'s first bytes), dsum[i]
    dx * sum(xq) (Q4_1's m term). A block with a non-finite value gets scale NaN."""
    width = xq.shape[1]
    x8 = qmax < 128
    bytes_ = xq.view(np.int8)
    row = np.empty(width, np.float32)
    _input_row(x, i, norm, eps, gated, row)
    if hadamard:
        _hadamard_blocks(row)
    for b in range(width // BLOCK):
        amax = np.float32(0.0)
        for j in range(b * BLOCK, (b + 1) * BLOCK):
            amax = max(amax, abs(row[j]))
        scale = amax / qmax if np.isfinite(amax) else np.float32(np.nan)
        total = np.float32(0.0)
        for j in range(b * BLOCK, (b + 1) * BLOCK):
            v = np.rint(row[j] / scale) if scale > 0 else np.float32(0.0)  # NaN scale: zeros, the NaN is in dx
            if x8:
                bytes_[i, j] = np.int8(v)
            else:
                xq[i, j] = np.int16(v)
            total += v
        dx[i, b] = scale
        dsum[i, b] = scale * total


_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_VF, _VI = ir.VectorType(_F32, ROWS), ir.VectorType(_I32, ROWS)


def _vload(builder, pointer, kind, align=1):
    return builder.load(builder.bitcast(pointer, kind.as_pointer()), align=align)


def _splat(builder, scalar, kind):
    """kind's vector with every lane = scalar."""
    one = builder.insert_element(ir.Constant(kind, ir.Undefined), scalar, _I32(0))
    return builder.shuffle_vector(one, one, ir.Constant(_VI, [0] * ROWS))


def gguf_scale_bytes(signature, scales_arg: int) -> int:
    """Bytes of one GGUF scale in the block kernels' scales argument: 2 (float16 bits, uint16) or 4 (float32)."""
    return 2 if signature.args[scales_arg].dtype == types.uint16 else 4


def gguf_scale_vectors(builder, sa, s_at, nscales: int, item_bytes: int) -> list:
    """LLVM IR: the <16 x float> d (and Q4_1's m) of the block whose scales start at element s_at of sa, stored as
    float32 or as float16 bits (item_bytes 4 or 2; the latter widened, exactly)."""
    at = [builder.gep(sa.data, [builder.add(s_at, _I64(ROWS * k))]) for k in range(nscales)]
    if item_bytes == 4:
        return [_vload(builder, a, _VF, 4) for a in at]
    bits = [_vload(builder, a, ir.VectorType(ir.IntType(16), ROWS), 2) for a in at]
    return [builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), ROWS)), _VF) for v in bits]


def _mx_table(fmt: str) -> list[int]:
    """I = element x 2^k of every code of `fmt` (16 or 64 entries), as bytes (-0 as 0)."""
    values = mx.element_values(mx.get_format(fmt)) * 2 ** MX_KINDS[fmt]
    return [int(v) & 0xFF for v in values]


def _weight_pair(builder, kind: str, qa, q_at, k):
    """LLVM IR: the vectors V_k and V_k+8 of the block at element q_at of qs (module docstring), as <16 x i32>; k an
    i64 value in 0..7 (a constant, or the counter of a loop over a block's parts)."""
    b16, b32, b64 = (ir.VectorType(ir.IntType(8), n) for n in (16, 32, 64))
    w32 = ir.VectorType(ir.IntType(16), 32)
    c32 = lambda v: ir.Constant(b32, [v] * 32)  # noqa: E731

    def at(base: int, per: int):  # element q_at + base + per k of qs
        return builder.gep(qa.data, [builder.add(q_at, builder.add(_I64(base), builder.mul(k, _I64(per))))])

    if kind in ("q8_0", "mxint8"):
        return tuple(builder.bitcast(builder.sext(_vload(builder, at(base, 32), b32), w32), _VI) for base in (0, 256))
    raw = _vload(builder, at(0, 32), b32)
    if kind == "q4_1":
        q = builder.zext(raw, w32)
        return (builder.bitcast(builder.and_(q, ir.Constant(w32, [15] * 32)), _VI),
                builder.bitcast(builder.lshr(q, ir.Constant(w32, [4] * 32)), _VI))
    low, high = builder.and_(raw, c32(15)), builder.lshr(raw, c32(4))
    if kind == "mxfp4":
        table = ir.Constant(b32, _mx_table(kind) * 2)  # pshufb looks up within each 16-byte half
        shuffle = cgutils.get_or_insert_function(builder.module, ir.FunctionType(b32, [b32, b32]),
                                                 "llvm.x86.avx2.pshuf.b")
        ints = [builder.call(shuffle, [table, low]), builder.call(shuffle, [table, high])]
    else:  # mxfp6
        table = ir.Constant(b64, _mx_table(kind))
        lookup = cgutils.get_or_insert_function(builder.module, ir.FunctionType(b64, [b64, b64]),
                                                "llvm.x86.avx512.permvar.qi.512")
        top16 = _vload(builder, at(256, 16), b16)  # byte j: the top bits of bytes j and j + 16
        pairs = builder.and_(builder.shuffle_vector(top16, builder.lshr(top16, ir.Constant(b16, [4] * 16)),
                                                    ir.Constant(ir.VectorType(_I32, 32), list(range(32)))), c32(15))
        low = builder.or_(low, builder.shl(builder.and_(pairs, c32(3)), c32(4)))
        high = builder.or_(high, builder.shl(builder.lshr(pairs, c32(2)), c32(4)))
        both = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
        looked = builder.call(lookup, [table, both])
        ints = [builder.shuffle_vector(looked, looked, ir.Constant(ir.VectorType(_I32, 32), list(range(h, h + 32))))
                for h in (0, 32)]
    return tuple(builder.bitcast(builder.sext(v, w32), _VI) for v in ints)


def _weight_vectors(builder, kind: str, qa, q_at, ks):
    """LLVM IR: the vectors V_k and V_k+8 (k in ks, a part of 0..7) of the block at element q_at of qs, as
    <16 x i32>; the other entries None."""
    vs = [None] * 16
    for k in ks:
        vs[k], vs[k + 8] = _weight_pair(builder, kind, qa, q_at, _I64(k))
    return vs


def _byte_vectors(builder, kind: str, qa, q_at) -> list:
    """LLVM IR: the vectors U_0 .. U_7 of the x8 block (q4_1x8 or q8_0x8) at element q_at of qs (module docstring),
    as <16 x i32> whose lanes hold four unsigned bytes each."""
    b64 = ir.VectorType(ir.IntType(8), 64)
    at = lambda t: builder.gep(qa.data, [builder.add(q_at, _I64(64 * t))])  # noqa: E731
    if kind == "q8_0x8":
        return [builder.bitcast(_vload(builder, at(t), b64), _VI) for t in range(8)]
    vs = [None] * 8
    for s in range(4):
        raw = _vload(builder, at(s), b64)
        vs[s] = builder.bitcast(builder.and_(raw, ir.Constant(b64, [15] * 64)), _VI)
        vs[s + 4] = builder.bitcast(builder.lshr(raw, ir.Constant(b64, [4] * 64)), _VI)
    return vs


_BLOCK_BYTES = {"q4_1": 256, "q4_1x8": 256, "q8_0": 512, "q8_0x8": 512, "mxfp4": 256, "mxfp6": 384, "mxint8": 512}
"""Bytes of qs a block of a group of ROWS rows takes."""


def _codegen(kind: str):
    """LLVM IR of out[i, ROWS g : ROWS (g + 1)] for the one to X_ROWS rows i of x and the weight rows of group g
    (module docstring): per block, the 16 vectors V_t widened once, then per row of x 16 vpdpwssd with its
    pairs of values broadcast (in up to four independent chains), converted, scaled by d x dx and added (plus,
    Q4_1, m x dsum) to the row's sum vector, which is the group's 16 outputs. x8 kinds: the 8 vectors U_t
    of bytes, 8 vpdpbusd a row with its quads of bytes broadcast, and an m term (Q8_0's m = -128 d). MX:
    d = 2^(s - 127) from the E8M0 byte moved into a float's exponent, dx times 2^-k. With AVX2 alone a block's
    dots run as a loop over its parts (looped; looped_x8 for Q4_1 x8, by vpmaddubsw), except one row of 16-bit x."""
    is_mx, x8 = kind in MX_KINDS, kind in ("q4_1x8", "q8_0x8")

    def codegen(context, builder, signature, args):
        item = 1 if is_mx else gguf_scale_bytes(signature, 3)  # bytes of one scale
        xa, da, ma, sa, qa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in range(5))
        out = context.make_array(signature.args[6])(context, builder, args[6])
        group = args[5]
        num_x, width = cgutils.unpack_tuple(builder, xa.shape, 2)
        num_blocks = cgutils.unpack_tuple(builder, da.shape, 2)[1]
        num_out = cgutils.unpack_tuple(builder, out.shape, 2)[1]
        block_bytes = _BLOCK_BYTES[kind]
        nscales = 2 if kind.startswith("q4_1") or x8 else 1  # scale vectors a block
        scale_bytes = ROWS * nscales * item  # of a block in scales
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
        if WIDE:
            name = "llvm.x86.avx512.vpdpbusd.512" if x8 else "llvm.x86.avx512.vpdpwssd.512"
            vpdp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI, [_VI] * 3), name)
            dot = lambda acc, v, x: builder.call(vpdp, [acc, v, x])  # noqa: E731
        else:
            dot = lambda acc, v, x: pmaddwd_pairs(builder, acc, v, x)  # noqa: E731
        first = builder.mul(group, num_blocks)  # the group's first block

        def unrolled(count, b, q_at):
            """Row i's integer dots of the block (partials[i], summed over its chains), every V_t in one go."""
            chains = 2 if WIDE and count <= 4 else 1  # AVX2's chain is of vpaddd alone (latency 1)
            partials = [[ir.Constant(_VI, [0] * ROWS)] * chains for _ in range(count)]
            for ks in ((0, 1, 2, 3),) if x8 else _PARTS:
                vs = _byte_vectors(builder, kind, qa, q_at) if x8 else _weight_vectors(builder, kind, qa, q_at, ks)
                for i in range(count):
                    block_x = builder.add(builder.mul(_I64(i), width), builder.mul(b, _I64(BLOCK)))
                    # x8: row i's int8 values fill the first bytes of its int16s (round_row)
                    x_bytes = builder.add(builder.mul(_I64(2 * i), width), builder.mul(b, _I64(BLOCK)))
                    partial = partials[i]
                    for n, t in enumerate(k + h for h in ((0, 4) if x8 else (0, 8)) for k in ks):
                        if x8:  # x's values 4t .. 4t + 3 as four bytes
                            byte = builder.add(x_bytes, _I64(4 * t))
                            at_x = builder.gep(builder.bitcast(xa.data, ir.IntType(8).as_pointer()), [byte])
                            x = builder.load(builder.bitcast(at_x, _I32.as_pointer()), align=1)
                        else:  # x's values 2t, 2t + 1 as two 16-bit integers
                            at_x = builder.gep(xa.data, [builder.add(block_x, _I64(2 * t))])
                            x = builder.load(builder.bitcast(at_x, _I32.as_pointer()), align=2)
                        partial[n % chains] = dot(partial[n % chains], vs[t], _splat(builder, x, _VI))
            return partials

        def looped(count, b, q_at):
            """As unrolled, for AVX2: a loop over the block's eight parts, each widening V_k and V_k+8 and meeting
            every row of x. Unrolled, LLVM widened all sixteen vectors first and spilled them (16 registers)."""
            planes = cgutils.unpack_tuple(builder, qa.shape, 4)[2]  # a count LLVM cannot fold: the loop stays
            num_parts = planes if kind in ("q4_1", "mxfp4") else builder.lshr(planes, _I64(1))
            at_partial = [cgutils.alloca_once(builder, _VI) for _ in range(count)]
            for acc in at_partial:
                builder.store(ir.Constant(_VI, [0] * ROWS), acc)
            with cgutils.for_range(builder, num_parts) as part:
                k = part.index
                vs = _weight_pair(builder, kind, qa, q_at, k)
                for i in range(count):
                    block_x = builder.add(builder.mul(_I64(i), width), builder.mul(b, _I64(BLOCK)))
                    acc = builder.load(at_partial[i])
                    for v, t in zip(vs, (k, builder.add(k, _I64(8)))):  # x's values 2t, 2t + 1
                        at_x = builder.gep(xa.data, [builder.add(block_x, builder.mul(t, _I64(2)))])
                        x = builder.load(builder.bitcast(at_x, _I32.as_pointer()), align=2)
                        acc = dot(acc, v, _splat(builder, x, _VI))
                    builder.store(acc, at_partial[i])
            return [[builder.load(acc)] for acc in at_partial]

        def looped_x8(count, b, q_at):
            """As unrolled, for Q4_1 x8 on AVX2 (no vpdpbusd): a loop over the block's four 64-byte parts, whose U_s
            and U_s+4 meet each row's quads s and s + 4 in vpmaddubsw (pairs of products as int16); a row's int16
            sums add up over the block (16 products of a nibble and an int8: |sum| <= 16 * 15 * 127 < 2^15) and
            one vpmaddwd by ones gives each lane's dot, as vpdpbusd would."""
            b64, w32 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(ir.IntType(16), 32)
            num_parts = cgutils.unpack_tuple(builder, qa.shape, 4)[2]  # 4, a count LLVM cannot fold: the loop stays
            at_sum = [cgutils.alloca_once(builder, w32) for _ in range(count)]
            for acc in at_sum:
                builder.store(ir.Constant(w32, [0] * 32), acc)
            with cgutils.for_range(builder, num_parts) as part:
                s = part.index
                raw = _vload(builder, builder.gep(qa.data, [builder.add(q_at, builder.mul(s, _I64(64)))]), b64)
                us = builder.and_(raw, ir.Constant(b64, [15] * 64)), builder.lshr(raw, ir.Constant(b64, [4] * 64))
                for i in range(count):
                    x_bytes = builder.add(builder.mul(_I64(2 * i), width), builder.mul(b, _I64(BLOCK)))
                    acc = builder.load(at_sum[i])
                    for u, t in zip(us, (s, builder.add(s, _I64(4)))):  # x's values 4t .. 4t + 3 as four bytes
                        at_x = builder.gep(builder.bitcast(xa.data, ir.IntType(8).as_pointer()),
                                           [builder.add(x_bytes, builder.mul(t, _I64(4)))])
                        x = builder.load(builder.bitcast(at_x, _I32.as_pointer()), align=1)
                        quads = builder.bitcast(_splat(builder, x, _VI), b64)
                        acc = builder.add(acc, pmaddubsw_quads(builder, u, quads))
                    builder.store(acc, at_sum[i])
            return [[pmaddwd_ones(builder, builder.load(acc))] for acc in at_sum]

        def run(count):
            sums = [cgutils.alloca_once(builder, _VF) for _ in range(count)]  # registers
            for acc in sums:
                builder.store(ir.Constant(_VF, [0.0] * ROWS), acc)
            with cgutils.for_range(builder, num_blocks) as loop:
                b = loop.index
                at = builder.add(first, b)
                q_at = builder.mul(at, _I64(block_bytes))
                s_at = builder.mul(at, _I64(ROWS * nscales))  # elements of scales
                for array, offset, size, step in ((qa, q_at, 1, block_bytes), (sa, s_at, item, scale_bytes)):
                    ahead = PREFETCH_BYTES * step // block_bytes  # bytes ahead in this stream: the next groups follow
                    byte = builder.mul(offset, _I64(size))
                    for line in range(0, step, 64):
                        prefetch_ir(builder, array.data, builder.add(byte, _I64(ahead + line)))
                if WIDE or (count == 1 and not x8):
                    partials = unrolled(count, b, q_at)
                else:
                    partials = (looped_x8 if x8 else looped)(count, b, q_at)
                if is_mx:
                    e8m0 = _vload(builder, builder.gep(sa.data, [s_at]), ir.VectorType(ir.IntType(8), ROWS))
                    e8m0 = builder.zext(e8m0, _VI)
                    svec = [builder.bitcast(builder.shl(e8m0, ir.Constant(_VI, [23] * ROWS)), _VF)]
                else:
                    svec = gguf_scale_vectors(builder, sa, s_at, nscales, item)
                for i in range(count):
                    total = partials[i][0]
                    for extra in partials[i][1:]:
                        total = builder.add(total, extra)
                    d_at = builder.add(builder.mul(_I64(i), num_blocks), b)
                    dxi = builder.load(builder.gep(da.data, [d_at]))
                    if is_mx:
                        dxi = builder.fmul(dxi, ir.Constant(_F32, 2.0 ** -MX_KINDS[kind]))
                    acc = builder.call(fma, [builder.sitofp(total, _VF), builder.fmul(svec[0], _splat(builder, dxi, _VF)),
                                             builder.load(sums[i])])
                    if nscales == 2:
                        dsi = builder.load(builder.gep(ma.data, [d_at]))
                        acc = builder.call(fma, [svec[1], _splat(builder, dsi, _VF), acc])
                    builder.store(acc, sums[i])
            for i, acc in enumerate(sums):
                at = builder.add(builder.mul(_I64(i), num_out), builder.mul(group, _I64(ROWS)))
                ptr = builder.bitcast(builder.gep(out.data, [at]), _VF.as_pointer())
                builder.store(builder.load(acc), ptr, align=4)

        by_row_count(builder, num_x, X_ROWS, run)
        return context.get_dummy_value()
    return codegen


def block_arrays(scales, qs) -> bool:
    """Typing check of the block kernels' weights: scales float32 or float16 bits (uint16; GGUF) or uint8 (MX E8M0),
    qs uint8 or int8, each [G, NB, planes, ROWS | 32] C-contiguous."""
    return ((c_array(scales, 4, types.float32) or c_array(scales, 4, types.uint16) or c_array(scales, 4, types.uint8))
            and (c_array(qs, 4, types.uint8) or c_array(qs, 4, types.int8)))


def kind_codegen(make, scales, qs, qs_arg: int):
    """make(kind)'s codegen for the weights' kind told from the array types (block_arrays): float32 scales with
    Q4_1 (qs uint8) or Q8_0 (int8); uint8 scales with mxint8 (qs int8), or mxfp4 / mxfp6 (qs uint8), told apart at
    run time by the planes of qs (the intrinsic's argument qs_arg: 8 or 12; mxfp4 alone where mx_available says
    this CPU runs no mxfp6)."""
    u8 = c_array(qs, 4, types.uint8)
    if not c_array(scales, 4, types.uint8):
        return make("q4_1" if u8 else "q8_0")
    if not u8:
        return make("mxint8")
    if not mx_available("mxfp6"):  # its byte table lookups need AVX-512; no mxfp6 weight is laid out here
        return make("mxfp4")

    def mx_bytes(context, builder, signature, args):
        qa = context.make_array(signature.args[qs_arg])(context, builder, args[qs_arg])
        planes = cgutils.unpack_tuple(builder, qa.shape, 4)[2]
        with builder.if_else(builder.icmp_signed("==", planes, _I64(12))) as (fp6, fp4):
            with fp6:
                make("mxfp6")(context, builder, signature, args)
            with fp4:
                make("mxfp4")(context, builder, signature, args)
        return context.get_dummy_value()
    return mx_bytes


@intrinsic
def _rows(typingctx, xq, dx, dsum, scales, qs, group, out):
    """out[i, ROWS group : ROWS (group + 1)] for the one to X_ROWS rows of xq (_codegen); the kind from the arrays'
    types (kind_codegen)."""
    checks = (c_array(xq, 2, types.int16), c_array(dx, 2, types.float32), c_array(dsum, 2, types.float32),
              block_arrays(scales, qs), isinstance(group, types.Integer), c_array(out, 2, types.float32))
    if not all(checks):
        return None
    codegen = kind_codegen(_codegen, scales, qs, 4)
    if x8_available() and not c_array(scales, 4, types.uint8) and c_array(qs, 4, types.uint8):
        codegen = _either_layout(codegen)
    return types.none(xq, dx, dsum, scales, qs, group, out), codegen


def _either_layout(int16_codegen):
    """The codegen for unsigned GGUF codes in any layout, told apart at run time by the shape of qs: 64 bytes wide,
    x8 (4 planes Q4_1, 8 planes Q8_0, the latter where x8_available says so); else Q4_1 for int16 x."""
    def either(context, builder, signature, args):
        qa = context.make_array(signature.args[4])(context, builder, args[4])
        _, _, planes, width = cgutils.unpack_tuple(builder, qa.shape, 4)
        with builder.if_else(builder.icmp_signed("==", width, _I64(4 * ROWS))) as (x8, x16):
            with x8:
                if not x8_available("q8_0"):  # no Q8_0 weight is laid out for 8-bit x here
                    _codegen("q4_1x8")(context, builder, signature, args)
                else:
                    with builder.if_else(builder.icmp_signed("==", planes, _I64(4))) as (q4, q8):
                        with q4:
                            _codegen("q4_1x8")(context, builder, signature, args)
                        with q8:
                            _codegen("q8_0x8")(context, builder, signature, args)
            with x16:
                int16_codegen(context, builder, signature, args)
        return context.get_dummy_value()
    return either


@njit(cache=True, nogil=True, inline="always")
def is_x8(qs) -> bool:
    """Whether qs holds GGUF codes in an x8 layout (8-bit activations)."""
    return qs.shape[3] == 4 * ROWS


@njit(cache=True, nogil=True, inline="always")
def matvec_rounded(xq, dx, dsum, scales, qs, out):
    """out = x @ W.T for x rounded into xq, dx, dsum (round_row): a group of ROWS weight rows at a time in parallel
    (in the parallel function this is inlined into), the rows of x X_ROWS at a time."""
    for g in prange(qs.shape[0]):
        for i in range(0, xq.shape[0], X_ROWS):
            _rows(xq[i:i + X_ROWS], dx[i:i + X_ROWS], dsum[i:i + X_ROWS], scales, qs, g, out[i:i + X_ROWS])


@njit(cache=True, nogil=True, inline="always")
def matvec(x, norm, eps, gated, hadamard, scales, qs, out):
    """out = (x, normed or gated, and turned, as round_row says) @ W.T."""
    num_blocks = qs.shape[1]
    qmax = np.float32(127.0) if is_x8(qs) else np.float32(32767.0)
    xq = np.empty((x.shape[0], num_blocks * BLOCK), np.int16)
    dx = np.empty((x.shape[0], num_blocks), np.float32)
    dsum = np.empty((x.shape[0], num_blocks), np.float32)
    if hadamard and x.shape[0] > 1:  # the butterfly is scalar: rows in parallel
        for i in prange(x.shape[0]):
            round_row(x, i, norm, eps, gated, hadamard, qmax, xq, dx, dsum)
    else:  # a few rows (vectorized, the gate's exp too) cost less than a parallel region
        for i in range(x.shape[0]):
            round_row(x, i, norm, eps, gated, hadamard, qmax, xq, dx, dsum)
    matvec_rounded(xq, dx, dsum, scales, qs, out)


@njit(cache=True, nogil=True, parallel=True)
def _matvec(x, norm, eps, gated, hadamard, scales, qs, out):
    matvec(x, norm, eps, gated, hadamard, scales, qs, out)


NO_NORM = np.empty(0, np.float32)


def vnni_matmul(x: np.ndarray, w: VnniWeight, norm: np.ndarray | None = None, eps: float = 0.0,
                gated: bool = False) -> np.ndarray:
    """x: [M, K] float32 -> x @ W.T: [M, N] float32, x rounded to int16 per block (module docstring). With
    `norm`, x is first RMS-normalized and scaled by it (rms_norm with `eps`); with `gated`, x is [M, 2K]
    gate | up and the input is silu(gate) * up."""
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _matvec(x, NO_NORM if norm is None else norm, eps, gated, w.rotated, w.scales, w.qs, out)
    return out
