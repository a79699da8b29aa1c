"""A full block's rows and the queries as int16 codes: what vnni.py's and avx2.py's kernels
share (the CPU flags, query_codes, _RowCodes, the kernels' argument checks and set-up)."""
from __future__ import annotations

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils

from cpu_attn.llvm_ir import _F32, _I1, _I16, _I32, _I64, _I8, _llvm_fn, c_array, host_has, pmaddwd_pairs, splat
from cpu_attn.oaken.codec import MIDDLE_OFFSET, SEGMENT

VNNI = host_has("avx512bw", "avx512vnni", "avx512vbmi2")
"""Whether the exact kernel works on full blocks in AVX-512 int16 dot products (vnni_block_scores,
vnni_add_weighted_rows; VBMI2 for vpexpandw)."""
AVX2 = host_has("avx2", "fma", "f16c")
"""Whether it can at least do so in AVX2 (avx2_block_scores, avx2_add_weighted_rows)."""
INT16 = VNNI or AVX2
"""Whether full blocks go through int16 dot products at all; elsewhere they are decoded to floats."""
CODE_MAX = 16383
"""|code| and |query code| bound of vnni_block_scores: a product is < 2^28, six per lane and segment stay < 2^31."""
ROWS = 16  # rows of a block vnni_block_scores scores: the lanes of its vectors


def query_codes(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q [..., D] float32 -> (codes int16 [..., D], scales float32 [...]): q ~ codes * scales, |codes| <= CODE_MAX."""
    rows = np.ascontiguousarray(q, np.float32).reshape(-1, q.shape[-1])
    codes, scales = np.empty(rows.shape, np.int16), np.empty(len(rows), np.float32)
    _query_codes(rows, codes, scales)
    return codes.reshape(q.shape), scales.reshape(q.shape[:-1])


@njit(cache=True, nogil=True)
def _query_codes(q, codes, scales):
    """query_codes on rows [N, D], in one loop: NumPy's five passes took ~6 us for a decode batch."""
    for r in range(q.shape[0]):
        top = np.float32(1e-30)
        for i in range(q.shape[1]):
            top = max(top, abs(q[r, i]))
        scale = top / np.float32(CODE_MAX)
        scales[r] = scale
        for i in range(q.shape[1]):  # rint as an add and a subtract (|x| <= CODE_MAX < 2^22): np.rint is a call a value
            codes[r, i] = np.int16((q[r, i] / scale + _RINT) - _RINT)


_RINT = np.float32(3 << 22)  # x + _RINT - _RINT rounds a float32 |x| < 2^22 to the nearest integer, ties to even


binding.initialize_native_asmparser()  # _dpwssd's inline assembly (Numba readies the target, not its parser)


def _dpwssd(builder, acc, x, y):
    """acc + the pairwise int16 dot products of x and y (<16 x i32> each): one vpdpwssd, as inline
    assembly. Called as the intrinsic, LLVM's machine combiner splits most into vpmaddwd + vpaddd
    (a shorter chain for one product, two uops for every one): the kernels here are bound by uops.
    Without VNNI, two AVX2 vpmaddwd and vpaddd (llvm_ir.pmaddwd_pairs)."""
    if not VNNI:
        return pmaddwd_pairs(builder, acc, x, y)
    vec = ir.VectorType(_I32, 16)
    return builder.asm(ir.FunctionType(vec, [vec] * 3), "vpdpwssd $2, $1, $0", "=v,v,v,0", [x, y, acc], False)


def _pmaddwd(builder, x, y):
    """The pairwise int16 dot products of x and y (<8 x i32> each, int16 pairs) as <8 x i32>: one AVX2 vpmaddwd."""
    words, dwords = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    fn = _llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", dwords, [words, words])
    return builder.call(fn, [builder.bitcast(x, words), builder.bitcast(y, words)])


class _RowCodes:
    """LLVM IR shared by vnni_block_scores and vnni_add_weighted_rows: one full block's rows of one
    kv-head as int16 codes. Each row's 16 levels (8 middle magnitudes either side, dequantize_token)
    and its sparse values are int16 multiples of a per-row unit, its largest possible |value| /
    CODE_MAX; the per-row scalars are computed for all 16 rows at once, a row a lane."""

    def __init__(self, builder, dense, scales, counts, sparse, thr):
        """dense, scales, counts, sparse, thr: the arrays' structs (make_array)."""
        self.builder = b = builder
        f32, i1, i8, i16, i32, i64 = _F32, _I1, _I8, _I16, _I32, _I64
        vec = ir.VectorType
        self.permw = self.fn("llvm.x86.avx512.permvar.hi.512", vec(i16, 32), [vec(i16, 32)] * 2)
        self.perm2w = self.fn("llvm.x86.avx512.vpermi2var.hi.512", vec(i16, 32), [vec(i16, 32)] * 3)
        self.rint = self.fn("llvm.rint.v16f32", vec(f32, 16), [vec(f32, 16)])
        fabs = self.fn("llvm.fabs.v16f32", vec(f32, 16), [vec(f32, 16)])
        self.masked_load = self.fn("llvm.masked.load.v32i8.p0", vec(i8, 32),
                                   [i8.as_pointer(), i32, vec(i1, 32), vec(i8, 32)])
        self.dense, self.counts = b.ptrtoint(dense.data, i64), b.ptrtoint(counts.data, i64)
        self.sparse = b.ptrtoint(sparse.data, i64)
        self.dense_row, self.counts_row = (cgutils.unpack_tuple(b, a.strides, 2)[0] for a in (dense, counts))
        self.num_counts = cgutils.unpack_tuple(b, counts.shape, 2)[1]
        s_lo, t_lo, t_hi, s_hi = (self.lanes(b.load(b.gep(thr.data, [i64(i)]))) for i in range(4))
        raw = b.load(self.at(b.ptrtoint(scales.data, i64), vec(i16, 3 * ROWS)), align=2)
        s0, s1, s2 = (b.fpext(b.bitcast(b.shuffle_vector(raw, raw, ir.Constant(vec(i32, ROWS), list(range(k, 3 * ROWS, 3)))),
                                        vec(ir.HalfType(), ROWS)), vec(f32, ROWS)) for k in range(3))
        hi_base = b.fadd(t_hi, b.fmul(self.full(f32, float(MIDDLE_OFFSET)), s0))  # levels (m + offset) * step
        lo_base = b.fsub(t_lo, b.fmul(self.full(f32, float(MIDDLE_OFFSET)), s0))
        s0_7, s2_15 = b.fmul(self.full(f32, 7.0), s0), b.fmul(self.full(f32, 15.0), s2)
        top = self.full(f32, 1e-30)
        for x in (hi_base, b.fadd(hi_base, s0_7), lo_base, b.fsub(lo_base, s0_7), b.fadd(s_hi, s2_15), b.fsub(s_lo, s2_15)):
            top = self.vmax(top, b.call(fabs, [x]))
        top = self.vmax(top, b.fmul(self.full(f32, 15.0), s1))
        self.inv = b.fdiv(self.full(f32, float(CODE_MAX)), top)
        self.unit = b.fmul(top, self.full(f32, 1.0 / CODE_MAX))  # [16] the rows' units (a multiply: one division a block)
        # in memory, a row's scalars broadcast from there: the kernels loop over rows at run time (16
        # unrolled rows were ~40 KB of code, more than the L1 instruction cache and the uop cache hold)
        self.per_row = b.ptrtoint(cgutils.alloca_once(b, ir.ArrayType(vec(f32, ROWS), 7)), i64)
        for k, x in enumerate((hi_base, lo_base, s0, s1, s2, s_lo, s_hi)):
            b.store(b.fmul(x, self.inv), self.at(b.add(self.per_row, i64(64 * k)), vec(f32, ROWS)), align=4)
        self.entry_of_row = cgutils.alloca_once(b, i64)  # where the next row's entries start (rows in order)
        self.zero16 = self.full(i16, 0)
        self.widen = ir.Constant(vec(i32, 32), list(range(16)) + [16] * 16)  # <16 x i16> -> <32 x i16>, the rest 0
        self.first16 = ir.Constant(vec(i32, 16), list(range(16)))

    def fn(self, name, ret, params):
        return _llvm_fn(self.builder, name, ret, params)

    def at(self, address, kind):
        return self.builder.inttoptr(address, kind.as_pointer())

    def full(self, kind, x, n=ROWS):
        return ir.Constant(ir.VectorType(kind, n), [x] * n)

    def lanes(self, x):
        return splat(self.builder, x, ROWS)

    def vmax(self, a, b):
        return self.builder.select(self.builder.fcmp_ordered(">", a, b), a, b)

    def to_codes(self, x):  # <16 x float> in units -> <16 x i16>
        b = self.builder
        return b.trunc(b.fptosi(b.call(self.rint, [x]), ir.VectorType(_I32, 16)), ir.VectorType(_I16, 16))

    def first_row(self):
        """Before row 0's walk: its entries start the block's budget."""
        self.builder.store(_I64(0), self.entry_of_row)

    def walk(self, t, entry):
        """Row t's counts (t: i64, rows in order from first_row) -> where the row's entries start in
        the block's budget, stored at `entry` (an i64 pointer)."""
        b = self.builder
        b.store(b.load(self.entry_of_row), entry)
        first = self.at(b.add(self.counts, b.mul(t, self.counts_row)), _I8)
        with cgutils.for_range(b, self.num_counts) as c:  # a GEP: LLVM vectorizes long rows with loads, not gathers
            n = b.zext(b.load(b.gep(first, [c.index])), _I64)
            b.store(b.add(b.load(self.entry_of_row), n), self.entry_of_row)

    def row(self, t, entry, cache=None, fresh=None):
        """Row t's state (t: i64): its levels as codes (<32 x i16>, lanes 16.. unused), where its
        entries start (`entry`, an i64 pointer; each segment moves it on by its count), its scalars,
        its counts' and nibbles' addresses. With `cache` (a buffer of ROWS <32 x i16>) the levels are
        computed where `fresh` (i1) holds and kept there, else loaded from it."""
        f32, i1, i64 = _F32, _I1, _I64
        b = self.builder
        scalars = [self.lanes(b.load(self.at(b.add(self.per_row, b.add(i64(64 * k), b.shl(t, i64(2)))), f32)))
                   for k in range(7)]

        def levels():
            hb, lb, st = scalars[:3]
            steps = ir.Constant(ir.VectorType(f32, 16), [float(n % 8) for n in range(16)])
            negative = ir.Constant(ir.VectorType(i1, 16), [n >= 8 for n in range(16)])
            codes = self.to_codes(b.select(negative, b.fsub(lb, b.fmul(steps, st)), b.fadd(hb, b.fmul(steps, st))))
            return b.shuffle_vector(codes, self.zero16, self.widen)
        if cache is None:
            codes = levels()
        else:
            slot = b.gep(cache, [_I32(0), t])
            with b.if_then(fresh):
                b.store(levels(), slot)
            codes = b.load(slot)
        counts_at = b.add(self.counts, b.mul(t, self.counts_row))
        row_at = b.add(self.dense, b.mul(t, self.dense_row))
        return codes, entry, scalars, counts_at, row_at

    def segment(self, row, seg):
        """Segment seg of the current row (SEGMENT values of its kv-heads, in order) -> (its nibbles:
        values 0..31 and 32..63 as <32 x i16>, the same as level codes, its entry count as i64)."""
        i8, i16, i64 = _I8, _I16, _I64
        b = self.builder
        levels, _, _, counts_at, row_at = row
        nibbles = b.load(self.at(b.add(row_at, b.shl(seg, i64(5))), ir.VectorType(i8, 32)),
                         align=1)
        wide = b.zext(nibbles, ir.VectorType(i16, 32))  # one vpmovzxbw, then both nibbles in 16-bit lanes
        low, high = b.and_(wide, self.full(i16, 15, 32)), b.lshr(wide, self.full(i16, 4, 32))
        n = b.zext(b.load(self.at(b.add(counts_at, seg), i8)), i64)
        return low, high, b.call(self.permw, [levels, low]), b.call(self.permw, [levels, high]), n

    def entry_table(self, row, minus_levels):
        """Row's codes of every value a sparse entry can give, by key = nibble | outer << 4 | negative
        << 5 (entries): (keys 0..31, keys 32..63) as two <32 x i16>, one vpermi2w's table. With
        minus_levels each less the row's level code at the nibble: what the entry adds to the dense value."""
        f32, i32 = _F32, _I32
        b = self.builder
        st1, st2, sl, sh = row[2][3:]
        y = ir.Constant(ir.VectorType(f32, 16), [float(n) for n in range(16)])
        inner, outer = b.fmul(y, st1), b.fmul(y, st2)  # true = (outer ? (negative ? sl : sh) : 0) +- y * step
        words = ir.VectorType(_I16, 32)
        quarters = [b.bitcast(b.fptosi(b.call(self.rint, [x]), ir.VectorType(i32, 16)), words)
                    for x in (inner, b.fadd(sh, outer), b.fneg(inner), b.fsub(sl, outer))]
        low_words = ir.Constant(ir.VectorType(i32, 32), list(range(0, 64, 2)))  # two quarters' codes in one shuffle
        halves = [b.shuffle_vector(quarters[k], quarters[k + 1], low_words) for k in (0, 2)]
        if minus_levels:
            twice = b.shuffle_vector(row[0], row[0], ir.Constant(ir.VectorType(i32, 32), list(range(16)) * 2))
            halves = [b.sub(x, twice) for x in halves]
        return halves

    def entry_key(self, e, nibbles):
        """Entries' bytes e and their nibbles (<32 x i16> each) -> their keys in entry_table: the
        nibble, the group bit (byte bit 6, outer) at 4 and the sign bit (bit 7) at 5."""
        b = self.builder
        return b.or_(nibbles, b.and_(b.lshr(e, self.full(_I16, 2, 32)), self.full(_I16, 48, 32)))

    def entries(self, where, left, low, high, table):
        """Up to 16 sparse entries at address `where` (left of them) -> (lanes in use <32 x i1>, their
        indices j <32 x i16>, their codes from `table` (entry_table) <32 x i16>; lanes past `left`,
        and lanes 16.., 0)."""
        i8, i16, i32, i64 = _I8, _I16, _I32, _I64
        b = self.builder
        vec = ir.VectorType
        left = b.select(b.icmp_signed("<", left, i64(16)), left, i64(16))
        # lanes in use as a mask from the count (one kmovd): a vector compare would take the shuffle port
        mask = b.bitcast(b.sub(b.shl(i32(1), b.trunc(left, i32)), i32(1)), vec(_I1, 32))
        e = b.zext(b.call(self.masked_load, [self.at(where, i8), i32(1), mask, self.full(i8, 0, 32)]), vec(i16, 32))
        j = b.and_(e, self.full(i16, 63, 32))
        key = self.entry_key(e, b.call(self.perm2w, [low, j, high]))  # the nibbles at the indices
        return mask, j, b.select(mask, b.call(self.perm2w, [table[0], key, table[1]]), self.full(i16, 0, 32))




def _block_arrays(dense, scales, counts, sparse, thr) -> bool:
    return (c_array(dense, 2, types.uint8) and c_array(scales, 2, types.uint16) and c_array(counts, 2, types.uint8)
            and c_array(sparse, 1, types.uint8) and c_array(thr, 1, types.float32))


def _scores_args(s, qi, qscale, dense, scales, counts, sparse, thr, acc) -> bool:
    """Typing check of vnni_block_scores and avx2_block_scores."""
    return (c_array(s, 2, types.float32) and c_array(qi, 2, types.int16) and c_array(qscale, 1, types.float32)
            and _block_arrays(dense, scales, counts, sparse, thr) and c_array(acc, 3, types.float32))


def _weighted_args(acc, w, dense, scales, counts, sparse, thr) -> bool:
    """Typing check of vnni_add_weighted_rows and avx2_add_weighted_rows."""
    return (c_array(acc, 2, types.float32) and c_array(w, 2, types.float32)
            and _block_arrays(dense, scales, counts, sparse, thr))


def _scores_setup(context, builder, signature, args):
    """LLVM IR: vnni_block_scores's or avx2_block_scores's arguments -> (their arrays by position,
    the arrays' data addresses, query heads, head_dim, _head_layout, s's row stride, scale)."""
    arrays = {i: context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 4, 5, 6, 7, 9)}
    base = {i: builder.ptrtoint(a.data, _I64) for i, a in arrays.items()}
    heads, dim = cgutils.unpack_tuple(builder, arrays[1].shape, 2)
    s_row = cgutils.unpack_tuple(builder, arrays[0].strides, 2)[0]
    scale = context.cast(builder, args[8], signature.args[8], types.float32)
    return arrays, base, heads, dim, _head_layout(builder, heads, dim, arrays[3]), s_row, scale


def _weighted_setup(context, builder, signature, args):
    """LLVM IR: vnni_add_weighted_rows's or avx2_add_weighted_rows's arguments -> (their arrays by
    position, query heads, _head_layout, acc's and w's (data address, row stride))."""
    arrays = {i: context.make_array(signature.args[i])(context, builder, args[i]) for i in range(7)}
    heads, dim = cgutils.unpack_tuple(builder, arrays[0].shape, 2)
    ends = [(builder.ptrtoint(arrays[i].data, _I64), cgutils.unpack_tuple(builder, arrays[i].strides, 2)[0])
            for i in (0, 1)]
    return (arrays, heads, _head_layout(builder, heads, dim, arrays[2])) + tuple(ends)


def _head_layout(builder, heads, dim, dense):
    """LLVM IR: (segments a head, kv-heads, query heads a kv-head) of a block kernel's call, from its
    query heads, head_dim and the block's dense nibbles (C / 2 bytes a row)."""
    i64 = _I64
    kv_heads = builder.udiv(builder.shl(cgutils.unpack_tuple(builder, dense.shape, 2)[1], i64(1)), dim)
    return builder.udiv(dim, i64(SEGMENT)), kv_heads, builder.udiv(heads, kv_heads)


def _trap(context, builder):
    builder.call(_llvm_fn(builder, "llvm.trap", ir.VoidType(), []), [])
    return context.get_dummy_value()
