"""vnni.py's two kernels with AVX2 (vpshufb level tables, vpmaddwd), for CPUs without AVX-512."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import _F32, _I16, _I32, _I64, _I8, lane_sums, splat
from cpu_attn.oaken.codec import SEGMENT
from cpu_attn.oaken.codes import (AVX2, ROWS, _pmaddwd, _RowCodes, _scores_args, _scores_setup, _trap, _weighted_args,
                                  _weighted_setup)
from cpu_attn.oaken.vnni import _weight_codes

_FIXED_ENTRIES = 8  # entries of a segment _Avx2Rows.codes takes without a branch (past its count, to a sink)


class _Avx2Rows:
    """LLVM IR shared by avx2_block_scores and avx2_add_weighted_rows: one full block's rows as
    _RowCodes's int16 codes, built with AVX2 (no vpermw or vpexpandw). Each row's 16 level codes
    are split into their low and high bytes, two 16-byte tables that vpshufb looks the nibbles up in;
    the two bytes of each value, interleaved (vpunpck[lh]bw), are its code. A segment's 32 bytes of
    nibbles are first put in the order [0..7, 16..23 | 8..15, 24..31] (one vpermq), so that the codes
    come out in channel order, 16 a vector. The sparse entries write (true - level) codes into a
    zeroed buffer of the segment's 64 channels, one scalar store each (the first eight without a
    branch: those past the count go to a sink), and the four vectors of it are added to the codes:
    the row's true codes, exact. On a Zen 1 the entries are about half of each kernel's time (keys
    ~48 ns a kv-head's row, ~21 without them); neither store forwarding (their stores made a block
    ahead) nor their nibbles' loads (from a byte buffer) changed that (bench_oaken_rows)."""

    def __init__(self, builder, dense, scales, counts, sparse, thr):
        i8, i16, i64 = _I8, _I16, _I64
        vec = ir.VectorType
        self.builder = b = builder
        self.rc = rc = _RowCodes(builder, dense, scales, counts, sparse, thr)
        self.pshufb = rc.fn("llvm.x86.avx2.pshuf.b", vec(i8, 32), [vec(i8, 32)] * 2)
        self.bytes = cgutils.alloca_once(b, ir.ArrayType(vec(i8, 32), 2 * ROWS))  # each row's low, high byte tables
        self.deltas = cgutils.alloca_once(b, ir.ArrayType(vec(i16, 64), ROWS))  # each row's entry_table, less levels
        self.starts = cgutils.alloca_once(b, i64, ROWS)  # each row's next entry: moved on segment by segment
        # a segment's (true - level) codes, zero elsewhere; past the channels, the sink. Zeroed once, in the
        # function's entry block (alloca_once): every codes() zeroes the channels it read again
        self.patch = cgutils.alloca_once(b, vec(i16, 2 * SEGMENT))
        twice = ir.Constant(vec(_I32, 32), list(range(16)) * 2)
        rc.first_row()
        with cgutils.for_range(b, i64(ROWS)) as loop:
            t = loop.index
            start = b.gep(self.starts, [t])
            rc.walk(t, start)
            row = rc.row(t, start)
            levels = b.shuffle_vector(row[0], row[0], twice)  # <32 x i16>: the 16 codes twice
            for k, x in enumerate((levels, b.lshr(levels, rc.full(i16, 8, 32)))):
                b.store(b.trunc(x, vec(i8, 32)), b.gep(self.bytes, [_I32(0), b.add(b.shl(t, i64(1)), i64(k))]))
            low, high = rc.entry_table(row, True)
            b.store(b.shuffle_vector(low, high, ir.Constant(vec(_I32, 64), list(range(64)))),
                    b.gep(self.deltas, [_I32(0), t]))

    def codes(self, t, seg):
        """Row t's true codes of segment seg (t, seg: i64; a row's segments in order) -> four <16 x i16>,
        channels 0..15, 16..31, 32..47, 48..63."""
        i8, i16, i32, i64 = _I8, _I16, _I32, _I64
        b, rc = self.builder, self.rc
        vec = ir.VectorType
        row_at = b.add(b.add(rc.dense, b.mul(t, rc.dense_row)), b.shl(seg, i64(5)))
        raw = b.load(rc.at(row_at, vec(i64, 4)), align=1)
        x = b.bitcast(b.shuffle_vector(raw, raw, ir.Constant(vec(i32, 4), [0, 2, 1, 3])), vec(i8, 32))
        fifteen = rc.full(i8, 15, 32)
        tables = [b.load(b.gep(self.bytes, [i32(0), b.add(b.shl(t, i64(1)), i64(k))])) for k in (0, 1)]
        unpack = [ir.Constant(vec(i32, 32), [x for lane in (0, 16) for i in range(first, first + 8)
                                             for x in (lane + i, 32 + lane + i)]) for first in (0, 8)]
        words = []
        for nibbles in (b.and_(x, fifteen), b.and_(b.lshr(x, rc.full(i8, 4, 32)), fifteen)):
            low, high = (b.call(self.pshufb, [table, nibbles]) for table in tables)
            words += [b.bitcast(b.shuffle_vector(low, high, mask), vec(i16, 16)) for mask in unpack]
        # the entries, one scalar store each into the patch (branch-free per entry)
        start_at = b.gep(self.starts, [t])
        first = b.load(start_at)
        n = b.zext(b.load(rc.at(b.add(b.add(rc.counts, b.mul(t, rc.counts_row)), seg), i8)), i64)
        deltas = b.bitcast(b.gep(self.deltas, [i32(0), t]), i16.as_pointer())
        patch = b.bitcast(self.patch, i16.as_pointer())

        def entry(k, e, sink=False):  # entry k (e: i64) of the segment: its (true - level) code into the patch
            j = b.and_(e, i64(63))
            if sink:  # past the segment's count: to a slot past the channels (64)
                j = b.select(b.icmp_unsigned("<", k, n), j, i64(SEGMENT))
            byte = b.zext(b.load(rc.at(b.add(row_at, b.and_(j, i64(31))), i8)), i64)  # value j's nibble, as stored
            nibble = b.and_(b.lshr(byte, b.shl(b.lshr(j, i64(5)), i64(2))), i64(15))
            key = b.or_(nibble, b.and_(b.lshr(e, i64(2)), i64(48)))  # entry_key's
            b.store(b.load(b.gep(deltas, [key])), b.gep(patch, [j]))
        for k in range(0, _FIXED_ENTRIES, 8):  # eight entries a load (the slack: OakenKVStore.sparse)
            eight = b.load(rc.at(b.add(rc.sparse, b.add(first, i64(k))), i64), align=1)
            for i in range(8):
                entry(i64(k + i), b.and_(b.lshr(eight, i64(8 * i)), i64(255)), sink=True)
        with cgutils.for_range_slice(b, i64(_FIXED_ENTRIES), n, i64(1)) as (k, _):
            entry(k, b.zext(b.load(rc.at(b.add(rc.sparse, b.add(first, k)), i8)), i64))
        b.store(b.add(first, n), start_at)
        out = []
        for k in range(4):
            at = b.bitcast(b.gep(patch, [i64(16 * k)]), vec(i16, 16).as_pointer())
            out.append(b.add(words[k], b.load(at, align=2)))
            b.store(rc.full(i16, 0, 16), at, align=2)
        return out


@intrinsic
def avx2_block_scores(typingctx, s, qi, qscale, dense, scales, counts, sparse, thr, scale, acc):
    """vnni_block_scores with AVX2: s[h, t] = scale * q_h . k_t for the 16 rows of one full,
    quantized block, in int16 dot products on _Avx2Rows's codes (vpmaddwd against the query's codes,
    a row at a time: a lane sums 8 products, < 8 * CODE_MAX^2 < 2^31). Each (head, row)'s 8 lanes go
    to acc as floats, and a shuffle tree (lane_sums) sums them. Arguments as vnni_block_scores'."""
    if not _scores_args(s, qi, qscale, dense, scales, counts, sparse, thr, acc):
        return None

    def codegen(context, builder, signature, args):
        f32, i16, i32, i64 = _F32, _I16, _I32, _I64
        vec = ir.VectorType
        if not AVX2:
            return _trap(context, builder)
        b = builder
        arrays, base, heads, dim, (segs_per_head, kv_heads, group), s_row, scale = _scores_setup(
            context, b, signature, args)
        rows = _Avx2Rows(b, *(arrays[i] for i in (3, 4, 5, 6, 7)))
        rc = rows.rc
        floats = vec(f32, 8)

        def partial_at(h, t):  # (head h, row t)'s 8 lanes in acc [Hq, 16, 16]
            return rc.at(b.add(base[9], b.shl(b.add(b.mul(h, i64(ROWS)), t), i64(6))), floats)

        with cgutils.for_range(b, kv_heads) as kvh, cgutils.for_range(b, i64(ROWS)) as row_loop, \
                cgutils.for_range(b, segs_per_head) as seg_loop:
            t, local = row_loop.index, seg_loop.index
            codes = rows.codes(t, b.add(b.mul(kvh.index, segs_per_head), local))
            first = b.icmp_unsigned("==", local, i64(0))
            q_seg = b.add(base[1], b.shl(local, i64(7)))
            with cgutils.for_range(b, group) as g:
                h = b.add(b.mul(kvh.index, group), g.index)
                q_at = b.add(q_seg, b.mul(h, b.shl(dim, i64(1))))
                total = None
                for k in range(4):
                    y = b.load(rc.at(b.add(q_at, i64(32 * k)), vec(i16, 16)), align=2)
                    x = _pmaddwd(b, codes[k], y)
                    total = x if total is None else b.add(total, x)
                out = partial_at(h, t)
                earlier = b.select(first, ir.Constant(floats, [0.0] * 8), b.load(out, align=4))
                b.store(b.fadd(b.sitofp(total, floats), earlier), out, align=4)
        with cgutils.for_range(b, heads) as g:
            sums = [lane_sums(b, [b.load(partial_at(g.index, i64(t)), align=4) for t in range(first, first + 8)])
                    for first in (0, 8)]
            sums = b.shuffle_vector(sums[0], sums[1], ir.Constant(vec(i32, 16), list(range(16))))
            factor = b.fmul(scale, b.load(b.gep(arrays[2].data, [g.index])))
            scores = b.fmul(b.fmul(sums, rc.unit), rc.lanes(factor))
            b.store(scores, rc.at(b.add(base[0], b.mul(g.index, s_row)), vec(f32, 16)), align=4)
        return context.get_dummy_value()
    return types.none(s, qi, qscale, dense, scales, counts, sparse, thr, scale, acc), codegen


@intrinsic
def avx2_add_weighted_rows(typingctx, acc, w, dense, scales, counts, sparse, thr):
    """vnni_add_weighted_rows with AVX2: acc[h] += sum_t w[h, t] * v_t over the 16 rows of one full,
    quantized block, in int16 dot products on _Avx2Rows's codes. Two rows' codes interleaved channel
    by channel (vpunpck[lh]wd) make vpmaddwd add w_t v_t + w_t+1 v_t+1 into each channel's lane; a
    lane sums the 16 rows' products, < 16 * CODE_MAX * WEIGHT_MAX < 2^31. Arguments as
    vnni_add_weighted_rows'."""
    if not _weighted_args(acc, w, dense, scales, counts, sparse, thr):
        return None

    def codegen(context, builder, signature, args):
        f32, i32, i64 = _F32, _I32, _I64
        vec = ir.VectorType
        if not AVX2:
            return _trap(context, builder)
        b = builder
        arrays, heads, (segs_per_head, kv_heads, group), (acc_base, acc_row), (w_base, w_row) = \
            _weighted_setup(context, b, signature, args)
        rows = _Avx2Rows(b, *(arrays[i] for i in (2, 3, 4, 5, 6)))
        rc = rows.rc
        pair_codes, units = _weight_codes(b, rc, heads, w_base, w_row)
        dwords, floats = vec(i32, 8), vec(f32, 8)
        # row pairs x 8 vectors: vector 2k + m holds, for channels 16k + 4m + [0..3 | 8..11], both rows' codes
        interleaved = cgutils.alloca_once(b, ir.ArrayType(dwords, 4 * ROWS))
        unpack = [ir.Constant(vec(i32, 16), [x for lane in (0, 8) for i in range(first, first + 4)
                                             for x in (lane + i, 16 + lane + i)]) for first in (0, 4)]
        natural = [ir.Constant(vec(i32, 8), [first + i + 8 * m for m in (0, 1) for i in range(4)]) for first in (0, 4)]
        with cgutils.for_range(b, kv_heads) as kvh, cgutils.for_range(b, segs_per_head) as seg_loop:
            local = seg_loop.index
            seg = b.add(b.mul(kvh.index, segs_per_head), local)
            with cgutils.for_range(b, i64(ROWS // 2)) as pair_loop:
                p = pair_loop.index
                both = [rows.codes(b.add(b.shl(p, i64(1)), i64(r)), seg) for r in (0, 1)]
                for k in range(4):
                    for m, mask in enumerate(unpack):
                        x = b.bitcast(b.shuffle_vector(both[0][k], both[1][k], mask), dwords)
                        b.store(x, b.gep(interleaved, [i32(0), b.add(b.shl(p, i64(3)), i64(2 * k + m))]))
            with cgutils.for_range(b, group) as g:
                h = b.add(b.mul(kvh.index, group), g.index)
                # each row pair's two codes broadcast from memory (see vnni_add_weighted_rows)
                at = b.asm(ir.FunctionType(i64, [i64]), "", "=r,0", [b.ptrtoint(b.gep(pair_codes, [h]), i64)], False)
                sums = [None] * 8
                for p in range(ROWS // 2):
                    weights = splat(b, b.load(rc.at(b.add(at, i64(4 * p)), i32), align=4), 8)
                    for k in range(8):
                        x = _pmaddwd(b, b.load(b.gep(interleaved, [i32(0), i32(8 * p + k)])), weights)
                        sums[k] = x if sums[k] is None else b.add(sums[k], x)
                unit = splat(b, b.load(b.gep(units, [h])), 8)
                sums = [b.fmul(b.sitofp(x, floats), unit) for x in sums]
                row_at = b.add(acc_base, b.add(b.mul(h, acc_row), b.shl(local, i64(8))))
                for k in range(4):
                    for half, mask in enumerate(natural):  # channels 16k + 8 half + 0..7
                        out = rc.at(b.add(row_at, i64(64 * k + 32 * half)), floats)
                        x = b.shuffle_vector(sums[2 * k], sums[2 * k + 1], mask)
                        b.store(b.fadd(b.load(out, align=4), x), out, align=4)
        return context.get_dummy_value()
    return types.none(acc, w, dense, scales, counts, sparse, thr), codegen
