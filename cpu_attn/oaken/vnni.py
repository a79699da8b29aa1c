"""A full quantized block's scores (q . k) and weighted values (p . v) in AVX-512 int16 dot
products (vpdpwssd) on the store's codes: no row is decoded to floats."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import _F32, _I1, _I16, _I32, _I64, _I8, lane_sums, splat
from cpu_attn.oaken.codec import SEGMENT
from cpu_attn.oaken.codes import (ROWS, VNNI, _dpwssd, _RowCodes, _scores_args, _scores_setup, _trap, _weighted_args,
                                  _weighted_setup)


@intrinsic
def vnni_block_scores(typingctx, s, qi, qscale, dense, scales, counts, sparse, thr, scale, acc):
    """s[h, t] = scale * q_h . k_t for the 16 rows of one full, quantized block, every query head h
    against its kv-head's keys, in integer dot products on the store's codes: no row is decoded to floats.

    The rows as _RowCodes writes them; the queries as int16 multiples of their own scale (qi,
    qscale: query_codes). Rows go in pairs, side by side in each vector: 16 channels of one row in
    lanes 0..15 and the same 16 of the other in 16..31, so that one vpermw looks up both rows'
    levels (from a table of both rows' 16), one vpdpwssd against the query's 16 codes, broadcast to
    both halves, adds both rows' products, and a lane of the sums holds one row. The sparse entries
    (up to 16 a row and segment, the pair's in one vector) add (true code - level code) times the
    query's codes at their indices, gathered from registers (vpermi2w) once for both rows, with one
    more vpdpwssd: the level's product comes out, the true value's goes in. A row's levels and
    scalars serve all its kv-heads. Exact in int32: a lane sums four level products and two
    entries' (|delta| <= 2 * CODE_MAX), < 8 * CODE_MAX^2 < 2^31, the other four level products
    apart. Each pair's sums go to acc [Hq, 16, 16] (8 vectors a head); a shuffle tree of three
    rounds sums each row's 8 lanes, and they are scaled by the rows' units (one row a pass, the
    sums took a 4-round tree and each entry gather was done twice). Both roundings are to
    1 / 16383 of the row's or the query's largest value (scores within ~2e-4 of the largest one,
    tests/test_kv_formats.py).

    s [Hq, 16], qi [Hq, D] int16, qscale [Hq], dense [16, C/2], scales [16, 3] (fp16 bits), counts
    [16, C/64], sparse [budget] (the block's), thr [4]; D a multiple of 64, Hq a multiple of C/D.
    Needs AVX512-BW and -VNNI (VNNI); compiled elsewhere it traps, and the kernel never calls it there."""
    if not _scores_args(s, qi, qscale, dense, scales, counts, sparse, thr, acc):
        return None

    def codegen(context, builder, signature, args):
        f32, i16, i32, i64 = _F32, _I16, _I32, _I64
        vec = ir.VectorType
        if not VNNI:
            return _trap(context, builder)
        arrays, base, heads, dim, (segs_per_head, kv_heads, group), s_row, scale = _scores_setup(
            context, builder, signature, args)
        rc = _RowCodes(builder, *(arrays[i] for i in (3, 4, 5, 6, 7)))
        q_row = builder.shl(dim, i64(1))

        def partials_at(h, p):  # query head h's sums of rows 2p, 2p + 1 (8 lanes each) in acc [Hq, 16, 16]
            return rc.at(builder.add(base[9], builder.shl(builder.add(builder.mul(h, i64(ROWS)), p), i64(6))),
                         vec(f32, 16))

        def dot(x, y, acc=None):
            x, y = (builder.bitcast(v, vec(i32, 16)) for v in (x, y))
            return _dpwssd(builder, acc or rc.full(i32, 0), x, y)

        def both(x, y):  # two <n x T> side by side
            n = x.type.count
            return builder.shuffle_vector(x, y, ir.Constant(vec(i32, 2 * n), list(range(2 * n))))

        def load(address, kind, align):
            return builder.load(rc.at(address, kind), align=align)

        def words(n):
            return rc.full(i16, n, 32)

        i8 = _I8
        upper = ir.Constant(vec(i16, 32), [0] * 16 + [16] * 16)  # the second row's lanes: its half of a pair's table
        in_second = ir.Constant(vec(_I1, 32), [False] * 16 + [True] * 16)
        low16 = rc.fn("llvm.masked.load.v16i8.p0", vec(i8, 16), [i8.as_pointer(), i32, vec(_I1, 16), vec(i8, 16)])
        starts = [cgutils.alloca_once(builder, i64) for _ in (0, 1)]  # each row's next entry
        rc.first_row()
        with cgutils.for_range(builder, i64(ROWS // 2)) as pair_loop:
            p = pair_loop.index
            ts = [builder.add(builder.shl(p, i64(1)), i64(r)) for r in (0, 1)]
            for t, at in zip(ts, starts):
                rc.walk(t, at)
            rows = [rc.row(t, at) for t, at in zip(ts, starts)]
            tables = [rc.entry_table(row, True) for row in rows]
            levels = builder.shuffle_vector(rows[0][0], rows[1][0],  # both rows' 16 levels
                                            ir.Constant(vec(i32, 32), list(range(16)) + list(range(32, 48))))

            def lanes_of(n):  # the lanes of a row's first `n` (i64) entries, at most 16, as an i16 mask
                n = builder.trunc(builder.select(builder.icmp_signed("<", n, i64(16)), n, i64(16)), i32)
                return builder.trunc(builder.sub(builder.shl(i32(1), n), i32(1)), _I16)

            def entries(at, nibbles):
                """Entries of the pair's rows, lanes 0..15 the first's and 16..31 the second's (`at`: each
                row's address and i16 lane mask) -> (true - level codes, their indices), <32 x i16> each."""
                masks = [builder.bitcast(m, vec(_I1, 16)) for _, m in at]
                e = both(*(builder.call(low16, [rc.at(a, i8), i32(1), m, rc.full(i8, 0, 16)])
                           for (a, _), m in zip(at, masks)))
                e = builder.zext(e, vec(i16, 32))
                j = builder.and_(e, words(63))
                # the nibble of (row, j): lane j & 15 of the row's half, in the vector of channel j's sixteen
                where = builder.or_(builder.and_(j, words(15)), builder.shl(builder.and_(j, words(16)), words(1)))
                where = builder.or_(where, upper)
                first, second = (builder.call(rc.perm2w, [nibbles[k], where, nibbles[k + 1]]) for k in (0, 2))
                key = rc.entry_key(e, builder.select(builder.icmp_unsigned("!=", builder.and_(j, words(32)), words(0)),
                                                     second, first))
                delta = builder.select(in_second, builder.call(rc.perm2w, [tables[1][0], key, tables[1][1]]),
                                       builder.call(rc.perm2w, [tables[0][0], key, tables[0][1]]))
                return builder.select(builder.bitcast(both(*masks), vec(_I1, 32)), delta, words(0)), j

            with cgutils.for_range(builder, kv_heads) as kvh, cgutils.for_range(builder, segs_per_head) as seg_loop:
                local = seg_loop.index
                seg = builder.add(builder.mul(kvh.index, segs_per_head), local)
                head0 = builder.mul(kvh.index, group)  # the kv-head's first query head
                q_seg = builder.add(base[1], builder.shl(local, i64(7)))

                def query(g):  # query head0 + g: its address and 64 codes in two vectors
                    h = builder.add(head0, g)
                    q_at = builder.add(q_seg, builder.mul(h, q_row))
                    return h, q_at, [load(builder.add(q_at, i64(64 * k)), vec(i16, 32), 2) for k in (0, 1)]
                # the rows' nibbles side by side: bytes 0..15, then 16..31, of each row's segment
                at = builder.shl(seg, i64(5))
                halves = [builder.zext(both(*(load(builder.add(row[4], builder.add(at, i64(off))), vec(i8, 16), 1)
                                              for row in rows)), vec(i16, 32)) for off in (0, 16)]
                nibbles = [builder.and_(halves[0], words(15)), builder.and_(halves[1], words(15)),
                           builder.lshr(halves[0], words(4)), builder.lshr(halves[1], words(4))]
                codes = [builder.call(rc.permw, [levels, builder.or_(x, upper)]) for x in nibbles]  # channels 16k..
                ns = [builder.zext(load(builder.add(row[3], seg), i8, 1), i64) for row in rows]
                at = [builder.add(rc.sparse, builder.load(e)) for e in starts]
                delta, jj = entries([(a, lanes_of(n)) for a, n in zip(at, ns)], nibbles)
                first = builder.icmp_unsigned("==", local, i64(0))
                with cgutils.for_range(builder, group) as g:
                    h, q_at, (q0, q1) = query(g.index)
                    # channels 16k..16k+15 of the query in both halves (a 256-bit broadcast load)
                    chunks = [load(builder.add(q_at, i64(32 * k)), vec(i16, 16), 2) for k in range(4)]
                    chunks = [both(x, x) for x in chunks]
                    # two integer sums: a lane adds 8 level products and 2 entries', past 2^31 in one
                    part0 = dot(codes[1], chunks[1], dot(codes[0], chunks[0]))
                    part1 = dot(codes[3], chunks[3], dot(codes[2], chunks[2]))
                    part1 = dot(delta, builder.call(rc.perm2w, [q0, jj, q1]), part1)
                    total = builder.fadd(builder.sitofp(part0, vec(f32, 16)), builder.sitofp(part1, vec(f32, 16)))
                    out = partials_at(h, p)
                    earlier = builder.select(first, rc.full(f32, 0.0), builder.load(out, align=4))
                    builder.store(builder.fadd(total, earlier), out, align=4)
                none = ir.Constant(_I16, 0)
                for r in (0, 1):  # a segment with more than 16 entries in a row: the rest in passes of 16, in its half
                    with cgutils.for_range_slice(builder, i64(16), ns[r], i64(16)) as (k, _):
                        rest = (builder.add(at[r], k), lanes_of(builder.sub(ns[r], k)))
                        delta, jj = entries([rest, (rest[0], none)] if r == 0 else [(rest[0], none), rest], nibbles)
                        with cgutils.for_range(builder, group) as g:
                            h, _, (q0, q1) = query(g.index)
                            total = builder.sitofp(dot(delta, builder.call(rc.perm2w, [q0, jj, q1])), vec(f32, 16))
                            out = partials_at(h, p)
                            builder.store(builder.fadd(total, builder.load(out, align=4)), out, align=4)
                for e, n in zip(starts, ns):
                    builder.store(builder.add(builder.load(e), n), e)
        # lane k of the pair sums: row 2k (k < 8) or 2(k - 8) + 1; to rows in order
        order = ir.Constant(vec(i32, 16), [t // 2 + 8 * (t % 2) for t in range(ROWS)])
        with cgutils.for_range(builder, heads) as g:
            pairs = [builder.load(partials_at(g.index, i64(p)), align=4) for p in range(ROWS // 2)]
            sums = lane_sums(builder, pairs)  # lane k + 8 g: group g (row 2k + g) of pair k
            sums = builder.shuffle_vector(sums, sums, order)
            factor = builder.fmul(scale, builder.load(builder.gep(arrays[2].data, [g.index])))
            scores = builder.fmul(builder.fmul(sums, rc.unit), rc.lanes(factor))
            builder.store(scores, rc.at(builder.add(base[0], builder.mul(g.index, s_row)), vec(f32, 16)), align=4)
        return context.get_dummy_value()
    return types.none(s, qi, qscale, dense, scales, counts, sparse, thr, scale, acc), codegen


MAX_HEADS = 256
"""The most query heads vnni_add_weighted_rows takes (its weight codes live in a fixed buffer)."""
WEIGHT_MAX = 8191
"""|weight code| bound of vnni_add_weighted_rows: a product with a value code is < 2^27; the eight a lane gets from
four row pairs stay < 2^30, and each four pairs' sums are added as floats."""


@intrinsic
def vnni_add_weighted_rows(typingctx, acc, w, dense, scales, counts, sparse, thr):
    """acc[h] += sum_t w[h, t] * v_t over the 16 rows of one full, quantized block, every query head
    h over its kv-head's values (the p.v of attend_scores), in integer dot products on the store's
    codes: no row is decoded to floats.

    Each row is built in registers as _RowCodes's int16 codes: its nibbles look up its levels
    (vpermw), and its sparse values, in index order as the quantizer writes them, are put in their
    lanes by masked expands (vpexpandw) whose mask has a bit at each entry's index. Each
    query's weights times the rows' units are rounded to int16 multiples of their largest value /
    WEIGHT_MAX; two rows' codes interleaved channel by channel make vpdpwssd add w_t v_t + w_t+1
    v_t+1 into each channel's lane. A row's levels, computed for its first segment, are kept for the
    others. acc [Hq, D], w [Hq, 16] float32, Hq <= MAX_HEADS; the rest as vnni_block_scores."""
    if not _weighted_args(acc, w, dense, scales, counts, sparse, thr):
        return None

    def codegen(context, builder, signature, args):
        f32, i1, i16, i32, i64 = _F32, _I1, _I16, _I32, _I64
        vec = ir.VectorType
        if not VNNI:
            return _trap(context, builder)
        arrays, heads, (segs_per_head, kv_heads, group), (acc_base, acc_row), (w_base, w_row) = \
            _weighted_setup(context, builder, signature, args)
        rc = _RowCodes(builder, *(arrays[i] for i in (2, 3, 4, 5, 6)))
        expand = rc.fn("llvm.x86.avx512.mask.expand.v32i16", vec(i16, 32), [vec(i16, 32), vec(i16, 32), vec(i1, 32)])
        any_bits = rc.fn("llvm.vector.reduce.or.v16i64", i64, [vec(i64, 16)])
        popcount = rc.fn("llvm.ctpop.i64", i64, [i64])
        interleaved = cgutils.alloca_once(builder, ir.ArrayType(vec(i32, 16), 2 * ROWS))  # row pairs x 4 vectors
        iota = ir.Constant(vec(i16, 32), list(range(32)))
        code = [cgutils.alloca_once(builder, vec(i16, 32)) for _ in (0, 1)]
        one, zero64 = rc.full(i64, 1), rc.full(i64, 0)
        # two rows' codes interleaved within each 128-bit lane (vpunpcklwd / vpunpckhwd, one uop each; a
        # channel-ordered interleave was a vpermt2w, three): vector k of half h holds channel 32 h + 8 L + 4 k + i
        # in lane 4 L + i; `natural` puts each half's two vectors back in channel order, once a head and segment
        channels = [ir.Constant(vec(i32, 32), [x for lane in range(4) for i in range(4 * k, 4 * k + 4)
                                               for x in (8 * lane + i, 32 + 8 * lane + i)]) for k in (0, 1)]
        natural = [ir.Constant(vec(i32, 16), [4 * (2 * m + j // 8) + j % 8 % 4 + 16 * (j % 8 // 4) for j in range(16)])
                   for m in (0, 1)]
        starts = cgutils.alloca_once(builder, i64, ROWS)  # each row's next entry: walked once, moved on by segment
        # every query head's weights as codes first (independent chains: computed where each head's
        # dots wait on them, their max, division and rounding stalled the dots, ~11 % of the kernel)
        pair_codes, units = _weight_codes(builder, rc, heads, w_base, w_row)
        levels = cgutils.alloca_once(builder, ir.ArrayType(vec(i16, 32), ROWS))
        tables = cgutils.alloca_once(builder, ir.ArrayType(vec(i16, 32), 2 * ROWS))  # each row's entry_table
        rc.first_row()
        with cgutils.for_range(builder, kv_heads) as kvh, cgutils.for_range(builder, segs_per_head) as seg_loop:
            local = seg_loop.index
            seg = builder.add(builder.mul(kvh.index, segs_per_head), local)
            head0 = builder.mul(kvh.index, group)  # the kv-head's first query head
            first = builder.icmp_unsigned("==", seg, i64(0))
            with cgutils.for_range(builder, i64(ROWS // 2)) as pair_loop:
                p = pair_loop.index
                for t in (0, 1):  # rows 2p and 2p + 1
                    row_index = builder.add(builder.shl(p, i64(1)), i64(t))
                    start_at = builder.gep(starts, [row_index])
                    with builder.if_then(first):  # rows in order, once
                        rc.walk(row_index, start_at)
                    row = rc.row(row_index, start_at, levels, first)
                    slots = [builder.gep(tables, [i32(0), builder.add(builder.shl(row_index, i64(1)), i64(h))])
                             for h in (0, 1)]
                    with builder.if_then(first):
                        for slot, half in zip(slots, rc.entry_table(row, False)):
                            builder.store(half, slot)
                    table = [builder.load(slot) for slot in slots]
                    low, high, code0, code1, n = rc.segment(row, seg)
                    builder.store(code0, code[0])
                    builder.store(code1, code[1])
                    start = builder.add(rc.sparse, builder.load(row[1]))
                    with cgutils.for_range_slice(builder, i64(0), n, i64(16)) as (k, _):
                        mask, j, values = rc.entries(builder.add(start, k), builder.sub(n, k), low, high, table)
                        bit = builder.shl(one, builder.zext(builder.shuffle_vector(j, j, rc.first16), vec(i64, 16)))
                        bits = builder.call(any_bits, [builder.select(builder.shuffle_vector(mask, mask, rc.first16), bit, zero64)])
                        # from registers; a vpexpandw from the values just stored to memory took a row ~72
                        # cycles instead of ~63 (one kv-head, 3 queries, blocks in cache)
                        past = builder.trunc(builder.call(popcount, [builder.and_(bits, i64(0xFFFFFFFF))]), i16)
                        later = builder.call(rc.permw, [values, builder.add(iota, splat(builder, past, 32))])
                        for h, (x, part) in enumerate(((values, bits), (later, builder.lshr(bits, i64(32))))):
                            lanes = builder.bitcast(builder.trunc(part, i32), vec(i1, 32))
                            builder.store(builder.call(expand, [x, builder.load(code[h]), lanes]), code[h])
                    builder.store(builder.add(builder.load(row[1]), n), row[1])
                    current = [builder.load(c) for c in code]
                    if t:
                        for h in (0, 1):
                            for k, lanes in enumerate(channels):
                                pair = builder.shuffle_vector(earlier[h], current[h], lanes)
                                at = builder.add(builder.shl(p, i64(2)), i64(2 * h + k))
                                slot = builder.gep(interleaved, [i32(0), at])
                                builder.store(builder.bitcast(pair, vec(i32, 16)), slot)
                    earlier = current
            with cgutils.for_range(builder, group) as g:
                h = builder.add(head0, g.index)
                # each row pair's two codes broadcast from memory (a load); from a register, each is a vpermd
                # on the shuffle port. The address goes through an empty asm block, or LLVM forwards the store.
                at = builder.asm(ir.FunctionType(i64, [i64]), "", "=r,0",
                                 [builder.ptrtoint(builder.gep(pair_codes, [h]), i64)], False)
                sums = [None] * 4
                for pairs in (range(ROWS // 4), range(ROWS // 4, ROWS // 2)):  # two integer sums: no overflow
                    part = [rc.full(i32, 0)] * 4
                    for p in pairs:
                        both = splat(builder, builder.load(rc.at(builder.add(at, i64(4 * p)), i32), align=4), 16)
                        for k in range(4):
                            x = builder.load(builder.gep(interleaved, [i32(0), i32(4 * p + k)]))
                            part[k] = _dpwssd(builder, part[k], x, both)
                    part = [builder.sitofp(x, vec(f32, 16)) for x in part]
                    sums = part if sums[0] is None else [builder.fadd(x, y) for x, y in zip(sums, part)]
                unit = rc.lanes(builder.load(builder.gep(units, [h])))
                row_at = builder.add(acc_base, builder.mul(h, acc_row))
                sums = [builder.shuffle_vector(sums[k - k % 2], sums[k - k % 2 + 1], natural[k % 2]) for k in range(4)]
                for k in range(4):
                    out = rc.at(builder.add(row_at, builder.shl(builder.add(builder.mul(local, i64(SEGMENT)), i64(16 * k)),
                                                                i64(2))), vec(f32, 16))
                    total = builder.fadd(builder.load(out, align=4), builder.fmul(sums[k], unit))
                    builder.store(total, out, align=4)
        return context.get_dummy_value()
    return types.none(acc, w, dense, scales, counts, sparse, thr), codegen


def _weight_codes(builder, rc, heads, w_base, w_row):
    """LLVM IR: each query head's 16 weights (rows of w at w_base, w_row bytes apart) times the
    rows' units, as int16 codes of their largest value / WEIGHT_MAX -> (codes [MAX_HEADS] <8 x i32>,
    each row pair's two codes a dword; units [MAX_HEADS] float32, a code's value). In fixed buffers
    in the entry block (the IR lands in the caller's loop, where a sized alloca grew the stack every call)."""
    f32, i32 = _F32, _I32
    vec = ir.VectorType
    pair_codes = cgutils.alloca_once(builder, vec(i32, 8), size=MAX_HEADS)
    units = cgutils.alloca_once(builder, f32, size=MAX_HEADS)
    with cgutils.for_range(builder, heads) as h:
        weights = builder.load(rc.at(builder.add(w_base, builder.mul(h.index, w_row)), vec(f32, 16)), align=4)
        weights = builder.fmul(weights, rc.unit)
        top = weights
        for span in (8, 4, 2, 1):
            turned = ir.Constant(vec(i32, 16), [(i + span) % 16 for i in range(16)])
            top = rc.vmax(top, builder.shuffle_vector(top, top, turned))
        top = rc.vmax(builder.extract_element(top, i32(0)), f32(1e-30))
        codes = rc.to_codes(builder.fmul(weights, rc.lanes(builder.fdiv(f32(float(WEIGHT_MAX)), top))))
        builder.store(builder.bitcast(codes, vec(i32, 8)), builder.gep(pair_codes, [h.index]))
        builder.store(builder.fmul(top, f32(1.0 / WEIGHT_MAX)), builder.gep(units, [h.index]))
    return pair_codes, units
