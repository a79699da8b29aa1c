"""Numba kernels over the paged KV store: exact decode attention over fp16 or float32 blocks
(paged_decode_attention) and the block steps every exact and sampled kernel shares."""
from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from cpu_attn.fp16 import F16C, kernel_rows, to_f32, widen_block
from cpu_attn.llvm_ir import (_FAST, c_array, f32_matrices, host_has, lane_sums, prefetch_l2, row_kernel_args,
                              splat)
from cpu_attn.softmax import attend_begin, attend_merge, softmax_rows16, softmax_weights

_LINE = 64  # bytes of a cache line


def _cache_rows(a) -> bool:
    """Typing check of the row kernels' K or V rows: a float32 matrix, or one of fp16 bits (uint16) where the CPU
    widens them in registers (F16C)."""
    return c_array(a, 2, types.float32) or (F16C and c_array(a, 2, types.uint16))


def _load8(builder, halves: bool, row_at, column):
    """LLVM IR: the 8 values of a K or V row from `column` on (i64 values: the row's address, a column), as
    <8 x float>; fp16 bits widened (vcvtph2ps)."""
    if not halves:
        at = builder.add(row_at, builder.shl(column, ir.IntType(64)(2)))
        return builder.load(builder.inttoptr(at, ir.VectorType(ir.FloatType(), 8).as_pointer()), align=4)
    at = builder.add(row_at, builder.shl(column, ir.IntType(64)(1)))
    x = builder.load(builder.inttoptr(at, ir.VectorType(ir.HalfType(), 8).as_pointer()), align=2)
    return builder.fpext(x, ir.VectorType(ir.FloatType(), 8))


def zeros_aligned(shape: tuple[int, ...], dtype, slack: int = 0) -> np.ndarray:
    """np.zeros starting on a cache line. A large np.zeros starts 16 bytes into a page, so a row of
    64 values had its vector loads split across two lines (and an Oaken head's 32 nibble bytes half
    the time); like np.zeros, pages are mapped only once written. `slack` bytes past the end stay
    readable (for kernels that read a few bytes past what they use)."""
    dtype = np.dtype(dtype)
    raw = np.zeros(int(np.prod(shape)) * dtype.itemsize + _LINE + slack, np.uint8)
    skip = -raw.ctypes.data % _LINE
    return raw[skip:skip + raw.size - _LINE - slack].view(dtype).reshape(shape)


@njit(cache=True, nogil=True)
def write_kv(k_cache, v_cache, slot_mapping, k, v):
    """Scatter new rows into one layer's cache.

    k_cache, v_cache: [num_blocks, Hkv, block_size, D] (float32, or uint16 holding fp16 bits)
    slot_mapping: [T] int64, slot = block * block_size + offset; k, v: [T, Hkv, D] same dtype as the cache
    """
    block_size = k_cache.shape[2]
    for t in range(slot_mapping.shape[0]):
        block, offset = slot_mapping[t] // block_size, slot_mapping[t] % block_size
        for h in range(k_cache.shape[1]):
            k_cache[block, h, offset, :] = k[t, h, :]
            v_cache[block, h, offset, :] = v[t, h, :]


@njit(cache=True, nogil=True, parallel=True)
def gather_rows(cache, blocks, seq_len, out):
    """out[t] = the rows of positions t < seq_len as float32, a block at a time in parallel: cache [num_blocks, Hkv,
    block_size, D] of one layer (float32, or uint16 holding fp16 bits, widened as the kernels widen them), blocks:
    the sequence's block ids, out [>= seq_len, Hkv, D] float32."""
    num_kv_heads, block_size, head_dim = cache.shape[1], cache.shape[2], cache.shape[3]
    for j in prange((seq_len + block_size - 1) // block_size):
        scratch = np.empty((block_size, head_dim), np.float32)
        width = min(block_size, seq_len - j * block_size)
        for h in range(num_kv_heads):
            rows = widen_block(cache[blocks[j], h], width, scratch)
            for r in range(width):
                out[j * block_size + r, h, :] = rows[r]


_ROW_VECTORS = 8  # vectors of 8 floats: the 64 values of a row chunk _add_weighted_rows keeps in registers
_HEADS = 3 if host_has("avx512f") else 1
"""Query heads the row kernels advance together, each K or V row loaded (and widened) once for all of them: their
3 x 8 sums fit AVX-512's 32 vector registers beside the operands, not AVX2's 16. Each head's own arithmetic, and
so its result, is the same either way."""


def _by_heads(builder, groups, emit) -> None:
    """LLVM IR: emit(g0, count) over the `groups` query heads (an i64 value), _HEADS at a time, the rest one by one."""
    i64 = ir.IntType(64)
    blocked = builder.sub(groups, builder.srem(groups, i64(_HEADS)))
    with cgutils.for_range_slice(builder, i64(0), blocked, i64(_HEADS)) as (g0, _):
        emit(g0, _HEADS)
    with cgutils.for_range_slice(builder, blocked, groups, i64(1)) as (g, _):
        emit(g, 1)


@intrinsic
def _add_weighted_rows(typingctx, acc, s, rows, width):
    """acc[g, :] += sum over t < width of s[g, t] * rows[t, :]: acc [G, D], s [G, >= width],
    rows [>= width, D], float32 C arrays (rows may also hold fp16 bits, _cache_rows), D a multiple of 64
    (attend_scores checks).

    Written in LLVM IR so that each 64-wide chunk of acc[g] stays in eight vector registers
    while the rows stream past: Numba's loop loads and stores acc[g, d] for every row (LLVM
    cannot tell acc from rows apart), one store-to-load round trip per row and vector.
    llvm.fmuladd fuses where the CPU has FMA."""
    if not f32_matrices(acc, s) or not _cache_rows(rows) or not isinstance(width, types.Integer):
        return None
    halves = rows.dtype == types.uint16

    def codegen(context, builder, signature, args):
        f32, i64 = ir.FloatType(), ir.IntType(64)
        vec, fmuladd, base, row_bytes, shapes, width = row_kernel_args(context, builder, signature, args)
        groups, dim = shapes[0]

        def at(kind, address):
            return builder.inttoptr(address, kind.as_pointer())

        def heads(g0, count):  # heads g0 .. g0 + count - 1, each row loaded once for all of them
            regs = [[cgutils.alloca_once(builder, vec) for _ in range(_ROW_VECTORS)] for _ in range(count)]
            with cgutils.for_range_slice(builder, i64(0), dim, i64(8 * _ROW_VECTORS)) as (d, _):
                acc_at = [builder.add(builder.add(base[0], builder.mul(builder.add(g0, i64(h)), row_bytes[0])),
                                      builder.shl(d, i64(2))) for h in range(count)]
                for h in range(count):
                    for i, reg in enumerate(regs[h]):
                        builder.store(builder.load(at(vec, builder.add(acc_at[h], i64(32 * i))), align=4), reg)
                with cgutils.for_range(builder, width) as t:
                    weights = []
                    for h in range(count):
                        s_at = builder.add(base[1], builder.mul(builder.add(g0, i64(h)), row_bytes[1]))
                        weight = builder.load(at(f32, builder.add(s_at, builder.shl(t.index, i64(2)))), align=4)
                        weights.append(splat(builder, weight, 8))
                    row_at = builder.add(base[2], builder.mul(t.index, row_bytes[2]))
                    for i in range(_ROW_VECTORS):
                        x = _load8(builder, halves, row_at, builder.add(d, i64(8 * i)))
                        for h in range(count):
                            builder.store(builder.call(fmuladd, [weights[h], x, builder.load(regs[h][i])]), regs[h][i])
                for h in range(count):
                    for i, reg in enumerate(regs[h]):
                        builder.store(builder.load(reg), at(vec, builder.add(acc_at[h], i64(32 * i))), align=4)

        _by_heads(builder, groups, heads)
        return context.get_dummy_value()
    return types.none(acc, s, rows, width), codegen


_SCORE_ROWS = 8  # rows _block_scores scores at once, into one vector of 8 scores


@intrinsic
def _block_scores(typingctx, s, qs, kb, width, scale):
    """s[g, t] = scale * (qs[g] . kb[t]) for t < width, rounded up to a multiple of 8 (the rows past
    width are scored too: s and kb must hold them). s [G, >= width8], qs [G, D], kb [>= width8, D],
    float32 C arrays (kb may also hold fp16 bits, _cache_rows), D a multiple of 8 (attend_block checks).

    In LLVM IR so that eight rows are scored at once: eight independent chains of fused
    multiply-adds, then their eight horizontal sums in one shuffle tree (lane_sums). Numba's loop
    summed each row's vector on its own and stored one score at a time."""
    if not f32_matrices(s, qs) or not _cache_rows(kb) or not isinstance(width, types.Integer) or \
            not isinstance(scale, types.Float):
        return None
    halves = kb.dtype == types.uint16

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        vec, fmuladd, base, row_bytes, shapes, width = row_kernel_args(context, builder, signature, args)
        groups, dim = shapes[1]
        factor = splat(builder, context.cast(builder, args[4], signature.args[4], types.float32), 8)

        def at(array, row, column):
            row_at = builder.add(base[array], builder.mul(row, row_bytes[array]))
            return builder.inttoptr(builder.add(row_at, builder.shl(column, i64(2))), vec.as_pointer())

        def heads(t0, g0, count):  # heads g0 .. g0 + count - 1, each K row loaded once for all of them
            sums = [[cgutils.alloca_once(builder, vec) for _ in range(_SCORE_ROWS)] for _ in range(count)]
            for head in sums:
                for acc in head:
                    builder.store(ir.Constant(vec, [0.0] * 8), acc)
            with cgutils.for_range_slice(builder, i64(0), dim, i64(8)) as (d, _):
                qs = [builder.load(at(1, builder.add(g0, i64(h)), d), align=4) for h in range(count)]
                for r in range(_SCORE_ROWS):
                    k_at = builder.add(base[2], builder.mul(builder.add(t0, i64(r)), row_bytes[2]))
                    k = _load8(builder, halves, k_at, d)
                    for h in range(count):
                        builder.store(builder.call(fmuladd, [qs[h], k, builder.load(sums[h][r])]), sums[h][r])
            for h in range(count):
                scores = lane_sums(builder, [builder.load(acc) for acc in sums[h]])
                builder.store(builder.fmul(scores, factor), at(0, builder.add(g0, i64(h)), t0), align=4)

        with cgutils.for_range_slice(builder, i64(0), width, i64(_SCORE_ROWS)) as (t0, _):
            _by_heads(builder, groups, lambda g0, count: heads(t0, g0, count))
        return context.get_dummy_value()
    return types.none(s, qs, kb, width, scale), codegen


@njit(cache=True, nogil=True, inline="always")
def block_scores(qs, kb, width, scale, s):
    """s[g, t] = scale * (qs[g] . kb[t]) for t < width: qs [group, D], kb [block_size, D]."""
    group, head_dim = qs.shape
    if head_dim % 8 == 0 and kb.shape[0] % _SCORE_ROWS == 0:
        _block_scores(s, qs, kb, width, np.float32(scale))
    else:
        for t in range(width):
            for g in range(group):
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += qs[g, d] * to_f32(kb[t, d])
                s[g, t] = dot * scale


@njit(cache=True, nogil=True, inline="always")
def attend_block(qs, kb, vb, width, scale, s, acc, m, l):
    """Advance one work item's online softmax by `width` rows of K (kb) and V (vb): float32, or fp16 bits
    where the CPU has F16C (fp16.kernel_rows).

    qs: [group, D] queries sharing a kv-head; kb, vb: [block_size, D]; s: [group, block_size]
    scores scratch; acc: [group, D] unnormalized output; m, l: [group] running max and sum."""
    block_scores(qs, kb, width, scale, s)
    attend_scores(s, vb, width, acc, m, l)


@njit(cache=True, nogil=True, inline="always")
def attend_scores(s, vb, width, acc, m, l):
    """The online-softmax step of attend_block for given scores s [group, >= width] (overwritten
    with their weights). A score of -inf gets weight 0 (the sampled kernel marks rows a head did
    not retrieve so), but must not be a head's first: m[g] has to be finite. A full block of 16 rows
    takes softmax_rows16 (one vector a head; softmax_weights' loops took ~100 ns a head and block on
    a Zen 3, a third of the fp16 kernel's time)."""
    if width == 16 and s.shape[1] == 16 and acc.shape[1] % 16 == 0:
        softmax_rows16(s, acc, m, l)
    else:
        softmax_weights(s, width, acc, m, l)
    group, head_dim = acc.shape
    if head_dim % (8 * _ROW_VECTORS) == 0:
        _add_weighted_rows(acc, s, vb, width)
        return
    for t in range(width):
        for g in range(group):
            p = s[g, t]
            if p != 0.0:
                for d in range(head_dim):
                    acc[g, d] += p * to_f32(vb[t, d])


class AttentionScratch(NamedTuple):
    """The exact decode kernels' scratch, one slice per unit of work U (attention_scratch), float32."""
    scores: np.ndarray  # [U, group, block_size]: a block's scores, then their softmax weights
    kb: np.ndarray  # [U, block_size, D]: a block's K rows widened (or decoded)
    vb: np.ndarray  # [U, block_size, D]: the same for V
    m: np.ndarray  # [U, group]: running max of the online softmax
    l: np.ndarray  # [U, group]: running sum
    parts: np.ndarray  # [U, group, D]: unnormalized outputs, joined by merge_parts


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out, lse, scratch):
    """One query token per sequence against its whole paged context.

    q: [B, Hq, D] float32; k_cache, v_cache: [num_blocks, Hkv, block_size, D]
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (tokens incl. the current one)
    out: [B, Hq, D] float32 (written); lse: [B, Hq] float32 (written, natural log)
    scratch: AttentionScratch (attention_scratch) as a plain tuple, one slice per unit

    A (sequence, kv-head) item reads a block's K/V rows where they lie (an fp16 cache's widened in
    registers as they are read, fp16.kernel_rows; without F16C widened into kb, vb first) and uses
    them for all `group` query heads that share them, with an online softmax (running max m, running
    sum l) advanced block by block. Its context is cut into U / (B * Hkv) parts of consecutive blocks,
    one unit of work each, whose states attend_merge joins (split_parts says how many).
    """
    scores = scratch[0]  # written: by index, one statement each (oaken/records.py)
    kb = scratch[1]
    vb = scratch[2]
    m = scratch[3]
    l = scratch[4]
    parts = scratch[5]
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    splits = parts.shape[0] // (num_seqs * num_kv_heads)
    for unit in prange(parts.shape[0]):
        item, part = unit // splits, unit % splits
        b, kvh = item // num_kv_heads, item % num_kv_heads
        heads = slice(kvh * group, (kvh + 1) * group)
        acc = parts[unit]
        attend_begin(acc, m[unit], l[unit])
        first, end = part_blocks(seq_lens[b], block_size, splits, part)
        for j in range(first, end):
            block = block_tables[b, j]
            width = min(block_size, seq_lens[b] - j * block_size)
            if j + 1 < end:
                prefetch_rows(k_cache, v_cache, block_tables[b, j + 1], kvh)
            k, v = kernel_rows(k_cache[block, kvh], width, kb[unit]), kernel_rows(v_cache[block, kvh], width, vb[unit])
            attend_block(q[b, heads], k, v, width, scale, scores[unit], acc, m[unit], l[unit])
        finish_unit(parts, m, l, out, lse, unit, splits, b, heads)
    merge_parts(parts, m, l, out, lse, num_kv_heads)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def paged_verify_attention(q, k_cache, v_cache, block_tables, seq_lens, row_first, row_count, scale, out, lse, qs,
                           scores, kb, vb, m, l, acc):
    """Several consecutive query positions per sequence against its paged context, each row causal:
    the rows of a decode chunk with draft tokens (speculative decoding), and one-row decodes beside them.

    q: [T, Hq, D] float32, sequence b's rows at row_first[b] .. row_first[b] + row_count[b] - 1, the first of
    position seq_lens[b] - 1 (it sees seq_lens[b] tokens, the next one more, ...); k_cache, v_cache, block_tables:
    as paged_decode_attention's; out: [T, Hq, D], lse: [T, Hq] (written). Scratch, one slice per unit of work
    U (verify_scratch), R = the most rows of a sequence: qs, acc [U, R * group, D]; scores [U, R * group,
    block_size]; kb, vb [U, block_size, D]; m, l [U, R * group].

    A (sequence, kv-head) item widens each block once for all its rows' query heads: the blocks every row sees
    whole are attended by all R * group heads at once, the last ones row by row with each row's own width. As
    in paged_decode_attention, an item's context is cut into U / (B * Hkv) parts of consecutive blocks, one
    unit of work each, joined after the loop (one sequence has only 3 items for the threads). Each row's
    arithmetic is paged_decode_attention's for that row alone."""
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    head_dim = q.shape[2]
    splits = acc.shape[0] // (seq_lens.shape[0] * num_kv_heads)
    for unit in prange(acc.shape[0]):
        item, part = unit // splits, unit % splits
        b, kvh = item // num_kv_heads, item % num_kv_heads
        r0, rows = row_first[b], row_count[b]
        n = rows * group
        for r in range(rows):
            for g in range(group):
                for d in range(head_dim):
                    qs[unit, r * group + g, d] = q[r0 + r, kvh * group + g, d]
        attend_begin(acc[unit, :n], m[unit, :n], l[unit, :n])
        first_len = seq_lens[b]
        last_len = first_len + rows - 1
        first, end = part_blocks(last_len, block_size, splits, part)
        for j in range(first, end):
            block = block_tables[b, j]
            if j + 1 < end:
                prefetch_rows(k_cache, v_cache, block_tables[b, j + 1], kvh)
            widest = min(block_size, last_len - j * block_size)
            k = widen_block(k_cache[block, kvh], widest, kb[unit])
            v = widen_block(v_cache[block, kvh], widest, vb[unit])
            if (j + 1) * block_size <= first_len:  # whole for every row
                attend_block(qs[unit, :n], k, v, block_size, scale, scores[unit, :n], acc[unit, :n], m[unit, :n],
                             l[unit, :n])
                continue
            for r in range(rows):
                width = min(block_size, first_len + r - j * block_size)
                if width > 0:
                    h0, h1 = r * group, (r + 1) * group
                    attend_block(qs[unit, h0:h1], k, v, width, scale, scores[unit, h0:h1], acc[unit, h0:h1],
                                 m[unit, h0:h1], l[unit, h0:h1])
        if splits == 1:
            for r in range(rows):
                h0, h1 = r * group, (r + 1) * group
                attend_merge(acc[unit:unit + 1, h0:h1], m[unit:unit + 1, h0:h1], l[unit:unit + 1, h0:h1],
                             out[r0 + r, kvh * group:(kvh + 1) * group], lse[r0 + r, kvh * group:(kvh + 1) * group])
    if splits > 1:  # on the calling thread, as merge_parts
        for item in range(seq_lens.shape[0] * num_kv_heads):
            b, kvh = item // num_kv_heads, item % num_kv_heads
            units = slice(item * splits, (item + 1) * splits)
            for r in range(row_count[b]):
                h0, h1 = r * group, (r + 1) * group
                attend_merge(acc[units, h0:h1], m[units, h0:h1], l[units, h0:h1],
                             out[row_first[b] + r, kvh * group:(kvh + 1) * group],
                             lse[row_first[b] + r, kvh * group:(kvh + 1) * group])


def verify_scratch(work: int, rows: int, group: int, block_size: int, head_dim: int, splits: int = 1) -> tuple:
    """paged_verify_attention's scratch (qs, scores, kb, vb, m, l, acc) for `work` items of up to `rows` rows, each
    cut into `splits` units (split_parts)."""
    f32, n, units = np.float32, rows * group, work * splits
    return (np.empty((units, n, head_dim), f32), np.empty((units, n, block_size), f32),
            np.empty((units, block_size, head_dim), f32), np.empty((units, block_size, head_dim), f32),
            np.empty((units, n), f32), np.empty((units, n), f32), np.empty((units, n, head_dim), f32))


def verify_row_groups(num_kv_heads: int, seq_lens: np.ndarray, row_count: np.ndarray, block_size: int) -> np.ndarray:
    """The row groups of a verify step whose rows are cut into the parts one-row decodes of their positions would be
    cut into (split_parts of the same sequences): [G, 3] int64 (first row index r0, rows, splits), consecutive row
    indexes that share splits and, where the context is cut, every sequence's block count. Each group is one
    paged_verify_attention call (paged_verify_groups), so a row's sums are a decode's to the last bit; a context
    cut into parts (one or two sequences) makes a second group where a step's rows cross a block's end."""
    work, groups, last = len(seq_lens) * num_kv_heads, [], None
    for r in range(int(row_count.max())):
        lens = seq_lens + r
        splits = split_parts(work, lens, block_size)
        key = (splits, tuple((lens + block_size - 1) // block_size)) if splits > 1 else (1,)
        if key == last:
            groups[-1][1] += 1
        else:
            groups.append([r, 1, splits])
            last = key
    return np.array(groups, np.int64).reshape(-1, 3)


@njit(cache=True, nogil=True)
def paged_verify_groups(q, k_cache, v_cache, block_tables, seq_lens, row_first, row_count, scale, out, lse, qs,
                        scores, kb, vb, m, l, acc, groups):
    """paged_verify_attention once per row group (verify_row_groups): group (r0, rows, splits) takes each
    sequence's rows r0 .. r0 + rows - 1 (those it has), with the scratch's first work * splits units."""
    work = seq_lens.shape[0] * k_cache.shape[1]
    for g in range(groups.shape[0]):
        r0, rows, units = groups[g, 0], groups[g, 1], work * groups[g, 2]
        counts = np.minimum(np.maximum(row_count - r0, 0), rows).astype(np.int32)
        paged_verify_attention(q, k_cache, v_cache, block_tables, (seq_lens + r0).astype(np.int32),
                               (row_first + r0).astype(np.int32), counts, scale, out, lse, qs[:units], scores[:units],
                               kb[:units], vb[:units], m[:units], l[:units], acc[:units])


def attend_rows(q, k_cache, v_cache, block_tables, seq_lens, row_first, row_count, scale, out, lse, scratch):
    """One layer's exact attention of a step's decode rows, from Numba code: paged_decode_attention (one row a
    sequence; scratch: attention_scratch as a tuple, row_first and row_count unused) or, where the scratch is
    verify_scratch's seven arrays and verify_row_groups', paged_verify_groups (rows of draft tokens; block_tables,
    seq_lens, row_first, row_count per sequence as there)."""


@overload(attend_rows, jit_options={"nogil": True})
def _attend_rows_impl(q, k_cache, v_cache, block_tables, seq_lens, row_first, row_count, scale, out, lse, scratch):
    if len(scratch) == 8:
        def verify(q, k_cache, v_cache, block_tables, seq_lens, row_first, row_count, scale, out, lse, scratch):
            paged_verify_groups(q, k_cache, v_cache, block_tables, seq_lens, row_first, row_count, scale, out, lse,
                                scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], scratch[5], scratch[6],
                                scratch[7])
        return verify

    def decode(q, k_cache, v_cache, block_tables, seq_lens, row_first, row_count, scale, out, lse, scratch):
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out, lse, scratch)
    return decode


@njit(cache=True, nogil=True, inline="always")
def prefetch_rows(k_cache, v_cache, block, kvh):
    """Start loading a block's K and V rows of kv-head kvh (block_size * D values each, contiguous,
    one prefetch a 64-byte line): a sequence's blocks lie anywhere in the pool, where the hardware
    prefetchers stop at every block (oaken.prefetch_block does the same for the Oaken store). Hinted for
    L2 (prefetch_l2): one sequence at 4k-16k tokens on 2 Zen 4 cores attended 18-22 % faster than with
    lines sent to L1, where they evicted the block being read; many sequences, short contexts: the same."""
    step = _LINE // k_cache.itemsize
    for t in range(k_cache.shape[2]):
        for x in range(0, k_cache.shape[3], step):
            prefetch_l2(k_cache, (block, kvh, t, x))
            prefetch_l2(v_cache, (block, kvh, t, x))


@njit(cache=True, nogil=True, inline="always")
def part_blocks(n, block_size, splits, part):
    """The blocks [first, end) of part `part` of `splits` of an n-token context."""
    num_blocks = (n + block_size - 1) // block_size
    per = (num_blocks + splits - 1) // splits
    return min(part * per, num_blocks), min((part + 1) * per, num_blocks)


@njit(cache=True, nogil=True, inline="always")
def finish_unit(parts, m, l, out, lse, unit, splits, b, heads):
    """The end of a unit of work in the kernels' parallel loop: a context in one part (the common
    case, items enough for the threads) is normalized into out right away; parts of a context are
    joined after the loop (merge_parts). Joining every item after the loop, one part or several,
    cost 15-25 us a call at 16 x 16 tokens (against 23 us for the whole kernel before)."""
    if splits == 1:
        attend_merge(parts[unit:unit + 1], m[unit:unit + 1], l[unit:unit + 1], out[b, heads], lse[b, heads])


@njit(cache=True, nogil=True, inline="always")
def merge_parts(parts, m, l, out, lse, num_kv_heads, kv_inner=False):
    """out [B, Hq, D], lse [B, Hq] from the units' states of contexts cut into parts (see
    paged_decode_attention; a no-op with one part, finish_unit did it). On the calling thread: only
    small batches are cut, and a second parallel region costs more than the pass. Units in order
    (sequence, kv-head, part), or (sequence, part, kv-head) with kv_inner."""
    num_seqs, group = out.shape[0], out.shape[1] // num_kv_heads
    splits = parts.shape[0] // max(num_seqs * num_kv_heads, 1)
    if splits == 1:
        return
    for item in range(num_seqs * num_kv_heads):
        b, kvh = item // num_kv_heads, item % num_kv_heads
        start, step = (b * splits * num_kv_heads + kvh, num_kv_heads) if kv_inner else (item * splits, 1)
        units = slice(start, start + splits * step, step)
        heads = slice(kvh * group, (kvh + 1) * group)
        attend_merge(parts[units], m[units], l[units], out[b, heads], lse[b, heads])


_UNITS_PER_THREAD = 4  # units of work split_parts aims at: enough for the threads to end together


_PART_BLOCKS = 8  # the fewest blocks split_parts gives a part (128 tokens at block_size 16)


def split_parts(work: int, seq_lens: np.ndarray, block_size: int) -> int:
    """Into how many parts to cut each of `work` (sequence, kv-head) items of a decode. Items
    alone are too few at small batches: one sequence of SmolLM2 has 3 kv-heads, so two threads ran 2 + 1
    of them (and sixteen threads 3 of 16). A part has at least _PART_BLOCKS blocks; within that, the
    parts are as many as make the units a multiple of the threads, so that no thread runs one unit more
    than another (one sequence at 4k tokens on two threads: 9 units took 1.16x the time of 12)."""
    threads = numba.get_num_threads()
    want = -(-_UNITS_PER_THREAD * threads // max(work, 1))
    if want <= 1 or work == 0:  # items enough (the common case: no pass over seq_lens)
        return 1
    most = max(1, -(-int(seq_lens.max()) // block_size) // _PART_BLOCKS)
    splits = min(want, most)
    while work * splits % threads and splits < most:
        splits += 1
    return splits


def attention_scratch(work: int, group: int, block_size: int, head_dim: int, splits: int = 1) -> AttentionScratch:
    """The scratch for `work` (sequence, kv-head) items of the decode kernels, each cut into
    `splits` units (split_parts)."""
    units = work * splits
    f32 = np.float32
    return AttentionScratch(np.empty((units, group, block_size), f32), np.empty((units, block_size, head_dim), f32),
                            np.empty((units, block_size, head_dim), f32), np.empty((units, group), f32),
                            np.empty((units, group), f32), np.empty((units, group, head_dim), f32))
