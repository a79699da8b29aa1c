"""The keys' centers: a pre-RoPE mean taken out of the stored keys (OakenKVStore) and added back
in the score domain, turned to each key's position."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.kernels import block_scores
from cpu_attn.llvm_ir import _F32, _I16, _I32, _I64, _llvm_fn, c_array, f32_matrices, fmuladd8, matrix_args, splat
from cpu_attn.oaken.codes import CODE_MAX, INT16, _dpwssd, _query_codes, _trap
from cpu_attn.oaken.turn import _TURN_ROWS, turn_rows


@intrinsic
def _add_turned_rows(typingctx, rows, width, c, cos_b, sin_b, cos_o, sin_o, blk, off0):
    """rows[t] += c[0] * [cos(p), cos(p)] + c[1] * [sin(p), sin(p)] for t < width, at the positions
    p = blk * bs + off0 + t of one block, each angle put together from the block start's (cos_b,
    sin_b [> blk, D / 2]) and the offset's (cos_o, sin_o [bs, D / 2]): cos(a + b) = cos a cos b -
    sin a sin b, sin(a + b) = sin a cos b + cos a sin b. rows [>= width, D], c [2, D], all float32
    C arrays, D a multiple of 16 (OakenKVStore's head_dim is one of 64).

    In LLVM IR because Numba's loop, vectorized, ran its aliasing checks and loop set-up again for
    every 64-value row: here each 8-wide chunk of c is turned to the block start once (the terms
    that multiply cos b and sin b of the offset) and the rows stream past it, two FMAs a value."""
    if not f32_matrices(rows, c, cos_b, sin_b, cos_o, sin_o) or \
            not all(isinstance(x, types.Integer) for x in (width, blk, off0)):
        return None

    def codegen(context, builder, signature, args):
        f32, i64 = _F32, _I64
        vec = ir.VectorType(f32, 8)
        fmuladd = fmuladd8(builder)
        base, row_bytes, shapes = matrix_args(context, builder, signature, args, (0, 2, 3, 4, 5, 6))
        half = builder.lshr(shapes[0][1], i64(1))
        width, blk, off0 = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 7, 8))

        def load(array, row, at):
            address = builder.add(builder.add(base[array], builder.mul(row, row_bytes[array])), at)
            return builder.load(builder.inttoptr(address, vec.as_pointer()), align=4)

        with cgutils.for_range_slice(builder, i64(0), half, i64(8)) as (i, _):
            lo, hi = builder.shl(i, i64(2)), builder.shl(builder.add(i, half), i64(2))
            c0, c1 = [load(1, i64(0), at) for at in (lo, hi)], [load(1, i64(1), at) for at in (lo, hi)]
            cb, sb = load(2, blk, lo), load(3, blk, lo)
            # c0 cos(a + b) + c1 sin(a + b) = cos b (c0 cos a + c1 sin a) + sin b (c1 cos a - c0 sin a)
            on_cos = [builder.call(fmuladd, [c0[j], cb, builder.fmul(c1[j], sb)]) for j in range(2)]
            on_sin = [builder.call(fmuladd, [c1[j], cb, builder.fneg(builder.fmul(c0[j], sb))]) for j in range(2)]
            with cgutils.for_range(builder, width) as t:
                off = builder.add(off0, t.index)
                co, so = load(4, off, lo), load(5, off, lo)
                row = builder.add(base[0], builder.mul(t.index, row_bytes[0]))
                for j, at in enumerate((lo, hi)):
                    ptr = builder.inttoptr(builder.add(row, at), vec.as_pointer())
                    x = builder.call(fmuladd, [on_sin[j], so, builder.load(ptr, align=4)])
                    builder.store(builder.call(fmuladd, [on_cos[j], co, x]), ptr, align=4)
        return context.get_dummy_value()
    return types.none(rows, width, c, cos_b, sin_b, cos_o, sin_o, blk, off0), codegen


@njit(cache=True, nogil=True, inline="always")
def add_key_center(rows, pos0, width, center, kvh):
    """rows[t] += the key center of kv-head kvh turned to position pos0 + t, for t < width, rows
    that lie in one store block (pos0 // bs == (pos0 + width - 1) // bs): c * cos + rotate_half(c)
    * sin (RoPE's rotate-half layout). center = (c [Hkv, 2, D] holding c and rotate_half(c) in
    the store's key space, then cos and sin at the block starts [> pos0 / bs, D / 2] and at the
    offsets in a block [bs, D / 2]); a no-op when the tables are empty (no centering). A table
    with a row per position is 16x larger, and every (sequence, kv-head) of the exact kernel
    streamed it from L3: a fifth of that kernel's time at 16 x 8k."""
    c, cos_b, sin_b, cos_o, sin_o = center
    if cos_b.shape[0]:
        bs = cos_o.shape[0]
        _add_turned_rows(rows, width, c[kvh], cos_b, sin_b, cos_o, sin_o, pos0 // bs, pos0 % bs)


@njit(cache=True, nogil=True, inline="always")
def turn_center_terms(qc, center, j, qcb):
    """qcb [group, D] = the center terms qc (A, B) turned to block j's start (see add_center_scores)."""
    cos_b, sin_b = center[0], center[1]
    half = qcb.shape[1] // 2
    for g in range(qcb.shape[0]):
        for i in range(half):
            a, b, c, t = qc[g, i], qc[g, half + i], cos_b[j, i], sin_b[j, i]
            qcb[g, i] = a * c + b * t
            qcb[g, half + i] = b * c - a * t


@njit(cache=True, nogil=True)
def center_terms(q, center, out):
    """q [B, Hq, D] in store space -> out [B, Hq, D]: per query the terms A (first half) and B of
    q . R(p) c = sum_i A_i cos(w_i p) + B_i sin(w_i p), c the key center of its kv-head (center [Hkv, 2, D]
    holds c and rotate_half(c)): A_i = q_i c_i + q_i+D/2 c_i+D/2, B_i the same with rotate_half(c)."""
    half, group = q.shape[2] // 2, q.shape[1] // center.shape[0]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            c = center[h // group]
            for i in range(half):
                x, y = q[b, h, i], q[b, h, half + i]
                out[b, h, i] = x * c[0, i] + y * c[0, half + i]
                out[b, h, half + i] = x * c[1, i] + y * c[1, half + i]


@njit(cache=True, nogil=True)
def decode_queries(q, key_scales, rotation, key_center, queries):
    """One decode step's queries as oaken_decode_attention takes them (records.DecodeQueries,
    written), in one call (the same steps as OakenKVStore's _store_queries and _rotate,
    center_terms and query_codes, which cost more as separate NumPy and Numba calls): q [B, Hq,
    D] -> turned = q * key_scales (store space, key_scales [Hkv, D]) times the rotation [D, D]
    (none when empty); center = the center terms of the unturned store-space q (center_terms
    against key_center [Hkv, 2, D]; skipped when center is empty, keys not centered); codes,
    code_scales = query_codes(turned) (skipped when codes is empty)."""
    turned, center, codes, scales = queries
    num_seqs, num_heads, dim = q.shape
    group = num_heads // key_scales.shape[0]
    for b in range(num_seqs):
        for h in range(num_heads):
            for d in range(dim):
                turned[b, h, d] = q[b, h, d] * key_scales[h // group, d]
    if center.shape[0]:
        center_terms(turned, key_center, center)
    rows = turned.reshape(num_seqs * num_heads, dim)
    turn_rows(rows, rows.shape[0], rotation, np.empty((_TURN_ROWS, dim), np.float32))
    if codes.shape[0]:
        _query_codes(rows, codes.reshape(rows.shape), scales.reshape(rows.shape[0]))


@njit(cache=True, nogil=True)
def decode_outputs(out, unrotation, value_scales):
    """decode_queries's counterpart, in place: out [B, Hq, D] over the store's values -> over the
    true values (turned back by unrotation, none when empty, then times value_scales [Hkv, D])."""
    num_seqs, num_heads, dim = out.shape
    rows = out.reshape(num_seqs * num_heads, dim)
    turn_rows(rows, rows.shape[0], unrotation, np.empty((_TURN_ROWS, dim), np.float32))
    group = num_heads // value_scales.shape[0]
    for b in range(num_seqs):
        for h in range(num_heads):
            for d in range(dim):
                out[b, h, d] *= value_scales[h // group, d]


@njit(cache=True, nogil=True, inline="always")
def add_center_scores(s, qc, center, j, width, scale, qcb, sc):
    """s[g, t] += scale * (q_g . the key center turned to position j * bs + t), for the rows t <
    width of block j, in the score domain: the store's keys stay as decoded (they may be rotated,
    their center is not). qc [group, D] holds, for each query, the terms A (first half) and B
    (second) of q . R(p) c = sum_i A_i cos(w_i p) + B_i sin(w_i p) (center_terms, decode_queries);
    center = (cos_b, sin_b [> j, D / 2] at the block starts, cs [bs, D] = [cos | sin] at the
    offsets in a block, then the same as vnni_center_scores's pairs). Turning A and B to the block
    start once makes the rest one dot product per row against the fixed table cs, as q . k is
    (block_scores). Scratch qcb [group, D], sc [group, bs]."""
    turn_center_terms(qc, center, j, qcb)
    block_scores(qcb, center[2], width, scale, sc)
    for g in range(qcb.shape[0]):
        for t in range(width):
            s[g, t] += sc[g, t]


@njit(cache=True, nogil=True, inline="always")
def add_row_center_scores(s, qc, pos_cos, pos_sin, pos, width, scale):
    """add_center_scores for rows at any positions: s[g, t] += scale * (q_g . the key center turned to position
    pos[t]) for t < width, from the center terms qc [group, D] (A, then B) and the tables pos_cos, pos_sin
    [> max(pos), D / 2] (ScoreCenter.row_pos: a layered cache's compacted rows)."""
    half = qc.shape[1] // 2
    for t in range(width):
        c, sn = pos_cos[pos[t]], pos_sin[pos[t]]
        for g in range(qc.shape[0]):
            acc = np.float32(0.0)
            for i in range(half):
                acc += qc[g, i] * c[i] + qc[g, half + i] * sn[i]
            s[g, t] += scale * acc


@njit(cache=True, nogil=True, inline="always")
def center_scales(qc, scale, inv, factor):
    """For center_codes, per query: inv = CODE_MAX / r, r the largest |(A_i, B_i)| of its center terms
    qc [group, D] (no turn changes it), and factor = scale * r / CODE_MAX^2 (the offsets' codes are
    multiples of 1 / CODE_MAX): once per task of the exact kernel, for all its query heads."""
    half = qc.shape[1] // 2
    for g in range(qc.shape[0]):
        r = np.float32(1e-30)
        for i in range(half):
            r = max(r, np.sqrt(qc[g, i] * qc[g, i] + qc[g, half + i] * qc[g, half + i]))
        inv[g] = np.float32(CODE_MAX) / r
        factor[g] = scale * r / (np.float32(CODE_MAX) * np.float32(CODE_MAX))


@njit(cache=True, nogil=True, inline="always")
def center_codes(qc, center, j, inv, abq):
    """add_center_scores's A and B turned to block j's start (turn_center_terms), as
    vnni_center_scores takes them: abq [group, D] int16, multiples of 1 / inv (center_scales)."""
    _center_codes(abq, qc, center[0], center[1], j, inv)


@njit(cache=True, nogil=True, inline="always")
def center_codes_at(qc, pos_cos, pos_sin, p, inv, abq):
    """center_codes for a block whose rows sit at consecutive positions p, p + 1, ... (a layered cache's rows
    that kept their order, ScoreCenter.row_pos): the terms turned to position p by the tables pos_cos, pos_sin
    [> p, D / 2], for vnni_center_scores, whose offsets then count from p."""
    _center_codes(abq, qc, pos_cos, pos_sin, p, inv)


@njit(cache=True, nogil=True, inline="always")
def consecutive_from(row_pos, width):
    """row_pos [Hkv, bs] of one block: the position of its row 0 when every kv-head's rows 0..width-1 sit at
    consecutive positions from the same one, else -1."""
    p = row_pos[0, 0]
    for h in range(row_pos.shape[0]):
        for t in range(width):
            if row_pos[h, t] != p + t:
                return -1
    return p


@intrinsic
def _center_codes(typingctx, abq, qc, cos_b, sin_b, j, inv):
    """center_codes in LLVM IR, sixteen channels at a time: A c + B s and B c - A s, rounded to the
    nearest int16 code (x * inv, ties to even), 32 channels' codes joined by one shuffle (D / 2 a
    multiple of 32). Numba's loops stayed scalar: ~35 ns a block (3 x 64)."""
    if not (c_array(abq, 2, types.int16) and f32_matrices(qc, cos_b, sin_b) and c_array(inv, 1, types.float32)
            and isinstance(j, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        f32, i16, i32, i64 = _F32, _I16, _I32, _I64
        floats = ir.VectorType(f32, 16)
        sig = signature.args
        arrays = [context.make_array(sig[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 5)]
        out_base, q_base, cos_base, sin_base = (builder.ptrtoint(a.data, i64) for a in arrays[:4])
        groups, dim = cgutils.unpack_tuple(builder, arrays[0].shape, 2)
        half = builder.lshr(dim, i64(1))
        row = builder.mul(context.cast(builder, args[4], sig[4], types.intp), builder.shl(half, i64(2)))
        rint = _llvm_fn(builder, "llvm.rint.v16f32", floats, [floats])
        at = lambda base, k: builder.inttoptr(builder.add(base, k), floats.as_pointer())
        words = ir.VectorType(i16, 32)
        low_words = ir.Constant(ir.VectorType(i32, 32), list(range(0, 64, 2)))
        with cgutils.for_range(builder, groups) as g:
            q_row = builder.add(q_base, builder.mul(g.index, builder.shl(dim, i64(2))))
            out_row = builder.add(out_base, builder.mul(g.index, builder.shl(dim, i64(1))))
            f = splat(builder, builder.load(builder.gep(arrays[4].data, [g.index])), 16)
            with cgutils.for_range_slice(builder, i64(0), half, i64(32)) as (i, _):  # 32 channels of A and of B
                turned = ([], [])
                for first in (i, builder.add(i, i64(16))):
                    k = builder.shl(first, i64(2))
                    a, b = (builder.load(at(q_row, x), align=4) for x in (k, builder.add(k, builder.shl(half, i64(2)))))
                    c, t = (builder.load(at(base, builder.add(row, k)), align=4) for base in (cos_base, sin_base))
                    for x, to in zip((builder.fadd(builder.fmul(a, c), builder.fmul(b, t)),
                                      builder.fsub(builder.fmul(b, c), builder.fmul(a, t))), turned):
                        codes = builder.fptosi(builder.call(rint, [builder.fmul(x, f)]), ir.VectorType(i32, 16))
                        to.append(builder.bitcast(codes, words))
                for x, to in zip(turned, (i, builder.add(i, half))):  # two vectors' codes joined by one shuffle
                    builder.store(builder.shuffle_vector(x[0], x[1], low_words),
                                  builder.inttoptr(builder.add(out_row, builder.shl(to, i64(1))), words.as_pointer()), align=2)
        return context.get_dummy_value()
    return types.none(abq, qc, cos_b, sin_b, j, inv), codegen


_CENTER_PAIRS = 4  # channel pairs vnni_center_scores sums in integers before adding them as floats (< 2^31)
_CENTER_QUERIES = 3  # query heads vnni_center_scores takes at once: each pair's 16 rows loaded once for them


@intrinsic
def vnni_center_scores(typingctx, s, abq, factor, pairs):
    """s[g, t] += factor[g] * sum_i abq[g, i] * offsets[t, i] for the 16 rows of a block: the keys'
    centers in the score domain (add_center_scores) in int16 dot products. pairs [D / 2, 32] int16:
    for each two channels, the 16 rows' codes of both side by side (OakenKVStore._offset_pairs), so
    one vpdpwssd against the query's two codes, broadcast, adds both channels to every row's lane.
    Three query heads at a time share each pair's row load (one head at a time: ~133 ns a block of
    9 heads, bound by two loads a vpdpwssd). Without VNNI each vpdpwssd is two AVX2 vpmaddwd (_dpwssd).
    s [G, 16] float32, abq [G, D] int16, factor [G]."""
    if not (c_array(s, 2, types.float32) and c_array(abq, 2, types.int16) and c_array(factor, 1, types.float32)
            and c_array(pairs, 2, types.int16)):
        return None

    def codegen(context, builder, signature, args):
        f32, i32, i64 = _F32, _I32, _I64
        vec = ir.VectorType(i32, 16)
        if not INT16:
            return _trap(context, builder)
        sig = signature.args
        arrays = [context.make_array(sig[i])(context, builder, args[i]) for i in range(4)]
        base = [builder.ptrtoint(a.data, i64) for a in arrays]
        groups, dim = cgutils.unpack_tuple(builder, arrays[1].shape, 2)
        s_row, q_row = (cgutils.unpack_tuple(builder, arrays[i].strides, 2)[0] for i in (0, 1))
        floats = ir.VectorType(f32, 16)
        totals = cgutils.alloca_once(builder, floats, _CENTER_QUERIES)

        def heads_from(h0, count):  # query heads h0 .. h0 + count - 1, each pair's rows loaded once for all
            q_at = [builder.add(base[1], builder.mul(builder.add(h0, i64(c)), q_row)) for c in range(count)]
            slots = [builder.gep(totals, [i32(c)]) for c in range(count)]
            for slot in slots:
                builder.store(ir.Constant(floats, [0.0] * 16), slot)
            with cgutils.for_range_slice(builder, i64(0), builder.lshr(dim, i64(1)), i64(_CENTER_PAIRS)) as (p, _):
                rows = [builder.load(builder.inttoptr(builder.add(base[3], builder.shl(builder.add(p, i64(k)), i64(6))),
                                                      vec.as_pointer()), align=2) for k in range(_CENTER_PAIRS)]
                for at, slot in zip(q_at, slots):
                    acc = ir.Constant(vec, [0] * 16)
                    for k in range(_CENTER_PAIRS):
                        both = builder.load(builder.inttoptr(builder.add(at, builder.shl(builder.add(p, i64(k)), i64(2))),
                                                             i32.as_pointer()), align=2)
                        acc = _dpwssd(builder, acc, rows[k], splat(builder, both, 16))
                    builder.store(builder.fadd(builder.load(slot), builder.sitofp(acc, floats)), slot)
            for c, slot in enumerate(slots):
                h = builder.add(h0, i64(c))
                out = builder.inttoptr(builder.add(base[0], builder.mul(h, s_row)), floats.as_pointer())
                f = splat(builder, builder.load(builder.gep(arrays[2].data, [h])), 16)
                builder.store(builder.fadd(builder.load(out, align=4), builder.fmul(builder.load(slot), f)), out, align=4)
        whole = builder.udiv(groups, i64(_CENTER_QUERIES))
        with cgutils.for_range(builder, whole) as chunk:
            heads_from(builder.mul(chunk.index, i64(_CENTER_QUERIES)), _CENTER_QUERIES)
        with cgutils.for_range_slice(builder, builder.mul(whole, i64(_CENTER_QUERIES)), groups, i64(1)) as (h, _):
            heads_from(h, 1)
        return context.get_dummy_value()
    return types.none(s, abq, factor, pairs), codegen
