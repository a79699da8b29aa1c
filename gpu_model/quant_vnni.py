"""GGUF Q4_1 / Q8_0 weights multiplied with integer dot products (AVX512-VNNI), for decode steps.

The float kernels of gpu_model/quant.py decode every weight to float32 (~10 vector operations a
block of 32): at one row of x they are bound by the CPU, not by memory. Here each row of x is
first rounded to int16 per block of 32 (scale dx = max |x| / 32767, round half to even: a relative
error of 2^-16, where llama.cpp's int8 costs this model 1 % perplexity), and the weights' small
integers meet it in `vpdpwssd` (32 products of 16-bit integers summed pairwise into 16 int32 lanes):
about 4.5 vector operations a block. The result is the exact dot product of the rounded x with the
weights (integers exact; the scales applied in float32):

    out[i, n] = sum_b  d[n, b] * dx[i, b] * (xq[i, b] . q[n, b])  +  m[n, b] * dx[i, b] * sum(xq[i, b])

(Q8_0 has no m term.) Layout: the kernels dot ROWS weight rows at a time (they share x's loads and
give the FMAs independent sums), so a group of ROWS rows is stored interleaved, pair by pair: the
kernel reads one sequential stream, which the hardware prefetcher follows (four rows of a few cache
lines each, read side by side, are four short streams it does not). Per weight row n = ROWS g + r and
pair p of blocks (2p, 2p + 1), 64 weights in W order, two vectors of 32 16-bit values whose int32 lane
l (values 2l, 2l + 1) belongs to block 2p + l % 2, so that the pair's scales, loaded as
(d[2p], d[2p + 1]) and broadcast, line up with the lanes:

    W position u = 32 half + t:  block 2p + (t // 2) % 2,  weight 16 half + 2 (t // 4) + t % 2
    Q4_1 qs [G, P, ROWS, 32] u8: byte t holds W position t (low nibble) and 32 + t (high nibble)
    Q8_0 qs [G, P, ROWS, 64] i8: W itself
    scales [G, P, ROWS, 4] f32: d[2p], d[2p + 1], m[2p], m[2p + 1]  (Q8_0: [G, P, ROWS, 2], d only)

x is rounded into the same order (`round_x`), so lanes multiply matching values.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import by_row_count, c_array, host_has, prefetch_ir
from gpu_model.quant import BLOCK, PREFETCH_BYTES, QuantWeight, lane_total

PAIR = 2 * BLOCK
ROWS = 4  # weight rows each kernel call dots at once: they share x's loads and give the FMAs independent sums
X_ROWS = 4  # rows of x each kernel call dots with them: they share the weights' loads and widening


def w_order() -> tuple[np.ndarray, np.ndarray]:
    """For each of a pair's 64 W positions: (block within the pair, weight index within the block)."""
    u = np.arange(PAIR)
    half, t = u // 32, u % 32
    return (t // 2) % 2, 16 * half + 2 * (t // 4) + t % 2


def is_available() -> bool:
    """Whether this CPU has the integer dot products the kernels use (AVX512-VNNI)."""
    return host_has("avx512vnni", "avx512bw")


@dataclass(frozen=True)
class VnniWeight:
    """Q4_1 or Q8_0 blocks in the layout above, scales (and Q4_1's mins) in float32, which the kernels
    broadcast straight from memory (float16 would take three more vector operations a pair)."""

    kind: str
    scales: np.ndarray  # [G, P, ROWS, 4 | 2] float32
    qs: np.ndarray  # [G, P, ROWS, 32] uint8 (Q4_1) or [G, P, ROWS, 64] int8 (Q8_0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0] * ROWS, self.qs.shape[1] * PAIR

    @property
    def nbytes(self) -> int:
        return self.scales.nbytes + self.qs.nbytes

    def matmul(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
               gated: bool = False) -> torch.Tensor:
        """x @ W.T of x's rounding (vnni_matmul: `norm`, `eps`, `gated` as there)."""
        norm_np = None if norm is None else norm.detach().numpy()
        return torch.from_numpy(vnni_matmul(np.ascontiguousarray(x.numpy()), self, norm_np, eps, gated))

    @staticmethod
    def fits(w: QuantWeight) -> bool:
        return w.shape[0] % ROWS == 0 and w.shape[1] % PAIR == 0

    @staticmethod
    def from_blocks(w: QuantWeight) -> "VnniWeight":
        n, nb = w.scales.shape
        assert nb % 2 == 0, "the kernels read blocks in pairs"
        blk, idx = w_order()
        if w.kind == "q4_1":  # byte t: the GGUF byte holding weight idx[t] (low nibble) and idx[t] + 16 (high)
            qs = w.qs.reshape(n, nb // 2, 2, 16)[:, :, blk[:32], idx[:32]]
            scales = np.concatenate([w.scales.reshape(n, -1, 2), w.mins.reshape(n, -1, 2)], axis=-1)
        else:
            qs = w.qs.reshape(n, nb // 2, 2, BLOCK)[:, :, blk, idx]
            scales = w.scales.reshape(n, -1, 2)

        def grouped(a: np.ndarray) -> np.ndarray:  # [N, P, c] -> [G, P, ROWS, c]
            return np.ascontiguousarray(a.reshape(n // ROWS, ROWS, nb // 2, -1).swapaxes(1, 2))

        return VnniWeight(w.kind, grouped(scales.astype(np.float32)), grouped(qs))


@njit(cache=True, nogil=True, fastmath={"contract"})
def _input_row(x, i, norm, eps, gated, row):
    """row[:] = the matmul's input from x[i]: as is, RMS-normalized and times norm (norm.size > 0: the layer's
    rms_norm), or silu(gate) * up of x[i] = gate | up (gated)."""
    width = row.shape[0]
    if gated:
        for j in range(width):
            g = x[i, j]
            row[j] = g / (np.float32(1.0) + np.exp(-g)) * x[i, width + j]
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


@njit(cache=True, nogil=True)
def round_x(x, norm, eps, gated, src, xq, dx):
    """x: [M, K] float32 (or [M, 2K] gate | up) -> the input row (_input_row) rounded per pair p of blocks:
    xq[i, p] (64 int16 in W order: W position u is input value 64 p + src[u]); dx[i, p, :16] each lane's
    block's scale max |v| / 32767, dx[i, p, 16:] the pair's two blocks' dx * sum(xq) then zeros (Q4_1's
    m term). A block with a non-finite value gets scale NaN."""
    width = xq.shape[1] * PAIR
    row = np.empty(width, np.float32)
    q = np.empty(width, np.int16)
    dx[:, :, 16:] = 0.0
    for i in range(x.shape[0]):
        _input_row(x, i, norm, eps, gated, row)
        for b in range(width // BLOCK):
            amax = np.float32(0.0)
            for j in range(b * BLOCK, (b + 1) * BLOCK):
                amax = max(amax, abs(row[j]))
            scale = amax / np.float32(32767.0) if np.isfinite(amax) else np.float32(np.nan)
            total = np.float32(0.0)
            for j in range(b * BLOCK, (b + 1) * BLOCK):
                v = np.rint(row[j] / scale) if scale > 0 else np.float32(0.0)  # NaN scale: zeros, the NaN is in dx
                q[j] = np.int16(v)
                total += v
            dx[i, b // 2, 16 + b % 2] = scale * total
            for lane in range(b % 2, 16, 2):
                dx[i, b // 2, lane] = scale
        for p in range(xq.shape[1]):
            for u in range(PAIR):
                xq[i, p, u] = q[PAIR * p + src[u]]


_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_VF, _VI = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16)


def _vload(builder, pointer, kind, align=1):
    return builder.load(builder.bitcast(pointer, kind.as_pointer()), align=align)


def _codegen(q4_1: bool):
    """LLVM IR of out[i, ROWS g + r] for the one to X_ROWS rows i of x and the ROWS weight rows of group g (formula
    in the module docstring): per pair of blocks, each weight row's 64 weights are widened to 16 bits once
    (Q4_1: two nibbles) and meet each row of x in two multiply-adds of 16-bit pairs; the int32 lanes go to
    float32 and into a vector sum per (weight row, row of x), scaled by the pair's d x dx (plus, Q4_1,
    m x dx * sum(xq) in lanes 0 and 1)."""
    def codegen(context, builder, signature, args):
        xa, da, sa, qa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in range(4))
        out = context.make_array(signature.args[5])(context, builder, args[5])
        group = args[4]
        num_x, num_pairs, _ = cgutils.unpack_tuple(builder, xa.shape, 3)
        num_rows = builder.mul(cgutils.unpack_tuple(builder, qa.shape, 4)[0], _I64(ROWS))
        qbytes, nscales = (32, 4) if q4_1 else (64, 2)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI, [_VI] * 3),
                                             "llvm.x86.avx512.vpdpwssd.512")
        rows = [builder.add(builder.mul(group, _I64(ROWS)), _I64(r)) for r in range(ROWS)]
        first = builder.mul(group, num_pairs)  # the group's first pair

        def at_pair(r, p, width):  # offset of row r's pair p in [G, P, ROWS, width]
            return builder.mul(builder.add(builder.mul(builder.add(first, p), _I64(ROWS)), _I64(r)), _I64(width))
        b32, w32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 32)
        pmadd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI, [w32, w32]), "llvm.x86.avx512.pmaddw.d.512")

        def weights(r, p):  # the pair's 64 weights as two vectors of 32 16-bit values
            at = at_pair(r, p, qbytes)
            if q4_1:  # widen the bytes once, then take the nibbles
                q = builder.zext(_vload(builder, builder.gep(qa.data, [at]), b32), w32)
                halves = (builder.and_(q, ir.Constant(w32, [15] * 32)), builder.lshr(q, ir.Constant(w32, [4] * 32)))
                return [builder.bitcast(h, _VI) for h in halves]
            return [builder.bitcast(builder.sext(_vload(builder, builder.gep(qa.data, [builder.add(at, _I64(32 * h))]), b32),
                                                 w32), _VI) for h in (0, 1)]

        def pair_scales(r, p):  # (d[2p], d[2p + 1]) and (m[2p], m[2p + 1]) repeated over the 16 lanes
            at = at_pair(r, p, nscales)
            two = ir.VectorType(_F32, 2)
            pairs = [_vload(builder, builder.gep(sa.data, [builder.add(at, _I64(k))]), two, 4) for k in range(0, nscales, 2)]
            return [builder.shuffle_vector(v, v, ir.Constant(_VI, [0, 1] * 8)) for v in pairs]

        def run(count):
            sums = {(r, i): cgutils.alloca_once(builder, _VF) for r in range(ROWS) for i in range(count)}  # registers
            for acc in sums.values():
                builder.store(ir.Constant(_VF, [0.0] * 16), acc)
            with cgutils.for_range(builder, num_pairs) as loop:
                p = loop.index
                for array, width in ((qa, qbytes), (sa, 4 * nscales)):  # PREFETCH_BYTES ahead: the next groups follow
                    ahead = builder.add(at_pair(0, p, width), _I64(PREFETCH_BYTES * width // qbytes))  # bytes
                    for line in range(0, ROWS * width, 64):
                        prefetch_ir(builder, array.data, builder.add(ahead, _I64(line)))
                pair_at = [builder.add(builder.mul(_I64(i), num_pairs), p) for i in range(count)]
                xs_ = [[_vload(builder, builder.gep(xa.data, [builder.add(builder.mul(at, _I64(PAIR)), _I64(32 * h))]), _VI)
                        for h in (0, 1)] for at in pair_at]
                dxs = [[_vload(builder, builder.gep(da.data, [builder.add(builder.mul(at, _I64(32)), _I64(16 * h))]), _VF, 4)
                        for h in (0, 1)] for at in pair_at]
                for r in range(ROWS):
                    w, dm = weights(r, p), pair_scales(r, p)
                    for i in range(count):
                        t = builder.call(pmadd, [builder.bitcast(w[0], w32), builder.bitcast(xs_[i][0], w32)])
                        products = builder.sitofp(builder.call(dot, [t, w[1], xs_[i][1]]), _VF)
                        acc = sums[r, i]
                        total = builder.call(fma, [products, builder.fmul(dm[0], dxs[i][0]), builder.load(acc)])
                        if q4_1:
                            total = builder.call(fma, [dm[1], dxs[i][1], total])
                        builder.store(total, acc)
            for (r, i), acc in sums.items():
                at = builder.add(builder.mul(_I64(i), num_rows), rows[r])
                builder.store(lane_total(builder, builder.load(acc)), builder.gep(out.data, [at]))

        by_row_count(builder, num_x, X_ROWS, run)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _rows(typingctx, xq, dx, scales, qs, group, out):
    """out[i, ROWS group + r] for the one to X_ROWS rows of xq (_codegen); Q4_1 weights (qs uint8) or Q8_0 (int8)."""
    q4_1 = c_array(qs, 4, types.uint8)
    checks = (c_array(xq, 3, types.int16), c_array(dx, 3, types.float32), c_array(scales, 4, types.float32),
              q4_1 or c_array(qs, 4, types.int8), isinstance(group, types.Integer), c_array(out, 2, types.float32))
    if not all(checks):
        return None
    return types.none(xq, dx, scales, qs, group, out), _codegen(q4_1)


@njit(cache=True, nogil=True, inline="always")
def matvec_rounded(xq, dx, scales, qs, out):
    """out = x @ W.T for x rounded into xq, dx (round_x): a group of ROWS weight rows at a time in parallel (in
    the parallel function this is inlined into), the rows of x X_ROWS at a time (one pass over a group's weights
    for four rows of x took 0.64 ms a layer against 0.80 for two passes of two, one thread of a Xeon with
    AVX512-VNNI; eight rows 0.98 against 1.48)."""
    for g in prange(qs.shape[0]):
        for i in range(0, xq.shape[0], X_ROWS):
            _rows(xq[i:i + X_ROWS], dx[i:i + X_ROWS], scales, qs, g, out[i:i + X_ROWS])


@njit(cache=True, nogil=True, inline="always")
def matvec(x, norm, eps, gated, src, scales, qs, out):
    """out = (x, normed or gated as round_x says) @ W.T."""
    num_pairs = qs.shape[1]
    xq = np.empty((x.shape[0], num_pairs, PAIR), np.int16)
    dx = np.empty((x.shape[0], num_pairs, 32), np.float32)
    round_x(x, norm, eps, gated, src, xq, dx)
    matvec_rounded(xq, dx, scales, qs, out)


@njit(cache=True, nogil=True, parallel=True)
def _matvec(x, norm, eps, gated, src, scales, qs, out):
    matvec(x, norm, eps, gated, src, scales, qs, out)


SRC = (BLOCK * w_order()[0] + w_order()[1]).astype(np.int64)
"""round_x's src: the input value of each W position within a pair."""
NO_NORM = np.empty(0, np.float32)


def vnni_matmul(x: np.ndarray, w: VnniWeight, norm: np.ndarray | None = None, eps: float = 0.0,
                gated: bool = False) -> np.ndarray:
    """x: [M, K] float32 -> x @ W.T: [M, N] float32, x rounded to int16 per block (module docstring). With
    `norm`, x is first RMS-normalized and scaled by it (rms_norm with `eps`); with `gated`, x is [M, 2K]
    gate | up and the input is silu(gate) * up."""
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _matvec(x, NO_NORM if norm is None else norm, eps, gated, SRC, w.scales, w.qs, out)
    return out
