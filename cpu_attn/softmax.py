"""The online softmax of the decode kernels: each work item's running max m, sum l and
unnormalized output, moved on block by block, and the states of a context's parts joined."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import _as_f32, _llvm_fn, c_array, f32_matrices, splat


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


@njit(cache=True, nogil=True, inline="always")
def attend_begin(acc, m, l):
    acc[:] = 0.0
    m[:] = -np.inf
    l[:] = 0.0


_STALE_MAX = np.float32(8.0)


"""How far a block's scores may rise over the running max m before attend_scores moves m (and
rescales the output and sum). Most blocks do not move it, and rescaling per head and block (a scalar
exp, then acc *= correction) was a third of the softmax's time; weights up to e^8 are safe in float32."""


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
