"""The Oaken paged store and the 4-bit baselines: storage against NumPy references, attention
over the quantized store against exact attention, byte accounting, bad values."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from cpu_attn.calibrate import SPARSE_FRACTION, hadamard, rotate
from cpu_attn import kv_store, oaken
from cpu_attn.kernels import split_parts
from cpu_attn.kv_store import KV_FORMATS, OakenKVStore, PagedKVStore, SimQuantKVStore, bytes_per_block, make_store
from cpu_attn.oaken import INNER, MIDDLE, OUTER, dequantize, quantize
from cpu_attn.oaken.decode import _scatter_entries, _write_entries
from cpu_attn.oaken.turn import _turn_all, _turn_few
from tests.test_cpu_attn import naive_attention
from tests.test_oaken import decoded_groups, reference_groups

THR = np.array([-2.0, -0.1, 0.1, 2.0], np.float32)


def oaken_store(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, num_blocks=40, sparse_fraction=SPARSE_FRACTION,
                key_scales=None, recent_blocks=0, **transforms):
    """An Oaken store whose exact kernel decodes every row to floats (int_dots off), so that tests can
    hold it tightly to references; test_oaken_decode_attention checks the int16 dot products."""
    thresholds = np.tile(THR, (num_layers, 2, 1))
    store = OakenKVStore(num_layers, num_kv_heads, head_dim, block_size, num_blocks, thresholds, sparse_fraction,
                         key_scales, recent_blocks, **transforms)
    store.int_dots = False
    return store


def write_sequences(store, rng, seq_lens, layer=0, prefill=None, scale=1.0, offset=0.0, rope_inv_freq=None):
    """Random K/V per sequence into shuffled blocks: a prefill chunk, then one token at a time.
    offset: added to every key (real keys have per-channel offsets before RoPE), turned to each
    key's position by rope_inv_freq when given."""
    bs, free = store.block_size, list(rng.permutation(store.num_blocks))
    tables, kv = [], []
    for n in seq_lens:
        table = np.array([free.pop() for _ in range(-(-n // bs))])
        k, v = (rng.standard_normal((2, n, store.num_kv_heads, store.head_dim)) * scale).astype(np.float32)
        k[:, :, 5] *= 6  # a heavy channel, as real keys have
        pos = np.arange(n)
        k += offset if rope_inv_freq is None else rotate(np.broadcast_to(offset, k.shape[1:])[None], rope_inv_freq, pos)
        slots = (table[pos // bs] * bs + pos % bs).astype(np.int64)
        first = n // 2 if prefill is None else min(prefill, n)
        store.write(layer, slots[:first], k[:first], v[:first], pos[:first])
        for t in range(first, n):
            store.write(layer, slots[t:t + 1], k[t:t + 1], v[t:t + 1], pos[t:t + 1])
        tables.append(table)
        kv.append((k, v))
    width = max(len(t) for t in tables)
    block_tables = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t
    return block_tables, kv


def reference_roundtrip(x):
    """What the store should hold for x [T, Hkv, D]: the per-token quantizer's round trip."""
    flat = x.reshape(len(x), x.shape[1] * x.shape[2])
    return dequantize(THR, *quantize(flat, THR)[:4]).reshape(x.shape)


def test_oaken_store_built_in_a_one_thread_context_serves_every_kernel_thread():
    """Numba's thread count belongs to the calling thread: the Ray attention actor built its store
    after set_num_threads(1) and wrote from its channel thread with the full pool, so kernels
    indexed one row of per-thread scratch past its end (heap corruption, SIGBUS/SIGSEGV)."""
    import threading

    import numba

    built = {}

    def build():
        numba.set_num_threads(1)
        built["store"] = oaken_store(sparse_fraction=0.5)

    t = threading.Thread(target=build)
    t.start()
    t.join()
    store = built["store"]
    assert all(len(scratch) >= numba.config.NUMBA_NUM_THREADS for scratch in store._scratch)
    rng = np.random.default_rng(3)
    tables, kv = write_sequences(store, rng, [33, 64, 70, 5], prefill=64)  # prefill runs go in parallel here
    for table, (k, v), n in zip(tables, kv, [33, 64, 70, 5]):
        kg, vg = store.gather(0, table, n)
        np.testing.assert_array_equal(kg, reference_roundtrip(k))
        np.testing.assert_array_equal(vg, reference_roundtrip(v))


def test_oaken_store_copies_read_only_calibration_arrays():
    """Arrays that came through Ray are read-only, and Numba types a read-only array apart: a store
    kept them and every kernel compiled a second time in each Ray attention actor (the sampled kernel
    alone 89 s on a Zen 1). The store holds writable copies, the types the kernels were cached with."""
    rng = np.random.default_rng(0)
    arrays = {"thresholds": np.tile(THR, (2, 2, 1)), "key_scales": rng.uniform(0.5, 2, (2, 192)),
              "key_bias": rng.standard_normal((2, 192)), "value_scales": rng.uniform(0.5, 2, (2, 192)),
              "rotation": hadamard(64), "rope_inv_freq": 1e4 ** -(np.arange(32) / 32)}
    for a in arrays.values():
        a.setflags(write=False)
    store = OakenKVStore(2, 3, 64, 16, 8, **arrays)
    held = [store.thresholds, store.key_scales, store.value_scales, store.key_bias, store.rotation, store._unrotation]
    assert all(a.flags.writeable and a.flags.c_contiguous and a.dtype == np.float32 for a in held)


@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (2, 128)])
def test_oaken_store_holds_the_quantizer_roundtrip(num_kv_heads, head_dim):
    rng = np.random.default_rng(0)
    store = oaken_store(num_kv_heads=num_kv_heads, head_dim=head_dim, sparse_fraction=0.5)
    tables, kv = write_sequences(store, rng, [1, 17, 40, 100])
    for table, (k, v), n in zip(tables, kv, [1, 17, 40, 100]):
        kg, vg = store.gather(0, table, n)
        np.testing.assert_array_equal(kg, reference_roundtrip(k))
        np.testing.assert_array_equal(vg, reference_roundtrip(v))
    # the realized split is what the thresholds say
    counts = store.group_counts(tables[3], 100)
    k, v = kv[3]
    groups = reference_groups(np.concatenate([k.ravel(), v.ravel()]), THR)
    assert counts["sparse"] == np.count_nonzero(groups != MIDDLE)
    assert counts["outer"] == np.count_nonzero(groups == OUTER)



def test_oaken_store_decodes_segments_full_of_entries():
    """Every value of a token sparse (outer or inner, both signs: 64 entries a segment, eight
    vector scatters), next to tokens of zeros and of one entry; the store's decoder against the
    quantizer's round trip."""
    store = oaken_store(num_kv_heads=2, head_dim=64, sparse_fraction=1.0)
    rng = np.random.default_rng(5)
    x = np.zeros((4, 2, 64), np.float32)
    x[0] = rng.choice([-1, 1], (2, 64)) * rng.uniform(2.5, 6, (2, 64))  # all outer
    x[1] = rng.uniform(-0.09, 0.09, (2, 64))  # all inner
    x[3, 1, 63] = 5.0  # zeros but the last value of the last segment
    slots = np.arange(4, dtype=np.int64)
    store.write(0, slots, x, x[::-1].copy(), slots)
    k, v = store.gather(0, np.array([0]), 4)
    np.testing.assert_array_equal(k, reference_roundtrip(x))
    np.testing.assert_array_equal(v, reference_roundtrip(x[::-1].copy()))


@njit
def _write_entries_both_ways(thr, dense, sparse, counts, scales, masked, scalar):
    """Each token's sparse entries written over its rows of masked (by decode._scatter_entries, sixteen at a
    time) and of scalar (decode._write_entries, all in one loop): decode_token's two ways, one per kind of CPU."""
    for t in range(dense.shape[0]):
        e = 0
        for seg in range(counts.shape[1]):
            n = counts[t, seg]
            for k in range(e, e + n, 16):
                _scatter_entries(masked[t], seg * 64, dense[t], seg * 32, sparse[t], k, e + n - k,
                                 thr[0], thr[3], scales[t, 1], scales[t, 2])
            _write_entries(scalar[t], seg * 64, dense[t], seg * 32, sparse[t], e, n,
                           thr[0], thr[3], scales[t, 1], scales[t, 2])
            e += n


def test_both_ways_of_writing_sparse_entries_match_the_quantizer():
    """decode_token writes sparse entries by masked gathers and scatters with AVX-512 and by a scalar
    loop elsewhere; this host runs one in its kernels, so both are checked here: from 0 to 64 entries
    a segment (all outer, all inner, both signs), each value as dequantize_token gives it, the middle
    values around them left alone."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    x[0] = rng.choice([-1, 1], 128) * rng.uniform(2.5, 6, 128)  # all outer
    x[1] = rng.uniform(-0.09, 0.09, 128)  # all inner
    x[2] = 0.0  # zeros: inner
    x[3, :64] = rng.uniform(-0.09, 0.09, 64)  # one segment full, the next ordinary
    x[4, :64] = rng.choice([-1, 1], 64) * rng.uniform(0.5, 1.5, 64)  # a segment without entries
    dense, sparse, counts, scales, _ = quantize(x, THR)
    want = dequantize(THR, dense, sparse, counts, scales)
    assert counts.max() == 64 and counts.min() == 0
    middle = reference_groups(x, THR) == MIDDLE
    masked, scalar = (np.where(middle, want, np.float32(np.nan)).astype(np.float32) for _ in range(2))
    _write_entries_both_ways(THR, dense, sparse, counts, scales, masked, scalar)
    np.testing.assert_array_equal(masked, want)
    np.testing.assert_array_equal(scalar, want)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_int16_dots_with_segments_full_of_entries(head_dim):
    """The int16 dot products (oaken.vnni_block_scores, vnni_add_weighted_rows) on full blocks of K
    and V whose rows have every value sparse (64 entries a segment: four passes of sixteen), none, or one, next to ordinary rows:
    attention as over the dequantized keys, within the int16 rounding."""
    if not oaken.INT16:
        pytest.skip("no AVX2 here (or NUMBA_CPU_NAME set)")
    store = oaken_store(num_kv_heads=2, head_dim=head_dim, sparse_fraction=1.0)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((48, 2, head_dim)).astype(np.float32)
    x[::5] = rng.choice([-1, 1], (10, 2, head_dim)) * rng.uniform(2.5, 6, (10, 2, head_dim))  # all outer
    x[1::5] = rng.uniform(-0.09, 0.09, (10, 2, head_dim))  # all inner
    x[2::7] = 0.0
    x[2::7, 1, -1] = 5.0  # zeros but one outer value
    slots = np.arange(48, dtype=np.int64)
    store.write(0, slots, x, rng.standard_normal(x.shape).astype(np.float32), slots)
    q = rng.standard_normal((1, 6, head_dim)).astype(np.float32)
    table, lens = np.arange(3, dtype=np.int32)[None], np.array([48], np.int32)
    store.int_dots = True
    out, lse = store.decode_attention(0, q, table, lens, head_dim**-0.5)
    k, v = store.gather(0, table[0], 48)
    ref_out, ref_lse = naive_attention(q[0], k, v, head_dim**-0.5)
    np.testing.assert_allclose(out[0], ref_out, atol=1e-3 * np.abs(ref_out).max())
    np.testing.assert_allclose(lse[0], ref_lse, atol=1e-3)


@njit
def _int16_kernels(kind, s, qi, qscale, acc, out, w, dense, scales, counts, sparse, thr):
    """One full block through either family of int16 kernels: scores into s, weighted values into out."""
    if kind == 0:
        oaken.vnni_block_scores(s, qi, qscale, dense, scales, counts, sparse, thr, np.float32(0.125), acc)
        oaken.vnni_add_weighted_rows(out, w, dense, scales, counts, sparse, thr)
    else:
        oaken.avx2_block_scores(s, qi, qscale, dense, scales, counts, sparse, thr, np.float32(0.125), acc)
        oaken.avx2_add_weighted_rows(out, w, dense, scales, counts, sparse, thr)


@pytest.mark.parametrize("kind", ["vnni", "avx2"])
@pytest.mark.parametrize("num_kv_heads,head_dim,num_heads", [(3, 64, 9), (2, 128, 4)])
def test_int16_kernels_against_numpy(kind, num_kv_heads, head_dim, num_heads):
    """oaken.{vnni,avx2}_block_scores and _add_weighted_rows on one block quantized by oaken.quantize,
    against NumPy on its dequantized rows: q.k within 2e-4 of the largest score (rows and queries in
    int16 codes of 1 / 16383 of their largest value), p.v within 1e-3 of the largest output (weights in
    1 / 8191). Rows with no entries, some, and every value sparse (64 a segment: past the AVX2
    kernels' eight without a branch)."""
    if not (oaken.VNNI if kind == "vnni" else oaken.AVX2):
        pytest.skip(f"no {kind} here (or NUMBA_CPU_NAME set)")
    rng = np.random.default_rng(15)
    c = num_kv_heads * head_dim
    x = rng.standard_normal((2, oaken.ROWS, c)).astype(np.float32)
    x[:, 3] = rng.choice([-1, 1], c) * rng.uniform(2.5, 6, c)  # all outer
    x[:, 4] = rng.uniform(-0.09, 0.09, c)  # all inner
    x[:, 5] = 0.0  # all middle
    q = rng.standard_normal((num_heads, head_dim)).astype(np.float32)
    qi, qscale = oaken.query_codes(q)
    w = rng.random((num_heads, oaken.ROWS)).astype(np.float32)
    group = num_heads // num_kv_heads
    heads = lambda rows: rows.reshape(oaken.ROWS, num_kv_heads, head_dim).repeat(group, axis=1)  # [16, Hq, D]
    parts = []
    for rows in x:  # K, then V
        dense, sparse, counts, scales, n = quantize(rows, THR)
        entries = np.zeros(int(n.sum()) + 64, np.uint8)  # the block's entries in row order, then slack
        entries[:n.sum()] = np.concatenate([sparse[t, :n[t]] for t in range(oaken.ROWS)])
        parts.append(((dense, scales.astype(np.float16).view(np.uint16), counts, entries, THR),
                      dequantize(THR, dense, sparse, counts, scales)))
    (k_parts, k_ref), (v_parts, v_ref) = parts
    assert np.abs(k_ref[3]).min() > 2 and np.abs(k_ref[5]).max() < 2  # the rows are what they say
    code = 0 if kind == "vnni" else 1
    s, out = np.zeros((num_heads, oaken.ROWS), np.float32), np.zeros((num_heads, head_dim), np.float32)
    acc = np.zeros((num_heads, oaken.ROWS, 16), np.float32)
    _int16_kernels(code, s, qi, qscale, acc, np.zeros_like(out), w, *k_parts)  # q.k on K's block
    _int16_kernels(code, np.zeros_like(s), qi, qscale, acc, out, w, *v_parts)  # p.v on V's
    ref_s = 0.125 * np.einsum("thd,hd->ht", heads(k_ref), q)
    np.testing.assert_allclose(s, ref_s, atol=2e-4 * np.abs(ref_s).max())
    ref_out = np.einsum("ht,thd->hd", w, heads(v_ref))
    np.testing.assert_allclose(out, ref_out, atol=1e-3 * np.abs(ref_out).max())


def channel_transforms(rng, num_kv_heads, head_dim, kinds):
    """Store transforms as calibrate finds them for write_sequences' keys (heavy channel 5 of
    every head, offset by `bias`), plus random value scales."""
    c = num_kv_heads * head_dim
    out = {}
    if "smooth" in kinds:
        s = np.ones((2, num_kv_heads, head_dim), np.float32)
        s[:, :, 5] = 6
        out["key_scales"] = s.reshape(2, c)
    if "bias" in kinds:
        out["key_bias"] = rng.uniform(-3, 3, (2, c)).astype(np.float32)
        out["rope_inv_freq"] = 10000.0 ** -(np.arange(head_dim // 2) * 2 / head_dim)
        out["value_scales"] = rng.uniform(0.8, 1.25, (2, c)).astype(np.float32)
    if "rotate" in kinds:
        out["rotation"] = hadamard(head_dim, seed=3)
    return out


@pytest.mark.parametrize("transforms", [(), ("smooth",), ("smooth", "bias"), ("bias", "rotate"), ("smooth", "bias", "rotate")])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,int_dots",
                         [(9, 3, 64, 16, False), (9, 3, 64, 16, True), (4, 2, 128, 16, True), (4, 2, 128, 8, False),
                          (2, 1, 64, 1, False)])
def test_oaken_decode_attention(num_heads, num_kv_heads, head_dim, block_size, int_dots, transforms):
    """int_dots: full blocks in int16 dot products (oaken.vnni_block_scores for q.k, rows and queries
    rounded to 1 / 16383 of their largest value; vnni_add_weighted_rows for p.v, weights rounded to
    1 / 8191 of the block's largest): outputs move by up to ~1e-4 of their largest value (measured
    <= 3.3e-4 here), so the bound against the dequantized values is looser."""
    if int_dots and not oaken.INT16:
        pytest.skip("no AVX2 here (or NUMBA_CPU_NAME set)")
    rng = np.random.default_rng(1)
    seq_lens = [1, 20, 77, 200]
    # per-channel transforms: the store keeps (K - R(p) b) / s and V / s_v (each head times the
    # rotation H when it has one), scales q by s (and turns it by H), adds q . R(p) b to each
    # score, turns outputs back and scales them by s_v; attention (output and lse) must not change
    tf = channel_transforms(np.random.default_rng(2), num_kv_heads, head_dim, transforms)  # same K, V, q for all
    store = oaken_store(num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                        num_blocks=sum(-(-n // block_size) for n in seq_lens) + 3, sparse_fraction=0.5, **tf)
    offset = tf["key_bias"][0].reshape(num_kv_heads, head_dim) if "bias" in transforms else 0.0
    tables, kv = write_sequences(store, rng, seq_lens, offset=offset, rope_inv_freq=tf.get("rope_inv_freq"))
    q = rng.standard_normal((len(seq_lens), num_heads, head_dim)).astype(np.float32)
    scale = head_dim**-0.5
    store.int_dots = int_dots
    out, lse = store.decode_attention(0, q, tables, np.array(seq_lens, np.int32), scale)
    for b, n in enumerate(seq_lens):
        # tight against attention over the dequantized values: the kernel reads exactly those
        kd, vd = store.gather(0, tables[b], n)
        ref_out, ref_lse = naive_attention(q[b], kd, vd, scale)
        if int_dots:
            np.testing.assert_allclose(out[b], ref_out, atol=1e-3 * np.abs(ref_out).max())
            np.testing.assert_allclose(lse[b], ref_lse, atol=1e-3)
        else:
            np.testing.assert_allclose(out[b], ref_out, atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(lse[b], ref_lse, atol=2e-5, rtol=1e-5)
        # against full precision: 4/5-bit error, a few percent of the output's spread (up to 0.16 of
        # its largest value measured, with 128-wide heads in blocks of 16 and smoothing)
        exact, _ = naive_attention(q[b], *kv[b], scale)
        assert np.abs(out[b] - exact).max() <= 0.2 * max(np.abs(exact).max(), 0.1), b


@pytest.mark.parametrize("num_kv_heads", [8, 9])
def test_int16_dots_with_many_segments_a_row(num_kv_heads):
    """Rows of 16 and 18 segments (8 and 9 kv-heads of 128, Llama-3.1-8B's and one more): each
    row's counts are summed in a loop that LLVM vectorizes from 16 on (with a scalar tail at 18);
    every kv-head's entries must start where its segment's do."""
    if not oaken.INT16:
        pytest.skip("no AVX2 here (or NUMBA_CPU_NAME set)")
    rng = np.random.default_rng(9)
    seq_lens, head_dim = [48, 33], 128
    store = oaken_store(num_kv_heads=num_kv_heads, head_dim=head_dim, num_blocks=8, sparse_fraction=0.5)
    tables, _ = write_sequences(store, rng, seq_lens)
    q = rng.standard_normal((len(seq_lens), 2 * num_kv_heads, head_dim)).astype(np.float32)
    store.int_dots = True
    out, lse = store.decode_attention(0, q, tables, np.array(seq_lens, np.int32), head_dim**-0.5)
    for b, n in enumerate(seq_lens):
        k, v = store.gather(0, tables[b], n)
        ref_out, ref_lse = naive_attention(q[b], k, v, head_dim**-0.5)
        np.testing.assert_allclose(out[b], ref_out, atol=1e-3 * np.abs(ref_out).max())
        np.testing.assert_allclose(lse[b], ref_lse, atol=1e-3)


def test_int16_dots_with_contexts_cut_into_parts():
    """Contexts long enough to be cut into parts (split_parts by sequences): each task runs every
    kv-head of its blocks, and the parts of each (sequence, kv-head) are merged after the loop."""
    if not oaken.INT16:
        pytest.skip("no AVX2 here (or NUMBA_CPU_NAME set)")
    rng = np.random.default_rng(11)
    seq_lens = [1100, 1500]
    assert split_parts(len(seq_lens), np.array(seq_lens), 16) > 1
    tf = channel_transforms(np.random.default_rng(2), 3, 64, ("bias", "rotate"))
    store = oaken_store(num_blocks=sum(-(-n // 16) for n in seq_lens) + 2, **tf)
    tables, _ = write_sequences(store, rng, seq_lens, offset=tf["key_bias"][0].reshape(3, 64),
                                rope_inv_freq=tf["rope_inv_freq"])
    q = rng.standard_normal((len(seq_lens), 9, 64)).astype(np.float32)
    store.int_dots = True
    out, lse = store.decode_attention(0, q, tables, np.array(seq_lens, np.int32), 0.125)
    for b, n in enumerate(seq_lens):
        ref_out, ref_lse = naive_attention(q[b], *store.gather(0, tables[b], n), 0.125)
        np.testing.assert_allclose(out[b], ref_out, atol=1e-3 * np.abs(ref_out).max())
        np.testing.assert_allclose(lse[b], ref_lse, atol=1e-3)


def test_center_codes_against_numpy():
    """The keys' center terms A, B turned to block j's start and rounded to int16 codes, as NumPy
    computes A c + B s and B c - A s in float32 (center_codes, in LLVM IR)."""
    rng = np.random.default_rng(13)
    qc = rng.standard_normal((3, 128)).astype(np.float32)
    cos_b, sin_b = rng.standard_normal((2, 6, 64)).astype(np.float32)
    inv = np.array([100.0, 3000.0, 7.5], np.float32)
    got = np.empty((3, 128), np.int16)
    for j in (0, 5):
        oaken.center_codes(qc, (cos_b, sin_b), j, inv, got)
        a, b, c, t = qc[:, :64], qc[:, 64:], cos_b[j], sin_b[j]
        turned = np.concatenate([a * c + b * t, b * c - a * t], -1)
        want = np.rint(turned * inv[:, None]).astype(np.int16)
        assert np.array_equal(got, want), j


def test_key_center_turns_with_the_position():
    """Keys that are a large pre-RoPE mean turned to their position plus small noise: the store
    keeps only the noise (so its quantization error is the noise's, not the mean's), gives the keys
    back, and a write without positions is refused."""
    rng = np.random.default_rng(5)
    inv_freq = 10000.0 ** -(np.arange(32) * 2 / 64)
    bias = rng.uniform(-20, 20, (3, 64)).astype(np.float32)
    store = oaken_store(key_bias=np.tile(bias.reshape(1, -1), (2, 1)), rope_inv_freq=inv_freq, sparse_fraction=0.5,
                        num_blocks=200)
    pos = np.arange(3000, 3100)  # past the first table size, so the RoPE tables grow
    k = rotate(bias[None], inv_freq, pos) + 0.5 * rng.standard_normal((100, 3, 64)).astype(np.float32)
    slots, table = pos, np.arange(200)  # block j holds positions 16 j ..
    store.write(0, slots, k, k, pos)
    stored = store.gather(0, table, 3100)[0][3000:]
    noise = np.abs(k - rotate(bias[None], inv_freq, pos)).mean()
    assert np.abs(stored - k).mean() < 0.15 * noise  # 4/5-bit error on the noise alone (measured 0.09)
    # a fixed (unturned) center would leave the turning part in the stored values
    fixed = oaken_store(key_bias=np.tile(bias.reshape(1, -1), (2, 1)), sparse_fraction=0.5, num_blocks=200)
    fixed.write(0, slots, k, k, pos)
    assert np.abs(fixed.gather(0, table, 3100)[0][3000:] - k).mean() > noise  # (measured 2.1)
    with pytest.raises(ValueError, match="positions"):
        store.write(0, slots, k, k)


@pytest.mark.parametrize("dim", [48, 64, 128])
def test_turned_rows_are_numpys_sums_in_order(dim):
    """turn_rows (every path that rotates: queries, outputs, prefill and decode writes) against NumPy
    adding rows[e] * matrix[e] in float32 in order of e, bit for bit: at 64 and 128 the sums run in
    registers (_turn_row), at 48 in the plain loop; on one thread and on all (turn_heads picks by size) alike."""
    rng = np.random.default_rng(11)
    matrix = hadamard(dim) if dim % 64 == 0 else rng.standard_normal((dim, dim)).astype(np.float32)
    x = (rng.standard_normal((37, 2 * dim)) * np.logspace(-3, 3, 37)[:, None]).astype(np.float32)
    want = np.zeros((37, 2, dim), np.float32)
    for e in range(dim):
        want = want + x.reshape(37, 2, dim)[:, :, e, None] * matrix[e]
    for turn in (_turn_few, _turn_all, oaken.turn_heads):
        got = x.copy()
        turn(got, matrix)
        assert np.array_equal(got, want.reshape(37, 2 * dim))
    assert np.allclose(want, x.reshape(37, 2, dim).astype(np.float64) @ matrix, rtol=1e-5, atol=1e-5 * np.abs(x).max())


def test_query_codes_and_center_terms_against_numpy():
    """The decode step's query codes (|codes| <= CODE_MAX, ties to even as np.rint) and the keys' center
    terms A_i = q_i c_i + q_i+D/2 c_i+D/2 (B with rotate_half(c)) as NumPy computes them."""
    rng = np.random.default_rng(12)
    q = (rng.standard_normal((4, 9, 64)) * rng.choice([1e-3, 1.0, 1e3], (4, 9, 1))).astype(np.float32)
    q[0, 0] = 0.0
    q[1, 1] = 0.0
    q[1, 1, :4] = [oaken.CODE_MAX, 2.5, -3.5, 0.5]  # scale 1: ties
    codes, scales = oaken.query_codes(q)
    top = np.maximum(np.abs(q).max(-1), np.float32(1e-30))
    want_scales = (top / np.float32(oaken.CODE_MAX)).astype(np.float32)
    assert np.array_equal(scales, want_scales)
    assert np.array_equal(codes, np.rint(q / want_scales[..., None]).astype(np.int16))
    assert np.abs(codes).max() <= oaken.CODE_MAX and not codes[0, 0].any()
    assert list(codes[1, 1, :4]) == [oaken.CODE_MAX, 2, -4, 0]
    center = rng.standard_normal((3, 2, 64)).astype(np.float32)
    got = np.empty_like(q)
    oaken.center_terms(q, center, got)
    c = center[np.arange(9) // 3]  # [Hq, 2, D]: each query head's kv-head
    terms = [q * c[None, :, i] for i in (0, 1)]
    assert np.array_equal(got, np.concatenate([t[..., :32] + t[..., 32:] for t in terms], -1))


def test_rotation_spreads_a_heavy_channel():
    """Keys with one channel 6x the others (write_sequences): its values land in the outer group
    or stretch the token's middle scale. Turned by the Hadamard rotation, every channel carries a
    share of it and the keys, turned back by gather, come back closer (mean error 0.0553 plain,
    0.0503 rotated, with these fixed thresholds; on SmolLM2's keys the rotation cut KL by a third)."""
    errors = []
    for kinds in ((), ("rotate",)):
        store = oaken_store(sparse_fraction=0.5, **channel_transforms(None, 3, 64, kinds))
        tables, kv = write_sequences(store, np.random.default_rng(6), [150, 90])
        errors.append(np.mean([np.abs(store.gather(0, t, len(k))[0] - k).mean() for t, (k, _) in zip(tables, kv)]))
    assert errors[1] < 0.95 * errors[0], errors
    with pytest.raises(ValueError, match="rotation"):
        oaken_store(rotation=np.eye(32, dtype=np.float32))


@pytest.mark.parametrize("recent_blocks,exact_tails", [(4, [0, 1, 2, 3]), (1, [3]), (2, [2, 3])])
def test_filling_blocks_stay_exact_in_tails(recent_blocks, exact_tails):
    """Each sequence's last, partly filled block is exact while it holds a tail slot; with fewer
    slots than sequences the least recently written tails are quantized early; full blocks are
    always the quantizer's round trip, and attention reads whichever form a block is in."""
    rng = np.random.default_rng(4)
    seq_lens = [1, 17, 40, 100]
    smooth = np.ones((2, 3 * 64), np.float32)
    smooth[:, 5::64] = 6
    store = oaken_store(recent_blocks=recent_blocks, key_scales=smooth, sparse_fraction=0.5)  # no demotion
    tables, kv = write_sequences(store, rng, seq_lens)
    q = rng.standard_normal((4, 9, 64)).astype(np.float32)
    out, lse = store.decode_attention(0, q, tables, np.array(seq_lens, np.int32), 0.125)
    for b, ((k, v), n) in enumerate(zip(kv, seq_lens)):
        kg, vg = store.gather(0, tables[b], n)
        full = n // 16 * 16
        np.testing.assert_allclose(kg[:full], reference_roundtrip(k[:full] / smooth[0].reshape(3, 64)) *
                                   smooth[0].reshape(3, 64), rtol=1e-6)
        np.testing.assert_array_equal(vg[:full], reference_roundtrip(v[:full]))
        if b in exact_tails:
            np.testing.assert_allclose(kg[full:], k[full:], rtol=1e-6)
            np.testing.assert_array_equal(vg[full:], v[full:])
        else:
            np.testing.assert_array_equal(vg[full:], reference_roundtrip(v[full:]))
        ref_out, ref_lse = naive_attention(q[b], kg, vg, 0.125)
        np.testing.assert_allclose(out[b], ref_out, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(lse[b], ref_lse, atol=2e-5, rtol=1e-5)
    # finishing the blocks quantizes the tails and frees their slots
    for b, n in enumerate(seq_lens):
        rest = -n % 16
        slots = (tables[b][(n - 1) // 16] * 16 + np.arange(16 - rest, 16)).astype(np.int64)
        x = rng.standard_normal((rest, 3, 64)).astype(np.float32)
        store.write(0, slots, x, x)
    assert (store.tail_of[0] < 0).all() and (store.tail_block[0] < 0).all()
    for b, ((k, v), n) in enumerate(zip(kv, seq_lens)):
        np.testing.assert_array_equal(store.gather(0, tables[b], n)[1], reference_roundtrip(v))


@pytest.mark.parametrize("rotated", [False, True])
def test_decode_rows_in_one_kernel_equal_the_numpy_path(monkeypatch, rotated):
    """A batch of decode rows (centered, smoothed keys), each in a block of its own, takes oaken.write_decode_rows:
    the store ends bit for bit as the NumPy path leaves it, with rows that go on filling a tail, fill it (the block
    quantized), start a block (a free slot, or the oldest one flushed: two slots for three sequences) or land in a
    block quantized in part; a NaN anywhere is refused with nothing written. With a rotation too."""
    rng = np.random.default_rng(7)
    c = 3 * 64
    transforms = dict(key_bias=rng.standard_normal((2, c)).astype(np.float32),
                      value_scales=rng.uniform(0.5, 2, (2, c)).astype(np.float32),
                      rope_inv_freq=10000.0 ** -(np.arange(32) / 32), rotation=hadamard(64) if rotated else None)
    key_scales = rng.uniform(0.5, 2, (2, c)).astype(np.float32)
    stores = [oaken_store(recent_blocks=2, key_scales=key_scales, **transforms) for _ in range(2)]
    calls = []
    fast = OakenKVStore._write_decode_rows
    monkeypatch.setattr(OakenKVStore, "_write_decode_rows", lambda self, *a: self is stores[0] and
                        calls.append(fast(self, *a)) is None and calls[-1])
    tables = np.array([[0, 1, 2], [5, 6, 7], [9, 10, 11]])
    starts = np.array([3, 14, 29])  # the third sequence fills its second block, then starts its third
    for b, n in enumerate(starts):
        pos = np.arange(n)
        x = rng.standard_normal((2, n, 3, 64)).astype(np.float32)
        for store in stores:
            store.write(1, tables[b][pos // 16] * 16 + pos % 16, x[0], x[1], pos)
    calls.clear()
    for step in range(6):
        pos = starts + step
        slots = tables[np.arange(3), pos // 16] * 16 + pos % 16
        k, v = rng.standard_normal((2, 3, 3, 64)).astype(np.float32)
        for store in stores:
            store.write(1, slots, k, v, pos)
    assert calls == [True] * 6
    for name in ("tail", "tail_of", "tail_block", "tail_len", "tail_stamp", "dense", "scales", "counts", "sparse"):
        np.testing.assert_array_equal(getattr(stores[0], name), getattr(stores[1], name), err_msg=name)
    assert stores[0]._writes == stores[1]._writes
    before = stores[0].tail.copy()
    k[2, 1, 7] = np.inf
    with pytest.raises(ValueError, match="NaN or inf in 1 token"):
        stores[0].write(1, slots + 1, k, v, pos + 1)
    np.testing.assert_array_equal(stores[0].tail, before)


def test_full_sparse_budget_demotes_values_nearest_the_middle():
    rng = np.random.default_rng(2)
    store = oaken_store(num_kv_heads=1, head_dim=64, block_size=4, num_blocks=4, sparse_fraction=0.1)  # 26 entries
    k = np.zeros((4, 1, 64), np.float32)
    k[0, 0] = rng.choice([-3.0, 3.0], 64) * rng.uniform(1, 2, 64)  # token 0: all outer, more than the budget
    k[1:, 0] = rng.uniform(-0.09, 0.09, (3, 64))  # then all inner: no room left
    store.write(0, np.arange(4, dtype=np.int64), k, k)
    assert store.counts[0, 0, 0].sum() == store.budget == 26
    kd, _ = store.gather(0, [0], 4)
    groups = decoded_groups(*(a.reshape(4, -1) for a in (store.dense[0, 0, 0], store.sparse[0, 0, 0:1].repeat(4, 0),
                                                          store.counts[0, 0, 0])))
    assert (groups[0] != MIDDLE).sum() == 26  # token 0 kept the 26 values farthest from the middle
    kept = np.sort(np.abs(k[0, 0]))[-26:]
    assert np.abs(k[0, 0, groups[0] == OUTER]).min() >= kept.min() - 1e-6
    # demoted outer values become middle values with a larger scale: bounded, not clipped
    assert np.abs(kd[0] - k[0]).max() <= np.abs(k[0]).max() / 7
    # demoted inner values land on the nearer inner threshold: error <= the inner band
    assert np.abs(kd[1:] - k[1:]).max() <= 0.1 + 0.09 + 1e-6
    assert (groups[1:] == INNER).sum() == 0


def test_bad_values_and_shapes_are_rejected():
    store = oaken_store()
    k = np.zeros((2, 3, 64), np.float32)
    k[1, 0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        store.write(1, np.array([0, 1]), k, np.zeros_like(k))
    with pytest.raises(ValueError, match="multiple of 64"):
        OakenKVStore(1, 2, 32, 16, 4, np.zeros((1, 2, 4), np.float32))
    with pytest.raises(ValueError, match="thresholds"):
        OakenKVStore(2, 2, 64, 16, 4, np.zeros((1, 2, 4), np.float32))
    with pytest.raises(ValueError, match="needs calibrated thresholds"):
        make_store("oaken", 1, 1, 64, 16, 4)
    with pytest.raises(ValueError, match="kv_format must be one of"):
        make_store("int3", 1, 1, 64, 16, 4)


def test_bytes_per_block_is_what_the_arrays_take():
    store = oaken_store(num_layers=30, num_blocks=7)
    total = store.dense.nbytes + store.scales.nbytes + store.counts.nbytes + store.sparse.nbytes
    assert bytes_per_block("oaken", 30, 3, 64, 16) * 7 == total
    # SmolLM2 shape: 4 bits + scales + counts + 12.5 % sparse entries (the default budget) = 5.375 bits per value
    assert bytes_per_block("oaken", 30, 3, 64, 16) * 8 / (2 * 30 * 16 * 192) == 5.375
    assert bytes_per_block("fp16", 30, 3, 64, 16) == PagedKVStore.bytes_per_block(30, 3, 64, 16, "float16")


@pytest.mark.parametrize("kv_format", ["oaken", "fp16"])
def test_contexts_cut_into_parts_give_the_same_attention(monkeypatch, kv_format):
    """A context cut into parts (split_parts: more units of work than items at small batches),
    each part's softmax state joined at the end, gives what one pass gives; parts past a short
    sequence's end are empty."""
    rng = np.random.default_rng(11)
    lens = [1, 40, 700]
    store = oaken_store(num_layers=1, num_blocks=64) if kv_format == "oaken" else PagedKVStore(1, 3, 64, 16, 64)
    tables, _ = write_sequences(store, rng, lens)
    block_tables = np.zeros((3, max(map(len, tables))), np.int32)
    for b, t in enumerate(tables):
        block_tables[b, :len(t)] = t
    q = rng.standard_normal((3, 9, 64)).astype(np.float32)
    seq_lens = np.array(lens, np.int32)
    outs = {}
    for splits in (1, 3, 7):
        monkeypatch.setattr(kv_store, "split_parts", lambda work, seq_lens, block_size: splits)
        outs[splits] = store.decode_attention(0, q, block_tables, seq_lens, 0.125)
    for splits in (3, 7):
        np.testing.assert_allclose(outs[splits][0], outs[1][0], atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(outs[splits][1], outs[1][1], atol=1e-6, rtol=1e-6)
    for b, n in enumerate(lens):
        k, v = store.gather(0, tables[b], n)
        ref_out, ref_lse = naive_attention(q[b], k, v, 0.125)
        np.testing.assert_allclose(outs[7][0][b], ref_out, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(outs[7][1][b], ref_lse, atol=2e-5, rtol=1e-5)


def test_split_parts_fills_the_threads_at_small_batches():
    assert split_parts(3, np.array([32768]), 16) > 1  # one sequence, 3 kv-heads: 3 items for the threads
    assert split_parts(3, np.array([100]), 16) == 1  # too short to be worth cutting
    assert split_parts(3 * 512, np.array([32768] * 512), 16) == 1  # items enough


def test_stores_start_on_a_cache_line():
    """The kernels' rows (and an Oaken head's nibbles) must not straddle lines: every array the
    kernels stream starts on a 64-byte boundary, zeroed, C-contiguous, writable."""
    oaken = oaken_store(num_blocks=5, recent_blocks=2)
    paged = PagedKVStore(2, 3, 64, 16, 5, "float16")
    for a in (oaken.dense, oaken.scales, oaken.counts, oaken.sparse, oaken.tail, paged.k, paged.v):
        assert (a.size == 0 or a.ctypes.data % 64 == 0) and a.flags.c_contiguous and a.flags.writeable and not a.any()
    assert paged.k.shape == (2, 5, 3, 16, 64) and paged.k.dtype == np.uint16


def test_simulated_baselines():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 2, 64)).astype(np.float32)
    slots = np.arange(40, dtype=np.int64)
    int4 = SimQuantKVStore(1, 2, 64, 16, 4, "int4")
    int4.write(0, slots, x, x)
    k, _ = int4.gather(0, [0, 1, 2], 40)
    flat, kflat = x.reshape(40, -1), k.reshape(40, -1)
    step = (flat.max(1) - flat.min(1)) / 15
    assert (np.abs(kflat - flat).max(1) <= step / 2 * 1.01 + 2e-3).all()  # + fp16 rounding of min and scale
    assert len(np.unique(kflat[0])) <= 16
    kivi = SimQuantKVStore(1, 2, 64, 16, 4, "kivi")
    kivi.write(0, slots[:20], x[:20], x[:20])
    for t in range(20, 40):
        kivi.write(0, slots[t:t + 1], x[t:t + 1], x[t:t + 1])
    k, v = kivi.gather(0, [0, 1, 2], 40)
    np.testing.assert_array_equal(k[32:], x[32:])  # the block being filled stays exact
    assert all(len(np.unique(k[:16, 0, c])) <= 16 for c in range(64))  # keys per channel over a block
    assert all(len(np.unique(v[t, 0])) <= 16 for t in range(32))  # values per token and head
    assert np.abs(k[:32] - x[:32]).max() < 0.5 and not np.array_equal(k[:32], x[:32])
    assert int4.effective_bits() == 4 + 32 / 128 and kivi.effective_bits() == 4 + (2 + 0.5) / 2
    int5 = SimQuantKVStore(1, 2, 64, 16, 4, "int5")
    int5.write(0, slots, x, x)
    k5 = int5.gather(0, [0, 1, 2], 40)[0].reshape(40, -1)
    assert (np.abs(k5 - flat).max(1) <= step * 15 / 31 / 2 * 1.01 + 2e-3).all() and len(np.unique(k5[0])) <= 32
    assert np.abs(k5 - flat).mean() < 0.6 * np.abs(kflat - flat).mean()  # one more bit: about half the error
    assert int5.effective_bits() == 5 + 32 / 128
    assert set(KV_FORMATS) == {"oaken", "fp16", "fp32", "int4", "int5", "int6", "kivi"}
    assert SimQuantKVStore(1, 2, 64, 16, 4, "int6").effective_bits() == 6 + 32 / 128


def test_server_config_repeats_the_stores_constants():
    """server/config.py keeps numba out of the CLI's start-up, so it repeats two constants."""
    from cpu_attn import kv_store
    from server import config

    assert config.KV_FORMATS == kv_store.KV_FORMATS and config.SPARSE_FRACTION == SPARSE_FRACTION
    assert config.ServeConfig().oaken_sparse_fraction == SPARSE_FRACTION


def test_eval_exact_format_agrees_and_oaken_is_close(tmp_path):
    from cpu_attn.calibrate import calibrate, text_windows
    from gpu_model.loader import load_model
    from evaluation.evaluate import evaluate
    from tests.test_model import tiny_model_dir

    model_dir, _ = tiny_model_dir(tmp_path, head_dim=64, hidden_size=128)
    model = load_model(model_dir)
    ids = list(np.random.default_rng(4).integers(0, 101, 2000))
    cal = calibrate(model, text_windows(ids[:1000], 4, 64), progress=False)
    assert cal.rotation.shape == (64, 64) and cal.key_scales is None and cal.key_bias.shape == (2, 2 * 64)
    windows = text_windows(ids[1000:], 3, 40)
    results = evaluate(model, windows, ["fp32", "oaken", "int4"], prefill_tokens=8, batch_windows=2, block_size=4,
                       oaken_cal=cal, progress=False)
    exact, oaken, int4 = results
    assert exact["kl_mean"] == pytest.approx(0, abs=1e-9) and exact["top1_agreement"] == 1
    assert exact["top1_agreement_clear"] == 1 and 0 < exact["clear_positions_frac"] <= 1
    assert exact["ppl"] == pytest.approx(exact["ppl_ref"], rel=1e-6) and exact["effective_bits"] == 32
    assert exact["scored_positions"] == 3 * (40 - 8)
    assert 0 < oaken["kl_mean"] < int4["kl_mean"] and oaken["top1_agreement"] >= 0.9
    assert sum(oaken["group_fractions"].values()) == pytest.approx(1)
    # 2 kv-heads x 64: 4 bits + (3 scales x 16 + 2 counts x 8) / 128 + 8 per sparse entry (at most the budget);
    # the share is the calibrated ~10 % give or take what the text does (0.0996 on an AMD EPYC, > 0.1 on a Xeon)
    sparse = 1 - oaken["group_fractions"]["middle"]
    assert oaken["effective_bits"] == pytest.approx(4.5 + 8 * sparse) and 0.08 < sparse <= SPARSE_FRACTION
    with pytest.raises(ValueError, match="prefill_tokens"):
        evaluate(model, windows, ["fp16"], prefill_tokens=39)
    with pytest.raises(ValueError, match="cached_prefix_tokens"):
        evaluate(model, windows, ["fp16"], prefill_tokens=8, cached_prefix_tokens=8)
    # a prompt whose first 6 tokens came from the prefix cache: exact with fp32 KV, close with Oaken's
    exact_c, oaken_c = evaluate(model, windows, ["fp32", "oaken"], prefill_tokens=8, batch_windows=2, block_size=4,
                                oaken_cal=cal, progress=False, cached_prefix_tokens=6)
    assert exact_c["cached_prefix_tokens"] == 6 and exact_c["kl_mean"] == pytest.approx(0, abs=1e-9)
    assert exact_c["ppl"] == pytest.approx(exact["ppl"], rel=1e-5)
    assert oaken_c["kl_mean"] < 2 * oaken["kl_mean"] and oaken_c["top1_agreement"] >= 0.9
    # the prompt prefilled 3 tokens a step (8 = 3 + 3 + 2), as serve splits one past its step budget: the same
    # scores with fp32 KV (each chunk attends to the earlier ones through the store), close with Oaken's
    exact_k, oaken_k = evaluate(model, windows, ["fp32", "oaken"], prefill_tokens=8, batch_windows=2, block_size=4,
                                oaken_cal=cal, progress=False, prefill_chunk_tokens=3)
    assert exact_k["prefill_chunk_tokens"] == 3 and exact_k["kl_mean"] == pytest.approx(0, abs=1e-9)
    assert exact_k["ppl"] == pytest.approx(exact["ppl"], rel=1e-5) and exact_k["scored_positions"] == 3 * (40 - 8)
    assert oaken_k["kl_mean"] < 2 * oaken["kl_mean"] and oaken_k["top1_agreement"] >= 0.9
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        evaluate(model, windows, ["fp16"], prefill_tokens=8, prefill_chunk_tokens=-1)
    # bf16 linears scored against an fp32-linears reference: close, not equal
    bf16 = load_model(model_dir, cpu_linear_dtype="bfloat16")
    (lin,) = evaluate(bf16, windows, ["fp32"], prefill_tokens=8, batch_windows=2, block_size=4, progress=False,
                      ref_model=load_model(model_dir, cpu_linear_dtype="float32"))
    assert 0 < lin["kl_mean"] < oaken["kl_mean"] and lin["top1_agreement"] >= 0.95


def test_eval_cli_writes_json(tmp_path, capsys):
    import json

    from cpu_attn.calibrate import DEFAULT_TEXT
    from hetserve.cli import main

    if not DEFAULT_TEXT.exists():
        pytest.skip("../shared/data is not beside the project")
    out = tmp_path / "eval.json"
    assert main(["eval", "--kv-format", "fp16,int4", "--num-windows", "2", "--window-tokens", "48",
                 "--prefill-tokens", "16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for key in ("ppl", "ppl_ref", "kl_mean", "top1_agreement", "effective_bits", "kv_format", "num_windows",
                "window_tokens"):
        assert key in data
    assert data["kv_format"] == "fp16" and data["effective_bits"] == 16 and data["num_windows"] == 2
    assert [r["kv_format"] for r in data["results"]] == ["fp16", "int4"]
    assert "int4" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown --kv-format"):
        main(["eval", "--kv-format", "int3"])


def test_eval_scores_top1_at_clear_and_near_tie_positions():
    import torch

    from evaluation.evaluate import CLEAR_GAP, _Score

    # exact top-2 gaps: 1.0 (clear), 0.05 (a near-tie), 0.5 (clear); the format flips the near-tie and the last
    ref = torch.log_softmax(torch.tensor([[2.0, 1.0, -3.0], [1.0, 0.95, -3.0], [0.0, -3.0, -0.5]]), -1)
    fmt = torch.log_softmax(torch.tensor([[2.0, 1.0, -3.0], [0.9, 1.0, -3.0], [0.0, -3.0, 0.5]]), -1)
    assert CLEAR_GAP == 0.2
    sc = _Score()
    sc.add(ref, fmt, torch.tensor([0, 1, 2]))
    assert (sc.count, sc.top1, sc.clear, sc.top1_clear) == (3, 1, 2, 1)


def test_more_query_heads_than_the_int16_kernels_take():
    """Past oaken.MAX_HEADS query heads (vnni_add_weighted_rows keeps their weight codes in a fixed
    buffer) the store decodes every block to floats instead: the same attention, no overrun."""
    rng = np.random.default_rng(12)
    store = oaken_store(num_kv_heads=1, num_blocks=4)
    tables, _ = write_sequences(store, rng, [40])
    store.int_dots = oaken.INT16
    q = rng.standard_normal((1, oaken.MAX_HEADS + 4, 64)).astype(np.float32)
    out, lse = store.decode_attention(0, q, tables, np.array([40], np.int32), 0.125)
    ref_out, ref_lse = naive_attention(q[0], *store.gather(0, tables[0], 40), 0.125)
    np.testing.assert_allclose(out[0], ref_out, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse[0], ref_lse, atol=2e-5, rtol=1e-5)


def test_int16_dots_when_a_later_block_outscores_the_first_by_far():
    """A later block's scores far above the running max (by more than softmax._STALE_MAX): the int16
    path's softmax step (oaken.softmax_rows16) rescales the output and sum it has so far."""
    if not oaken.INT16:
        pytest.skip("no AVX2 here (or NUMBA_CPU_NAME set)")
    rng = np.random.default_rng(14)
    store = oaken_store(num_blocks=6)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    k = rng.standard_normal((80, 3, 64)).astype(np.float32)
    k[48:64] += 8 * q[0].reshape(3, 3, 64).mean(1)  # block 3: scores ~20 above the others
    slots = np.arange(80, dtype=np.int64)
    store.write(0, slots, k, rng.standard_normal(k.shape).astype(np.float32), slots)
    store.int_dots = True
    table = np.arange(5, dtype=np.int32)[None]
    out, lse = store.decode_attention(0, q, table, np.array([80], np.int32), 0.125)
    kd, vd = store.gather(0, table[0], 80)
    scores = q[0][:3] @ kd[:, 0].T * 0.125  # kv-head 0's queries
    assert (scores[:, 48:64].max(1) - scores[:, :48].max(1)).min() > 8
    ref_out, ref_lse = naive_attention(q[0], kd, vd, 0.125)
    np.testing.assert_allclose(out[0], ref_out, atol=1e-3 * np.abs(ref_out).max())
    np.testing.assert_allclose(lse[0], ref_lse, atol=1e-3)


@pytest.mark.parametrize("recent_blocks", [0, 4])
def test_rejected_draft_rows_leave_no_trace_in_the_oaken_store(recent_blocks):
    """Speculative steps write each sequence's token and drafts as provisional rows, then the next step writes
    again from the first rejected position. Against a store that was only ever written the accepted rows, one
    decode at a time: every accepted row's attention in the step that wrote it is that decode's, bit for bit
    (a block the drafts filled is read from its full-precision tail by the rows before the one that filled it),
    and the store reads back the same, quantized rows and tails alike; blocks that drafts filled and that
    rejections reopened included."""
    rng = np.random.default_rng(11)
    c = 3 * 64
    transforms = dict(key_bias=rng.standard_normal((2, c)).astype(np.float32),
                      rope_inv_freq=10000.0 ** -(np.arange(32) / 32))
    stores = [oaken_store(recent_blocks=recent_blocks, **transforms) for _ in range(2)]
    tables = np.array([[3, 8, 1, 12, 20, 7, 30, 33, 35], [4, 9, 2, 13, 21, 6, 31, 34, 36]], np.int32)
    total, prompt = 144, np.array([5, 13])
    kv = rng.standard_normal((2, 2, total, 3, 64)).astype(np.float32)  # [seq, k|v, position, Hkv, D]
    queries = rng.standard_normal((2, total, 9, 64)).astype(np.float32)

    def slots(b, pos):
        return tables[b][pos // 16] * 16 + pos % 16

    for store in stores:
        for b in range(2):
            pos = np.arange(prompt[b])
            store.write(1, slots(b, pos), kv[b, 0, pos], kv[b, 1, pos], pos)
    plain, spec = stores
    done = prompt.copy()  # positions written for good
    reopened = filled = 0
    while done.max() < total - 20:
        drafts = rng.integers(1, 8, 2)  # rows past the sequence's token: its drafts
        accepted = rng.integers(0, drafts + 1)
        pos = [np.arange(done[b], done[b] + drafts[b] + 1) for b in range(2)]
        k, v = (np.concatenate([kv[b, i, p] for b, p in enumerate(pos)]) for i in (0, 1))
        for b, p in enumerate(pos):  # rejected drafts' rows carry other values
            rejected = np.arange(accepted[b] + 1, len(p)) + sum(len(q) for q in pos[:b])
            k[rejected] = rng.standard_normal(k[rejected].shape).astype(np.float32) * 3
        spec.write(1, np.concatenate([slots(b, p) for b, p in enumerate(pos)]), k, v, np.concatenate(pos),
                   provisional=np.ones(len(k), bool))
        counts = drafts + 1
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
        verified, _ = spec.verify_attention(1, np.concatenate([queries[b, p] for b, p in enumerate(pos)]), tables,
                                            (done + 1).astype(np.int32), first, counts.astype(np.int32), 0.125)
        for b, p in enumerate(pos):
            filled += (p % 16 == 15).any()
            reopened += (p[accepted[b] + 1:] % 16 == 15).any()  # a rejected row had filled a block
            for j, i in enumerate(p[:accepted[b] + 1]):
                plain.write(1, slots(b, np.array([i])), kv[b, 0, [i]], kv[b, 1, [i]], np.array([i]))
                splits = split_parts(2, done + 1 + j, 16)  # as a decode step of both at this offset would cut them
                decoded, _ = plain.decode_attention(1, queries[b, [i]], tables[[b]], np.array([i + 1], np.int32),
                                                    0.125, splits)
                np.testing.assert_array_equal(verified[first[b] + j], decoded[0])
            done[b] += accepted[b] + 1
    last = [np.array([d]) for d in done]  # one more decode each settles what the drafts held
    for store in stores:
        store.write(1, np.concatenate([slots(b, p) for b, p in enumerate(last)]),
                    np.concatenate([kv[b, 0, p] for b, p in enumerate(last)]),
                    np.concatenate([kv[b, 1, p] for b, p in enumerate(last)]), np.concatenate(last))
    assert filled >= 3 and reopened >= 2
    assert not spec.held.any()
    for b in range(2):
        for x, y in zip(plain.gather(1, tables[b], done[b] + 1), spec.gather(1, tables[b], done[b] + 1)):
            np.testing.assert_array_equal(x, y)
    q = rng.standard_normal((2, 9, 64)).astype(np.float32)
    lens = (done + 1).astype(np.int32)
    for x, y in zip(plain.decode_attention(1, q, tables.astype(np.int32), lens, 0.125),
                    spec.decode_attention(1, q, tables.astype(np.int32), lens, 0.125)):
        np.testing.assert_array_equal(x, y)


def test_oaken_verify_attention_attends_each_row_as_a_decode_of_its_position():
    rng = np.random.default_rng(12)
    store = oaken_store(recent_blocks=2)
    table = np.array([[5, 2, 9, 11]], np.int32)
    pos = np.arange(40)
    store.write(0, table[0][pos // 16] * 16 + pos % 16, *rng.standard_normal((2, 40, 3, 64)).astype(np.float32))
    q = rng.standard_normal((5, 9, 64)).astype(np.float32)  # the rows of positions 35 .. 39
    out, lse = store.verify_attention(0, q, table, np.array([36], np.int32), np.array([0], np.int32),
                                      np.array([5], np.int32), 0.125)
    for i in range(5):
        o, s = store.decode_attention(0, q[i:i + 1], table, np.array([36 + i], np.int32), 0.125)
        np.testing.assert_array_equal(out[i], o[0])
        np.testing.assert_array_equal(lse[i], s[0])
