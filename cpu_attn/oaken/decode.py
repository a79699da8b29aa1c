"""An Oaken store's rows decoded to float32, branch-free: every value as a middle one, then the
sparse entries written over their slots. For blocks still filling, MagicPIG's sampled rows, later
prefill chunks' context, and CPUs without the int16 kernels (codes.py)."""
from __future__ import annotations

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.fp16 import fp16_to_f32
from cpu_attn.llvm_ir import _F32, _I1, _I32, _I64, _I8, c_array, host_has, prefetch, splat
from cpu_attn.oaken.codec import MIDDLE_OFFSET, SEGMENT, row_entries

_LANES = 16  # sparse entries _scatter_entries decodes at once
_MASKED_ENTRIES = host_has("avx512f")
"""Whether decode_token writes sparse entries by masked gathers and scatters (_scatter_entries), which are single
instructions only with AVX-512; elsewhere by a scalar loop (_write_entries)."""


def _entries_args(out, dense, sparse) -> bool:
    """Typing check of _scatter_entries and _write_entries."""
    return c_array(out, 1, types.float32) and c_array(dense, 1, types.uint8) and c_array(sparse, 1, types.uint8)


def _entries_setup(context, builder, signature, args):
    """LLVM IR: _scatter_entries' or _write_entries' arguments -> (the addresses of out[out_at], dense[dense_at]
    and sparse[k] as i64, n, (s_lo, s_hi, s1, s2) as float32)."""
    sig = signature.args
    out_at, dense_at, k, n = (context.cast(builder, args[i], sig[i], types.intp) for i in (1, 3, 5, 6))
    data = [builder.ptrtoint(context.make_array(sig[i])(context, builder, args[i]).data, _I64) for i in (0, 2, 4)]
    scalars = tuple(context.cast(builder, a, t, types.float32) for a, t in zip(args[7:], sig[7:]))
    return (builder.add(data[0], builder.shl(out_at, _I64(2))), builder.add(data[1], dense_at), builder.add(data[2], k),
            n, scalars)


@intrinsic
def _scatter_entries(typingctx, out, out_at, dense, dense_at, sparse, k, n, s_lo, s_hi, s1, s2):
    """The sparse entries sparse[k : k + min(n, _LANES)] of one segment -> their values written into
    out[out_at + index]; the segment's nibbles start at dense[dense_at] (4-byte aligned). Entry
    bits 0-5 index, 6 outer, 7 negative; the value is base + y * step with y its dense nibble:
    inner +-y * s1, outer s_hi + y * s2 or s_lo - y * s2 (dequantize_token says it plainly).

    Numba emits no vector gather or scatter, so this is written in LLVM IR: a masked load of the
    entries, a gather of the 32-bit words that hold their nibbles, a scatter of the values (one
    instruction each with AVX-512; LLVM expands them lane by lane on CPUs without, where decode_token
    uses _write_entries instead).
    Sixteen lanes: a segment has ~9 entries at the default ratios (with eight, two passes: 5 %
    slower). Exact attention at 16 x 8k (one layer) takes 21 ms with it against 25.6 without on an
    AVX-512 Xeon, and 22.6 against 27.1 ms compiled for plain x86-64."""
    if not _entries_args(out, dense, sparse):
        return None

    def codegen(context, builder, signature, args):
        f32, i1, i8, i32, i64 = _F32, _I1, _I8, _I32, _I64
        ptr = i8.as_pointer()
        vec = lambda t: ir.VectorType(t, _LANES)
        const = lambda t, x: ir.Constant(vec(t), [x] * _LANES)

        def lanes(x):  # _LANES copies of the scalar x
            return splat(builder, x, _LANES)

        def intrinsic_fn(name, ret, params):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)

        out_base, nibbles, entries, n, (s_lo, s_hi, s1, s2) = _entries_setup(context, builder, signature, args)
        mask = builder.icmp_signed("<", ir.Constant(vec(i64), list(range(_LANES))), lanes(n))
        at = builder.inttoptr(entries, ptr)
        load = intrinsic_fn(f"llvm.masked.load.v{_LANES}i8.p0", vec(i8), [ptr, i32, vec(i1), vec(i8)])
        entry = builder.zext(builder.call(load, [at, i32(1), mask, const(i8, 0)]), vec(i32))
        j = builder.and_(entry, const(i32, 63))
        outer = builder.icmp_unsigned("!=", builder.and_(entry, const(i32, 64)), const(i32, 0))
        negative = builder.icmp_unsigned("!=", builder.and_(entry, const(i32, 128)), const(i32, 0))
        byte = builder.and_(j, const(i32, 31))  # value j's nibble: byte j % 32, high nibble for j >= 32
        shift = builder.add(builder.shl(builder.and_(byte, const(i32, 3)), const(i32, 3)),
                            builder.shl(builder.lshr(j, const(i32, 5)), const(i32, 2)))
        words = builder.add(lanes(nibbles),
                            builder.zext(builder.and_(byte, const(i32, ~3)), vec(i64)))
        gather = intrinsic_fn(f"llvm.masked.gather.v{_LANES}i32.v{_LANES}p0", vec(i32),
                              [vec(ptr), i32, vec(i1), vec(i32)])
        word = builder.call(gather, [builder.inttoptr(words, vec(ptr)), i32(4), mask, const(i32, 0)])
        y = builder.uitofp(builder.and_(builder.lshr(word, shift), const(i32, 15)), vec(f32))
        base = builder.select(outer, builder.select(negative, lanes(s_lo), lanes(s_hi)), const(f32, 0.0))
        step = builder.select(outer, lanes(s2), lanes(s1))
        value = builder.fadd(base, builder.fmul(y, builder.select(negative, builder.fneg(step), step)))
        slots = builder.add(lanes(out_base),
                            builder.shl(builder.zext(j, vec(i64)), const(i64, 2)))
        scatter = intrinsic_fn(f"llvm.masked.scatter.v{_LANES}f32.v{_LANES}p0", ir.VoidType(),
                               [vec(f32), vec(ptr), i32, vec(i1)])
        builder.call(scatter, [value, builder.inttoptr(slots, vec(ptr)), i32(4), mask])
        return context.get_dummy_value()
    return types.none(out, out_at, dense, dense_at, sparse, k, n, s_lo, s_hi, s1, s2), codegen


@intrinsic
def _write_entries(typingctx, out, out_at, dense, dense_at, sparse, k, n, s_lo, s_hi, s1, s2):
    """_scatter_entries for CPUs without AVX-512: all n entries sparse[k : k + n] of one segment,
    one scalar loop, each entry's base and step (by its group and sign bits) from a table of four.

    There _scatter_entries' masked gather and scatter have no single instruction: LLVM expands them
    lane by lane, sixteen lanes whatever the count. A row of one kv-head (64 values, ~8 entries;
    41-47 ns with none) decoded by load_row on a Zen 1 (bench_oaken_rows' sampled row): 98-102 ns
    with the masked ones, 64-66 with this loop (~12 instructions an entry, no branch but the loop's;
    a Numba loop branched on the random group and sign bits and was slower than either)."""
    if not _entries_args(out, dense, sparse):
        return None

    def codegen(context, builder, signature, args):
        f32, i8, i64 = _F32, _I8, _I64
        b = builder
        out_base, nibbles, entries, n, (s_lo, s_hi, s1, s2) = _entries_setup(context, b, signature, args)
        # (base, step) by bits 6 (outer) and 7 (negative) of an entry: inner +-y * s1, outer s_hi + y * s2 or s_lo - y * s2
        table = cgutils.alloca_once(b, ir.ArrayType(f32, 8))
        for at, x in enumerate((f32(0.0), s1, s_hi, s2, f32(0.0), b.fneg(s1), s_lo, b.fneg(s2))):
            b.store(x, b.gep(table, [_I32(0), _I32(at)]))
        with cgutils.for_range(b, n) as loop:
            e = b.zext(b.load(b.inttoptr(b.add(entries, loop.index), i8.as_pointer())), i64)
            j = b.and_(e, i64(63))
            byte = b.zext(b.load(b.inttoptr(b.add(nibbles, b.and_(e, i64(31))), i8.as_pointer())), i64)
            y = b.uitofp(b.and_(b.lshr(byte, b.and_(b.lshr(e, i64(3)), i64(4))), i64(15)), f32)  # high nibble: j >= 32
            kind = b.shl(b.lshr(e, i64(6)), i64(1))
            base, step = (b.load(b.gep(table, [i64(0), b.add(kind, i64(h))])) for h in (0, 1))
            b.store(b.fadd(base, b.fmul(y, step)), b.inttoptr(b.add(out_base, b.shl(j, i64(2))), f32.as_pointer()))
        return context.get_dummy_value()
    return types.none(out, out_at, dense, dense_at, sparse, k, n, s_lo, s_hi, s1, s2), codegen


@intrinsic
def _decode_middle(typingctx, out, dense, dense_at, s0, lo_base, hi_base):
    """Every value of out [D] decoded as a middle value from the nibbles at dense[dense_at ...]
    (D / 2 bytes; in each 64-wide segment byte j holds value j low and value j + 32 high):
    lo_base - m * s0 for a set sign bit, hi_base + m * s0 otherwise, m the nibble's low 3 bits.
    D a multiple of 64 (OakenKVStore's head_dim is).

    In LLVM IR because Numba's loop, vectorized, ran its aliasing checks and set-up again for every
    32-byte segment: here a whole segment is widened to 32-bit lanes at once, the constants in
    registers (K of 16 x 8k decoded into L1-sized blocks: 6.1 -> 5.2 ms; 4.8 with sixteen-lane scatters)."""
    if not (c_array(out, 1, types.float32) and c_array(dense, 1, types.uint8) and isinstance(dense_at, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        f32, i8, i32, i64 = _F32, _I8, _I32, _I64
        lanes = SEGMENT // 2  # a segment's bytes
        bytes_t, ints, floats = ir.VectorType(i8, lanes), ir.VectorType(i32, lanes), ir.VectorType(f32, lanes)
        sig = signature.args
        out_a = context.make_array(sig[0])(context, builder, args[0])
        dense_a = context.make_array(sig[1])(context, builder, args[1])
        (num,) = cgutils.unpack_tuple(builder, out_a.shape, 1)
        out_base = builder.ptrtoint(out_a.data, i64)
        src_base = builder.add(builder.ptrtoint(dense_a.data, i64), context.cast(builder, args[2], sig[2], types.intp))
        s0, lo_base, hi_base = (splat(builder, context.cast(builder, a, t, types.float32), lanes)
                                for a, t in zip(args[3:], sig[3:]))
        const = lambda x: ir.Constant(ints, [x] * lanes)
        with cgutils.for_range(builder, builder.udiv(num, i64(SEGMENT))) as seg:
            raw = builder.load(builder.inttoptr(builder.add(src_base, builder.mul(seg.index, i64(lanes))),
                                                bytes_t.as_pointer()), align=1)
            x = builder.zext(raw, ints)
            first = builder.add(out_base, builder.mul(seg.index, i64(4 * SEGMENT)))  # the segment's values 0 .. 31
            low, high = builder.and_(x, const(15)), builder.lshr(x, const(4))
            for nib, at in ((low, first), (high, builder.add(first, i64(4 * lanes)))):
                mag = builder.fmul(builder.uitofp(builder.and_(nib, const(7)), floats), s0)
                negative = builder.icmp_unsigned(">=", nib, const(8))
                value = builder.select(negative, builder.fsub(lo_base, mag), builder.fadd(hi_base, mag))
                builder.store(value, builder.inttoptr(at, floats.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(out, dense, dense_at, s0, lo_base, hi_base), codegen


@njit(cache=True, nogil=True, inline="always")
def decode_token(dense, scales, counts, sparse, e, thr, first_seg, out):
    """One token of one kv-head: dense [C/2], scales [3] (fp16 bits), counts [C/64] and its
    block's sparse entries from index e -> out [D] float32 (D a multiple of 64, starting at
    segment first_seg). Returns e past this token's entries.

    Both passes are branch-free (random sign and group bits would mispredict): every value is
    first decoded as a middle value, a segment at a time (_decode_middle); then the sparse entries
    overwrite their slots: with AVX-512 sixteen at a time by vector gathers and scatters
    (_scatter_entries), elsewhere in a scalar loop (_write_entries)."""
    s_lo, t_lo, t_hi, s_hi = thr[0], thr[1], thr[2], thr[3]
    half = SEGMENT // 2
    num_seg = out.shape[0] // SEGMENT
    s0 = fp16_to_f32(scales[0])
    lo_base, hi_base = t_lo - MIDDLE_OFFSET * s0, t_hi + MIDDLE_OFFSET * s0  # levels (m + offset) * step
    _decode_middle(out, dense, first_seg * half, s0, lo_base, hi_base)
    s1, s2 = fp16_to_f32(scales[1]), fp16_to_f32(scales[2])
    for seg in range(first_seg):
        e += counts[seg]
    for seg in range(num_seg):
        n = counts[first_seg + seg]
        if _MASKED_ENTRIES:
            for k in range(e, e + n, _LANES):
                _scatter_entries(out, seg * SEGMENT, dense, (first_seg + seg) * half, sparse, k, e + n - k,
                                 s_lo, s_hi, s1, s2)
        else:
            _write_entries(out, seg * SEGMENT, dense, (first_seg + seg) * half, sparse, e, n, s_lo, s_hi, s1, s2)
        e += n
    for seg in range(first_seg + num_seg, counts.shape[0]):
        e += counts[seg]
    return e


@njit(cache=True, nogil=True, inline="always")
def dequantize_block(dense, scales, counts, sparse, thr, first_seg, width, out):
    """Rows 0..width-1 of one block (dense [bs, C/2], scales [bs, 3], counts [bs, C/64],
    sparse [budget]) for one kv-head -> out [bs, D] float32; see decode_token."""
    e = 0
    for t in range(width):
        e = decode_token(dense[t], scales[t], counts[t], sparse, e, thr, first_seg, out[t])


@njit(cache=True, nogil=True, inline="always")
def load_block(parts, block, first_seg, width, out):
    """Rows 0..width-1 of `block` for one kv-head -> out [bs, D] float32. parts: records.OakenParts
    (or its plain tuple); a block still filling lives in full precision in tail[tail_of[block]]
    ([bs, C] float32); any other block is decoded (dequantize_block)."""
    dense, scales, counts, sparse, tail, tail_of, thr = parts
    slot = tail_of[block]
    if slot >= 0:
        first = first_seg * SEGMENT
        for t in range(width):
            out[t, :] = tail[slot, t, first:first + out.shape[1]]
    else:
        dequantize_block(dense[block], scales[block], counts[block], sparse[block], thr, first_seg, width, out)


@njit(cache=True, nogil=True, inline="always")
def prefetch_block(parts, block, first_seg, head_dim):
    """Start loading every line load_block will read of `block` for one kv-head: its rows' nibbles,
    scales and counts, and the block's sparse entries (the store's arrays start on a line, so a
    head's run of nibbles, head_dim / 2 bytes at a multiple of that, lies in one line per 64
    bytes). A sequence's blocks lie anywhere in the pool, so the hardware prefetchers stop at every
    block; asked for the next block ahead, the exact kernel at 8 x 32k takes ~36 ms against ~52."""
    dense, scales, counts, sparse = parts[0], parts[1], parts[2], parts[3]
    at = first_seg * (SEGMENT // 2)
    for t in range(dense.shape[1]):
        for x in range(at, at + head_dim // 2, 64):
            prefetch(dense, (block, t, x))
    for t in range(0, dense.shape[1], 4):
        prefetch(scales, (block, t, 0))
        prefetch(counts, (block, t, 0))
    for e in range(0, sparse.shape[1], 32):
        prefetch(sparse, (block, e))


@njit(cache=True, nogil=True, inline="always")
def load_row(parts, block, first_seg, offset, e, out):
    """Row `offset` of `block` for one kv-head -> out [D] float32, for a block that is not still
    filling (its rows are quantized; see load_block); e = row_entries(counts[block], offset). No tail
    check here: with it (a branch around the decoder) LLVM compiles the decoder ~2.5x slower, 100 vs
    40 ns per sampled row."""
    dense, scales, counts, sparse, _, _, thr = parts
    decode_token(dense[block, offset], scales[block, offset], counts[block, offset], sparse[block], e, thr, first_seg,
                 out)


@njit(cache=True, nogil=True, parallel=True)
def dequantize_blocks(parts, blocks, num_tokens, out):
    """First num_tokens positions of a sequence's blocks -> out [len(blocks), Hkv, block_size, D]
    float32 (the context of a later prefill chunk); rows past num_tokens are left unset.
    parts as in load_block."""
    num_kv_heads, head_dim, block_size = out.shape[1], out.shape[3], parts[0].shape[1]
    for item in prange(blocks.shape[0] * num_kv_heads):
        j, kvh = item // num_kv_heads, item % num_kv_heads
        load_block(parts, blocks[j], kvh * head_dim // SEGMENT, min(block_size, num_tokens - j * block_size),
                   out[j, kvh])
