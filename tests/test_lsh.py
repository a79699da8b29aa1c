"""MagicPIG pieces against NumPy references: SimHash codes, CSR tables, candidate retrieval,
the inclusion probability u, and the sampled estimator (exact when every key has u = 1)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from cpu_attn import lsh
from cpu_attn.simhash import pack_signs_torch, simhash, simhash_matrix
from tests.test_cpu_attn import naive_attention
from tests.test_kv_formats import channel_transforms, oaken_store, write_sequences


def reference_codes(x, w, k):
    """Sign bits of x . w, table by table, bit b of table t = column t*K + b."""
    proj = x.astype(np.float64) @ w.astype(np.float64)
    num_tables = w.shape[1] // k
    codes = np.zeros(x.shape[:-1] + (num_tables,), np.int64)
    for t in range(num_tables):
        for b in range(k):
            codes[..., t] |= (proj[..., t * k + b] > 0).astype(np.int64) << b
    return codes


def test_simhash_codes_are_packed_sign_bits():
    w = simhash_matrix(64, 10, 15, seed=3)
    assert torch.equal(w, simhash_matrix(64, 10, 15, seed=3)) and w.shape == (64, 150)
    x = torch.randn(7, 3, 64)
    codes = simhash(x, w, 10)
    assert codes.dtype == torch.int32 and codes.shape == (7, 3, 15)
    np.testing.assert_array_equal(codes.numpy(), reference_codes(x.numpy(), w.numpy(), 10))
    proj = x @ w  # the accelerator's packing (torch operations) gives the same codes
    assert torch.equal(pack_signs_torch(proj, 10), codes)
    no_rows = proj[:0]  # a prefill-only step's query projections: no decode rows
    assert pack_signs_torch(no_rows, 10).shape == simhash(x[:0], w, 10).shape == (0, 3, 15)


@pytest.mark.parametrize("bits", [1, 5, 9, 13, 16])
def test_ids_pack_into_a_little_endian_bit_string(bits):
    """put_id / get_id against NumPy: id i takes bits i*bits .. (i+1)*bits - 1 of the row, read as
    one little-endian bit string of bytes."""
    rng = np.random.default_rng(bits)
    num_keys = 2**bits if bits < 16 else 65535
    keys = rng.integers(0, num_keys, 200)
    assert lsh.id_bits(num_keys) == bits and lsh.id_bits(2**bits + 1) == bits + 1
    assert lsh.empty_ids(3, num_keys).shape == (3, 8 * (-(-num_keys * bits // 64) + 1))  # whole words, one spare
    row = np.zeros(-(-200 * bits // 8) + 3, np.uint8)  # 200 ids and the spare bytes
    for i, key in enumerate(keys):
        lsh.put_id(row, i, bits, key)
    stream = ((keys[:, None] >> np.arange(bits)) & 1).astype(np.uint8).ravel()
    expect = np.packbits(stream, bitorder="little")
    np.testing.assert_array_equal(row[:len(expect)], expect)
    assert not row[len(expect):].any()
    assert [lsh.get_id(row, i, bits) for i in range(200)] == keys.tolist()


def test_tables_hold_every_key_once_in_its_bucket_in_order():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 2**4, (300, 6)).astype(np.int32)
    offsets, ids = lsh.table_set(codes, 4)
    assert offsets.shape == (6, 17) and ids.dtype == np.uint8
    assert ids.shape == (6, 8 * (-(-300 * 9 // 64) + 1))  # 300 keys: 9-bit ids in 43 words, one spare word
    unpacked = lsh.unpack_ids(ids, 300)
    for t in range(6):
        for b in range(16):
            np.testing.assert_array_equal(unpacked[t, offsets[t, b]:offsets[t, b + 1]],
                                          np.flatnonzero(codes[:, t] == b))
    with pytest.raises(ValueError, match="65535"):
        lsh.table_set(np.zeros((70000, 2), np.int32), 2)


@pytest.mark.parametrize("k,num_old,num_new", [(5, 450, 250), (5, 600, 100), (10, 5000, 256), (3, 300, 1),
                                             (10, 700, 3)])
def test_merging_new_keys_equals_building_from_scratch(k, num_old, num_new):
    """Wider ids (450 -> 700: 9 -> 10 bits) go id by id; the same width moves runs of buckets as bit
    strings: many new keys, one, a few into 1024 buckets (most runs long, the last bucket's too)."""
    rng = np.random.default_rng(num_old)
    codes = rng.integers(0, 2**k, (num_old + num_new, 7)).astype(np.int32)
    offsets, ids = lsh.table_set(codes[:num_old], k)
    new_offsets, new_ids = np.empty_like(offsets), lsh.empty_ids(7, num_old + num_new)
    lsh.merge_tables(offsets, ids, num_old, codes[num_old:], new_offsets, new_ids)
    ref_offsets, ref_ids = lsh.table_set(codes, k)
    np.testing.assert_array_equal(new_offsets, ref_offsets)
    np.testing.assert_array_equal(new_ids, ref_ids)


@pytest.mark.parametrize("lo,hi,m", [(0, 500, 2), (4, 437, 2), (100, 101, 2), (50, 50, 2), (0, 500, 3), (4, 437, 1)])
def test_candidates_are_the_keys_colliding_in_m_tables(lo, hi, m):
    rng = np.random.default_rng(1)
    k, num_tables = 3, 8
    codes = rng.integers(0, 2**k, (500, num_tables)).astype(np.int32)
    offsets, ids = lsh.table_set(codes, k)
    count, cand = np.zeros(500, np.uint8), np.empty(500, np.int64)
    for _ in range(20):
        q = rng.integers(0, 2**k, num_tables).astype(np.int32)
        n = lsh.collect_candidates(q, offsets, ids, 500, lo, hi, count, cand, 0, m)
        hits = (codes == q).sum(1)
        expect = np.flatnonzero(hits >= m)
        expect = expect[(expect >= lo) & (expect < hi)]
        np.testing.assert_array_equal(np.sort(cand[:n]), expect)
        assert not count.any()


@pytest.mark.parametrize("cos,m", [(0.95, 2), (0.8, 2), (0.5, 2), (0.2, 2), (0.8, 3), (0.5, 3), (0.5, 1)])
def test_inclusion_probability_matches_monte_carlo(cos, m):
    """Draw many independent SimHash matrices; the share of draws where q and k collide in >= m of
    L tables must match u within 4 standard errors, and the kernel's table must match the formula."""
    k, num_tables, draws = 4, 10, 4000
    q = np.array([1.0, 0.0, 0.0])
    key = np.array([cos, np.sqrt(1 - cos**2), 0.0])
    w = torch.randn(draws, 3, k * num_tables, generator=torch.Generator().manual_seed(0))
    cq, ck = (simhash(torch.tensor(x, dtype=torch.float32).expand(draws, 1, 3), w, k) for x in (q, key))
    hit = ((cq == ck).sum(-1) >= m).float().mean().item()
    u = lsh.inclusion_probability(np.array(cos), k, num_tables, m)
    assert abs(hit - u) < 4 * np.sqrt(u * (1 - u) / draws) + 1e-3
    table = lsh.log_u_table(k, num_tables, m)
    grid = np.linspace(-1, 1, lsh.LOG_U_POINTS)
    assert abs(np.interp(cos, grid, table) - np.log(u)) < 1e-3


def stacked(sets, norms):
    """Table sets of different sizes and their keys' norms as the kernel's [S, L, ...] and [S, keys]
    arrays (ids and norms padded with zeros)."""
    width, keys = max(ids.shape[1] for _, ids in sets), max(len(n) for n in norms)
    return (np.stack([offsets for offsets, _ in sets]),
            np.stack([np.pad(ids, ((0, 0), (0, width - ids.shape[1]))) for _, ids in sets]),
            np.stack([np.pad(n, (0, keys - len(n))) for n in norms]).astype(np.float32))


def key_norms(store, block_tables, seq_lens, codes, mu):
    """|k - mu| of the keys each (sequence, kv-head) hashed (codes[b][h] for its first keys): here
    the stored keys (the server's hashes and norms are of the keys before quantization)."""
    return [[np.linalg.norm(store.gather(0, block_tables[b], n)[0][:len(codes[b][h]), h] - mu[b, h], axis=1)
             for h in range(store.num_kv_heads)] for b, n in enumerate(seq_lens)]


def sampled(store, q, q_codes, tables_per_seq, seq_lens, block_tables, mu, log_u, sinks, window, k, m=2):
    """Run the store's sampled attention with per-(sequence, kv-head) code arrays."""
    num_seqs, hkv = len(seq_lens), store.num_kv_heads
    sets = [lsh.table_set(c, k) for row in tables_per_seq for c in row]
    norms = [n for row in key_norms(store, block_tables, seq_lens, tables_per_seq, mu) for n in row]
    first = np.arange(num_seqs * hkv, dtype=np.int32).reshape(num_seqs, hkv)
    set_of = np.stack([first, first + 1], -1)  # one set per (sequence, kv-head)
    indexed = np.array([len(c) for row in tables_per_seq for c in row], np.int32)
    tables = (set_of, indexed, *stacked(sets, norms))
    return store.sampled_decode_attention(0, q, q_codes, block_tables, np.asarray(seq_lens, np.int32),
                                          q.shape[-1]**-0.5, tables, mu, log_u, sinks, window, m)


@pytest.mark.parametrize("key_smoothing,block_size,rotated", [(False, 16, False), (True, 16, False), (False, 48, False),
                                                               (True, 128, False), (True, 16, True)])
def test_every_key_sampled_with_u_one_is_exact_attention(key_smoothing, block_size, rotated):
    """All codes equal (every key collides in every table) and ln u = 0: the estimator must be
    exact attention over the dequantized store. Up to 138 sampled rows a kv-head: several of the
    kernel's ROWS_AHEAD chunks, and with a block size above it or not dividing it."""
    rng = np.random.default_rng(2)
    key_scales = rng.uniform(0.5, 4, (2, 3 * 64)).astype(np.float32) if key_smoothing else None
    store = oaken_store(key_scales=key_scales, block_size=block_size,
                        **channel_transforms(np.random.default_rng(7), 3, 64, ("bias", "rotate") if rotated else ()))
    seq_lens = [1, 40, 150, 97]
    block_tables, _ = write_sequences(store, rng, seq_lens)
    num_tables, k = 6, 4
    q = rng.standard_normal((4, 9, 64)).astype(np.float32)
    codes = [[np.zeros((max(n - 8, 0), num_tables), np.int32) for _ in range(3)] for n in seq_lens]
    mu = rng.standard_normal((4, 3, 64)).astype(np.float32)
    out, lse, touched = sampled(store, q, np.zeros((4, 9, num_tables), np.int32), codes, seq_lens, block_tables, mu,
                                np.zeros(lsh.LOG_U_POINTS, np.float32), sinks=4, window=8, k=k)
    for b, n in enumerate(seq_lens):
        kg, vg = store.gather(0, block_tables[b], n)
        ref, ref_lse = naive_attention(q[b], kg, vg, 64**-0.5)
        np.testing.assert_allclose(out[b], ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lse[b], ref_lse, atol=1e-5, rtol=1e-5)
        assert (touched[b] == max(min(n - 8, (n - 1) // block_size * block_size) - 4, 0)).all()


@pytest.mark.parametrize("retrieval,m", [("head", 2), ("group", 2), ("group", 3)])
@pytest.mark.parametrize("transforms", [(), ("smooth", "bias"), ("bias", "rotate")])
def test_sampled_attention_follows_the_estimator(transforms, retrieval, m):
    """Real codes: the kernel's output equals the estimator computed in NumPy from the same
    retrieved sets (exact sinks and window, e^s / u weights for the keys colliding in >= m tables,
    u from the angle between the hashed query and k - mu), with and without the store's
    per-channel transforms; the hashed query is each head's own or its GQA group's mean query."""
    rng = np.random.default_rng(3)
    tf = channel_transforms(np.random.default_rng(4), 3, 64, transforms)
    store = oaken_store(num_blocks=80, **tf)
    seq_lens = [300, 200]
    offset = tf["key_bias"][0].reshape(3, 64) if transforms else 0.0
    block_tables, _ = write_sequences(store, rng, seq_lens, offset=offset, rope_inv_freq=tf.get("rope_inv_freq"))
    k, num_tables, sinks, window = 6, 20, 4, 16
    w = simhash_matrix(64, k, num_tables, seed=0)
    q = rng.standard_normal((2, 9, 64)).astype(np.float32)
    mu = np.zeros((2, 3, 64), np.float32) + offset + (0.3 * rng.standard_normal((2, 3, 64)) if transforms else 0)
    mu = mu.astype(np.float32)
    codes, keys = [], []
    for b, n in enumerate(seq_lens):
        kg, vg = store.gather(0, block_tables[b], n)
        keys.append((kg, vg))
        codes.append([simhash(torch.from_numpy(kg[:n - window, h] - mu[b, h]), w, k).numpy() for h in range(3)])
    hashed = q if retrieval == "head" else q.reshape(2, 3, 3, 64).mean(2)  # [B, Hq or Hkv, D]
    q_codes = simhash(torch.from_numpy(hashed), w, k).numpy()
    log_u = lsh.log_u_table(k, num_tables, m)
    out, lse, touched = sampled(store, q, q_codes, codes, seq_lens, block_tables, mu, log_u, sinks, window, k, m)
    grid = np.linspace(-1, 1, lsh.LOG_U_POINTS)
    for b, n in enumerate(seq_lens):
        kg, vg = keys[b]
        for h in range(9):
            kvh = h // 3
            r = h if retrieval == "head" else kvh
            hits = (codes[b][kvh] == q_codes[b, r]).sum(1)
            sampled_pos = np.flatnonzero(hits >= m)
            sampled_pos = sampled_pos[sampled_pos >= sinks]
            assert touched[b, h] == len(sampled_pos)
            exact_pos = np.r_[0:sinks, n - window:n]
            s = kg[:, kvh].astype(np.float64) @ q[b, h] / 8
            centered = kg[sampled_pos, kvh] - mu[b, kvh]
            cos = centered @ hashed[b, r] / np.linalg.norm(centered, axis=1) / np.linalg.norm(hashed[b, r])
            logits = np.r_[s[exact_pos], s[sampled_pos] - np.interp(cos, grid, log_u)]
            p = np.exp(logits - logits.max())
            ref = p @ vg[np.r_[exact_pos, sampled_pos], kvh] / p.sum()
            np.testing.assert_allclose(out[b, h], ref, atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(lse[b, h], logits.max() + np.log(p.sum()), atol=2e-5, rtol=1e-5)
    assert (touched > 0).mean() > 0.5  # the sets are not empty: the estimator is really tested


def test_coder_centers_keys_on_their_first_chunk():
    """LshCoder (the model worker's half): query codes are plain SimHash, of the decode rows
    (one-token chunks) only; key codes are those of k - mean(first prefill chunk's keys), per
    sequence and layer, kept for later chunks; a new prefill recenters; free() drops the centers."""
    from cpu_attn.simhash import LshCoder

    coder = LshCoder(64, 8, 20, seed=3)
    w = coder.w.numpy()
    k = torch.randn(300, 3, 64) + 2.0
    q = torch.randn(300, 9, 64)
    first = [coder.codes(1, q[:200], k[:200], [(5, 0, 120, 0), (6, 0, 80, 0)])]
    later = coder.codes(1, q[200:], k[200:], [(6, 80, 40, 0), (5, 120, 60, 0)])
    mu5, mu6 = k[:120].mean(0).numpy(), k[120:200].mean(0).numpy()
    centered = np.concatenate([k[:120] - mu5, k[120:200] - mu6, k[200:240] - mu6, k[240:] - mu5])
    got_k = np.concatenate([first[0][1], later[1]])
    assert first[0][0].shape == later[0].shape == (0, 9, 20)  # prefill rows: no query codes
    proj = centered.astype(np.float64) @ w
    clear = (np.abs(proj) > 1e-4).reshape(300, 3, 20, 8).all(-1)  # codes away from a sign flip by rounding
    np.testing.assert_array_equal(got_k[clear], reference_codes(centered, w, 8)[clear])
    assert got_k.dtype == np.int32 and sorted(coder.centers) == [5, 6]
    # a mixed step: the query codes are those of the decode rows, in row order
    got_q, _ = coder.codes(2, q[:13], k[:13], [(7, 0, 6, 0), (8, 40, 1, 0), (9, 0, 5, 0), (10, 9, 1, 0)])
    np.testing.assert_array_equal(got_q, reference_codes(q.numpy()[[6, 12]], w, 8))
    coder.free([7, 8, 9, 10])
    coder.codes(1, q[:10], k[:10] + 5, [(5, 0, 10, 0)])
    np.testing.assert_allclose(coder.centers[5][1].numpy(), (k[:10] + 5).mean(0).numpy() @ w, rtol=1e-4, atol=1e-3)
    # decode steps (one token a sequence, the centers kept stacked per batch) use the current centers
    mu5 = (k[:10] + 5).mean(0).numpy()
    for step in range(3):
        rows = k[2 * step:2 * step + 2]
        got_q, got = coder.codes(1, q[:2], rows, [(6, 300 + step, 1, 0), (5, 300 + step, 1, 0)])
        np.testing.assert_array_equal(got_q, reference_codes(q.numpy()[:2], w, 8))
        centered = rows.numpy() - np.stack([mu6, mu5])
        clear = (np.abs(centered.astype(np.float64) @ w) > 1e-4).reshape(2, 3, 20, 8).all(-1)
        np.testing.assert_array_equal(got.numpy()[clear], reference_codes(centered, w, 8)[clear])
        if step == 1:  # sequence 5 starts again: a new center, which the next decode step must use
            coder.codes(1, q[:10], k[:10] - 3, [(5, 0, 10, 0)])
            mu5 = (k[:10] - 3).mean(0).numpy()
    coder.free([5, 6])
    assert coder.centers == {}


def test_shared_coder_hashes_each_groups_mean_query():
    from cpu_attn.simhash import LshCoder

    coder = LshCoder(64, 8, 20, seed=3, shared=True)
    q, k = torch.randn(5, 9, 64), torch.randn(5, 3, 64)
    q_codes, k_codes = coder.codes(0, q, k, [(s, 0, 1, 0) for s in range(5)])  # five one-token rows
    assert q_codes.shape == (5, 3, 20) and k_codes.shape == (5, 3, 20)
    mean = q.numpy().reshape(5, 3, 3, 64).mean(2)
    proj = mean.astype(np.float64) @ coder.w.numpy()
    clear = (np.abs(proj) > 1e-4).reshape(5, 3, 20, 8).all(-1)
    np.testing.assert_array_equal(q_codes.numpy()[clear], reference_codes(mean, coder.w.numpy(), 8)[clear])


def test_magicpig_state_indexes_centered_keys_in_batches():
    """Prefill builds the tables over all but the window; decode keys wait in the window and are
    merged every `merge_every` keys; the tables always equal tables built from scratch over the
    centered keys' codes; a new prefill (start 0) or free() drops the state."""
    from cpu_attn.magicpig import LshConfig, MagicPig

    cfg = LshConfig(k=6, l=12, window=64, min_context=512, merge_every=100, dense_layers=(1,))
    mp = MagicPig(cfg, num_layers=2, num_kv_heads=2, head_dim=64)
    coder = mp.coder()
    keys = torch.randn(1000, 2, 64) + 3.0  # a common offset that centering must remove
    codes = np.concatenate([coder.codes(0, keys[:1], keys[:600], [(7, 0, 600, 0)])[1]] +
                           [coder.codes(0, keys[:1], keys[n:n + 1], [(7, n, 1, 0)])[1] for n in range(600, 1000)])
    assert coder.codes(1, keys[:1], keys[:10], [(7, 0, 10, 0)]) is None  # dense layer: no codes
    with pytest.raises(ValueError, match="codes"):
        mp.append(0, 7, 0, keys[:600], None)
    mp.append(1, 7, 0, keys[:600], codes[:600])
    assert 7 not in mp.seqs or mp.seqs[7][1] is None  # dense layer: no state
    mp.append(0, 7, 0, keys[:600], codes[:600])
    state = mp.seqs[7][0]
    np.testing.assert_allclose(state.mu, keys[:600].mean(0).numpy(), rtol=1e-5, atol=1e-5)
    assert state.indexed == 536
    for n in range(600, 1000):
        mp.append(0, 7, n, keys[n:n + 1], codes[n:n + 1])
        expect = 536 + 100 * ((n + 1 - 64 - 536) // 100)
        assert state.indexed == expect, n
        set_of, indexed, offsets, ids, norms = mp._tables(0, [state])  # cached between merges, never stale
        assert set_of[0, 1].tolist() == [1, 2] and indexed[1] == expect and len(norms[1]) == expect
        assert offsets[1] is state.offsets[0][1] and ids[1] is state.ids[0][1]
    codes = codes[:state.indexed]
    for h in range(2):
        offsets, ids = lsh.table_set(np.ascontiguousarray(codes[:, h]), cfg.k)
        np.testing.assert_array_equal(state.offsets[0][h], offsets)
        np.testing.assert_array_equal(state.ids[0][h], ids)
        centered = keys[:state.indexed, h].numpy() - state.mu[h]
        np.testing.assert_allclose(state.norms[0][h], np.linalg.norm(centered, axis=1), rtol=1e-5)  # for u's angle
    assert sum(len(p) for p in state.pending) == sum(len(n) for n in state.pending_norms) == 1000 - state.indexed
    mp.append(0, 7, 0, keys[:10], codes[:10])
    assert mp.seqs[7][0].indexed == 0 and mp.seqs[7][0] is not state
    mp.free([7])
    assert 7 not in mp.seqs


def _assert_tables_over(state, centered, w, cfg):
    """state's tables equal tables built from scratch over NumPy codes of `centered` [n, Hkv, D] keys
    (for each kv-head where no key lies within 1e-4 of a sign flip), and its norms are theirs."""
    expect = reference_codes(centered, w, cfg.k)
    clear = (np.abs(centered.astype(np.float64) @ w) > 1e-4).reshape(
        len(centered), centered.shape[1], cfg.l, cfg.k).all(-1).all(-1)
    assert clear.mean() > 0.9
    for h in range(centered.shape[1]):
        offsets, ids = lsh.table_set(np.ascontiguousarray(expect[:, h].astype(np.int32)), cfg.k)
        if clear[:, h].all():
            np.testing.assert_array_equal(state.offsets[0][h], offsets)
            np.testing.assert_array_equal(state.ids[0][h], ids)
        np.testing.assert_allclose(state.norms[0][h], np.linalg.norm(centered[:, h], axis=1), rtol=1e-5)


def test_a_sequence_after_a_cached_prefix_codes_its_keys_on_the_cpu_and_hands_the_center_on():
    """A sequence whose first chunk starts past 0 (its prefix came from the cache) is centered on the
    mean of the prefix's keys; its keys so far are coded here (the chunk's
    codes from the coder, centered on the chunk, are not used); the coder takes that center for its
    later keys, and the tables equal tables built from scratch over every key's codes."""
    from cpu_attn.magicpig import LshConfig, MagicPig

    cfg = LshConfig(k=6, l=12, window=64, min_context=512, merge_every=100, dense_layers=(1,))
    mp = MagicPig(cfg, num_layers=2, num_kv_heads=2, head_dim=64)
    coder = mp.coder()
    keys = torch.randn(1000, 2, 64) + torch.linspace(0, 4, 1000)[:, None, None]  # a center that drifts
    start = 700
    with pytest.raises(ValueError, match="earlier keys"):
        mp.append(0, 7, start, keys[start:720], coder.codes(0, keys[:1], keys[start:720], [(7, start, 20, 0)])[1])
    mp.free([7])
    coder.free([7])
    chunk_codes = coder.codes(0, keys[:1], keys[start:720], [(7, start, 20, 0)])[1]  # centered on the chunk
    mp.append(0, 7, start, keys[start:720], chunk_codes, lambda: keys[:start])
    mp.append(1, 7, start, keys[start:720], None, lambda: keys[:start])  # a dense layer: nothing
    state = mp.seqs[7][0]
    mu = keys[:start].mean(0).numpy()
    np.testing.assert_allclose(state.mu, mu, rtol=1e-5, atol=1e-5)
    centers = mp.take_centers()
    assert [(s, layer) for s, layer, _ in centers] == [(7, 0)] and mp.take_centers() == []
    coder.set_center(7, 0, centers[0][2])
    later = [coder.codes(0, keys[:1], keys[n:n + 1], [(7, n, 1, 0)])[1] for n in range(720, 1000)]
    for n, codes in zip(range(720, 1000), later):
        mp.append(0, 7, n, keys[n:n + 1], codes)
    assert state.indexed == 856  # 656 at the first chunk, then 100 at a time
    _assert_tables_over(state, keys[:state.indexed].numpy() - mu, coder.w.numpy(), cfg)
    got = np.concatenate(state.pending)  # coded by the coder, on mu
    pend = keys[state.indexed:1000].numpy() - mu
    ok = (np.abs(pend.astype(np.float64) @ coder.w.numpy()) > 1e-4).reshape(len(pend), 2, cfg.l, cfg.k).all(-1)
    np.testing.assert_array_equal(got[ok], reference_codes(pend, coder.w.numpy(), cfg.k)[ok])


@pytest.mark.parametrize("recenter", [True, False])
def test_a_chunked_prompt_is_centered_on_all_its_keys_at_a_decode_step(recenter):
    """A prompt prefilled in three chunks is centered on its first chunk (as the coder is), and with
    cfg.recenter its later chunks are not coded; at a decode step with a merge left in the step's
    budget, it is centered on the mean of all its keys, as stored: its keys are coded here, its tables
    equal tables built from scratch over codes on that center, and the coder takes the center for its
    later keys. A decode step without one waits (attended exactly past the first chunk's tables).
    Later decode steps, and a prompt of one chunk, keep their center."""
    from cpu_attn.magicpig import LshConfig, MagicPig

    cfg = LshConfig(k=6, l=12, window=64, min_context=512, merge_every=100, dense_layers=(1,), recenter=recenter)
    mp = MagicPig(cfg, num_layers=2, num_kv_heads=2, head_dim=64)
    coder = mp.coder()
    keys = torch.randn(1000, 2, 64) + torch.linspace(0, 4, 1000)[:, None, None]  # a center that drifts
    for start in (0, 300, 600):  # the prompt: 900 keys in three chunks
        codes = coder.codes(0, keys[:1], keys[start:start + 300], [(7, start, 300, 0)])[1]
        mp.append(0, 7, start, keys[start:start + 300], codes, lambda s=start: keys[:s])
    prompt_state = mp.seqs[7][0]
    np.testing.assert_allclose(prompt_state.mu, keys[:300].mean(0).numpy(), rtol=1e-5, atol=1e-5)
    assert mp.take_centers() == [] and prompt_state.recenter_due == recenter
    assert prompt_state.indexed == (0 if recenter else 836)  # without: all but the window
    assert sum(len(p) for p in prompt_state.pending) == (300 if recenter else 900 - 836)

    def decode(n):
        mp.append(0, 7, n, keys[n:n + 1], coder.codes(0, keys[:1], keys[n:n + 1], [(7, n, 1, 0)])[1], lambda: keys[:n])

    mp._merges_left = 0  # the step's merges taken by other layers: the recenter waits
    decode(900)
    assert mp.seqs[7][0] is prompt_state and mp.take_centers() == []
    mp.begin_step()
    for n in range(901, 1000):
        decode(n)
        if n == 901:
            coder.set_center(*next(iter(mp.take_centers()), (7, 0, prompt_state.mu)))
            state = mp.seqs[7][0]
        assert mp.seqs[7][0] is state and mp.take_centers() == [], n
    if not recenter:
        assert state is prompt_state and state.indexed == 936
        return
    assert not state.recenter_due and mp._merges_left == cfg.merges_per_step - 1  # its merge was the step's one
    mu = keys[:901].mean(0).numpy()
    np.testing.assert_allclose(state.mu, mu, rtol=1e-5, atol=1e-5)
    assert state.indexed == 838  # all but the window at the recenter (100 more at 1,002 keys)
    _assert_tables_over(state, keys[:state.indexed].numpy() - mu, coder.w.numpy(), cfg)
    whole = MagicPig(cfg, num_layers=2, num_kv_heads=2, head_dim=64)  # one chunk: its center is already all keys'
    whole.append(0, 8, 0, keys[:900], coder.codes(0, keys[:1], keys[:900], [(8, 0, 900, 0)])[1])
    first = whole.seqs[8][0]
    whole.append(0, 8, 900, keys[900:901], coder.codes(0, keys[:1], keys[900:901], [(8, 900, 1, 0)])[1])
    assert whole.seqs[8][0] is first and whole.take_centers() == []


def _state_bytes(mp) -> int:
    """Bytes of every array MagicPIG's state holds, each buffer counted once (tables are views of one)."""
    buffers = {}
    for layers in mp.seqs.values():
        for state in filter(None, layers):
            arrays = [state.mu, *state.norms, *state.pending, *state.pending_norms,
                      *(a for per_set in state.offsets + state.ids for a in per_set)]
            for a in arrays:
                while isinstance(a.base, np.ndarray):
                    a = a.base
                buffers[id(a)] = a.nbytes
    return sum(buffers.values())


@pytest.mark.parametrize("lengths", [(1000,), (1100,), (1100, 2600, 40)])
def test_magicpig_state_stays_within_host_bytes(lengths):
    """host_bytes (what the serving cache's capacity counts) bounds the state a prefill and decode
    steps leave: pending codes below min_context (no tables yet), a first table set just past it,
    longer sequences in a batch (K 6: small offsets, so that int32 pending codes would not fit); and
    it is not loose by more than 1.5x on a 2.6k-token sequence."""
    from cpu_attn.magicpig import LshConfig, MagicPig, host_bytes

    cfg = LshConfig(k=6, l=60, window=64, min_context=1024, merge_every=128, dense_layers=(0,))
    mp = MagicPig(cfg, num_layers=3, num_kv_heads=2, head_dim=64)
    rng = np.random.default_rng(0)
    per_token, per_seq, per_tabled = host_bytes(cfg, 3, 2, 64)

    keys = {}

    def step(seq, start, n):  # a chunked prompt's decode steps code its keys again (recenter)
        k = torch.randn(n, 2, 64)
        before = keys.get(seq, k[:0])
        keys[seq] = torch.cat([before, k])
        for layer in (1, 2):
            mp.append(layer, seq, start, k, rng.integers(0, 2**cfg.k, (n, 2, cfg.l), dtype=np.int32), lambda: before)

    def bound(n):
        return per_seq + n * per_token + (per_tabled if n >= cfg.min_context else 0)

    for seq, n in enumerate(lengths):
        for start in range(0, n - 40, 512):  # prefill chunks of up to 512, then 40 decode steps
            step(seq, start, min(512, n - 40 - start))
    for i in range(40):
        mp.begin_step()
        for seq, n in enumerate(lengths):
            step(seq, n - 40 + i, 1)
        assert _state_bytes(mp) <= sum(bound(n - 40 + i + 1) for n in lengths), i
        assert all(bool(mp.seqs[s][1].offsets) == (n - 40 + i + 1 >= cfg.min_context) for s, n in enumerate(lengths))
    if lengths == (1100, 2600, 40):
        long_only = MagicPig(cfg, num_layers=3, num_kv_heads=2, head_dim=64)
        long_only.seqs = {1: mp.seqs[1]}
        assert _state_bytes(long_only) > bound(2600) / 1.5


def test_kv_cache_capacity_counts_magicpig_state():
    """With MagicPIG a block pays for its tokens' codes, and a sequence of min_context tokens or more
    reserves blocks for its first table set: however the blocks are shared out, the state stays in
    the capacity, even when every block's own KV pages are in memory. kv_capacity_for inverts it."""
    from types import SimpleNamespace

    from cpu_attn.calibrate import SPARSE_FRACTION
    from cpu_attn.kv_store import OakenKVStore
    from cpu_attn.magicpig import LshConfig, host_bytes
    from hetcore.backend import KVCapacityError
    from server.hetero import kv_capacity_for, kv_spec

    shape, lsh = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64), LshConfig()  # SmolLM2's
    args = ("oaken", 2**30, 16, SPARSE_FRACTION, 8)
    exact = kv_spec(shape, *args)
    per_token, per_seq, per_tabled = host_bytes(lsh, 30, 3, 64)
    assert per_token == 28 * 3 * (2 * 300 + 4 + 10) and per_tabled == 28 * 3 * 300 * (2 * 1025 + 16)
    room = 2**30 - OakenKVStore.tail_bytes(30, 3, 64, 16, 8)
    assert exact.reserve_blocks == 0 and exact.num_blocks == room // exact.bytes_per_block
    for seqs in (8, 64):
        spec = kv_spec(shape, *args, lsh, max_num_seqs=seqs)
        assert spec.bytes_per_block == exact.bytes_per_block + 16 * per_token
        assert spec.num_blocks == (room - seqs * per_seq) // spec.bytes_per_block  # 1043 blocks at 64 sequences
        assert spec.reserve_from == 1024 and spec.reserve_blocks * 16 * per_token >= per_tabled
        assert spec.blocks_for(1023) == 64 and spec.blocks_for(1024) == 64 + spec.reserve_blocks
        # each tabled sequence (>= 1024 tokens) holds its reserve: the most tables fit whatever the split
        for length in (1024, 1500, 8000):
            tabled = min(seqs, spec.num_blocks // spec.blocks_for(length))
            kv_pages = spec.num_blocks * exact.bytes_per_block  # every block's K and V written at some time
            codes = tabled * -(-length // 16) * 16 * per_token
            assert kv_pages + codes + tabled * per_tabled + seqs * per_seq <= room
    need = kv_capacity_for(shape, "oaken", 16, 8, 8000, lsh, recent_blocks=8)
    spec = kv_spec(shape, "oaken", need, 16, SPARSE_FRACTION, 8, lsh, 8)
    assert spec.num_blocks == 8 * spec.blocks_for(8000)
    with pytest.raises(KVCapacityError, match="room for 104 blocks .* too few for a sequence of 1024 tokens with its "
                                              r"MagicPIG tables \(128 blocks"):
        kv_spec(shape, "oaken", 100 * 2**20, 16, SPARSE_FRACTION, 8, lsh, max_num_seqs=1)
    with pytest.raises(KVCapacityError, match="room for 0 blocks .* too few for one block of 16 tokens"):
        kv_spec(shape, "oaken", 2**10, 16, SPARSE_FRACTION, 0)


def test_decode_merges_spread_over_steps_within_the_budget():
    """Five sequences that come due in the same step merge two per step (merges_per_step), the
    others keep their keys pending; one kept waiting until 2 * merge_every are due merges anyway;
    prefill chunks index at once, outside the budget."""
    from cpu_attn.magicpig import LshConfig, MagicPig

    cfg = LshConfig(k=4, l=6, window=8, min_context=64, merge_every=16, merges_per_step=2, dense_layers=())
    mp = MagicPig(cfg, num_layers=1, num_kv_heads=1, head_dim=64)
    rng = np.random.default_rng(3)
    for s in range(5):
        mp.begin_step()
        mp.append(0, s, 0, torch.randn(72, 1, 64), rng.integers(0, 16, (72, 1, 6)).astype(np.int32))
    assert [mp.seqs[s][0].indexed for s in range(5)] == [64] * 5  # prefills: every one at once
    merged_per_step = []
    for step in range(18):
        mp.begin_step()
        before = [mp.seqs[s][0].indexed for s in range(5)]
        for s in range(4):  # sequence 4 is left out of these steps
            mp.append(0, s, 72 + step, torch.randn(1, 1, 64), rng.integers(0, 16, (1, 1, 6)).astype(np.int32))
        merged_per_step.append(sum(mp.seqs[s][0].indexed != b for s, b in enumerate(before)))
    assert merged_per_step == [0] * 15 + [2, 2, 0]  # all four due at step 15: two then, two at 16
    mp.begin_step()
    mp._merges_left = 0  # budget spent by other layers
    for n in range(72, 72 + 32):  # sequence 4 alone: due at 16 waits, at 32 merges anyway
        mp.append(0, 4, n, torch.randn(1, 1, 64), rng.integers(0, 16, (1, 1, 6)).astype(np.int32))
        assert mp.seqs[4][0].indexed == (64 if n + 1 - 8 - 64 < 32 else 64 + 32), n


def test_magicpig_indexes_past_max_keys_in_more_table_sets(monkeypatch):
    """A set holds at most lsh.MAX_KEYS keys (uint16 offsets): later keys go to the next set, and
    each set equals tables built from its own keys' codes."""
    from cpu_attn.magicpig import LshConfig, MagicPig

    monkeypatch.setattr(lsh, "MAX_KEYS", 300)
    cfg = LshConfig(k=6, l=12, window=64, min_context=512, merge_every=50, dense_layers=())
    mp = MagicPig(cfg, num_layers=1, num_kv_heads=2, head_dim=64)
    coder = mp.coder()
    keys = torch.randn(1000, 2, 64)
    codes = [coder.codes(0, keys[:1], keys[:600], [(3, 0, 600, 0)])[1]]
    mp.append(0, 3, 0, keys[:600], codes[0])
    for n in range(600, 1000):
        codes.append(coder.codes(0, keys[:1], keys[n:n + 1], [(3, n, 1, 0)])[1])
        mp.append(0, 3, n, keys[n:n + 1], codes[-1])
    codes = np.concatenate(codes)
    state = mp.seqs[3][0]
    assert state.indexed == 936 and len(state.offsets) == 4  # 536 + 8 merges of 50: sets of 300, 300, 300, 36
    for c in range(4):
        for h in range(2):
            offsets, ids = lsh.table_set(np.ascontiguousarray(codes[300 * c:min(300 * (c + 1), 936), h]), cfg.k)
            np.testing.assert_array_equal(state.offsets[c][h], offsets)
            np.testing.assert_array_equal(state.ids[c][h], ids)
            np.testing.assert_allclose(state.norms[c][h], np.linalg.norm(
                keys[300 * c:min(300 * (c + 1), 936), h].numpy() - state.mu[h], axis=1), rtol=1e-5)
    set_of, indexed, _, _, _ = mp._tables(0, [state, None])
    assert set_of.tolist() == [[[0, 4], [4, 8]], [[8, 9], [9, 10]]]
    assert indexed.tolist() == [300, 300, 300, 36] * 2 + [0, 0]
    assert sum(len(p) for p in state.pending) == 1000 - 936


def test_batch_tables_are_reused_until_a_sequence_is_freed():
    """The typed Lists of a batch's table sets are built once and reused while the batch and its
    tables stay the same; the engine frees every step, usually nothing, which must not drop them
    (it did: 0.3 ms per layer per step at 16 x 8k); freeing a sequence does."""
    from cpu_attn.magicpig import LshConfig, MagicPig

    cfg = LshConfig(k=6, l=12, window=16, min_context=64, merge_every=16, dense_layers=())
    mp = MagicPig(cfg, num_layers=1, num_kv_heads=2, head_dim=64)
    coder = mp.coder()
    for seq in (1, 2):
        keys = torch.randn(200, 2, 64)
        mp.append(0, seq, 0, keys, coder.codes(0, keys[:1], keys, [(seq, 0, 200, 0)])[1])
    states = [mp.seqs[1][0], mp.seqs[2][0]]
    first = mp._tables(0, states)
    mp.free([])
    mp.free([7])  # not a MagicPIG sequence (e.g. a short one)
    assert all(a is b for a, b in zip(mp._tables(0, states), first))
    mp.free([2])
    assert 2 not in mp.seqs and not mp._lists


def test_sampled_attention_over_several_table_sets_equals_one_set():
    """Splitting an item's keys over consecutive table sets retrieves the same keys: the kernel's
    output is the same as with one set."""
    rng = np.random.default_rng(9)
    store = oaken_store()
    seq_lens = [150, 97]
    block_tables, _ = write_sequences(store, rng, seq_lens)
    k, num_tables, w = 4, 8, simhash_matrix(64, 4, 8, seed=1)
    q = rng.standard_normal((2, 9, 64)).astype(np.float32)
    mu = np.zeros((2, 3, 64), np.float32)
    codes = [[simhash(torch.from_numpy(store.gather(0, block_tables[b], n)[0][:n - 8, h]), w, k).numpy()
              for h in range(3)] for b, n in enumerate(seq_lens)]
    q_codes = simhash(torch.from_numpy(q), w, k).numpy()
    log_u = lsh.log_u_table(k, num_tables)
    one = sampled(store, q, q_codes, codes, seq_lens, block_tables, mu, log_u, sinks=4, window=8, k=k)
    # the same keys in sets of 40 (the last one partial): 4 sets for 142 keys, 3 for 89
    norms = key_norms(store, block_tables, seq_lens, codes, mu)
    sets, set_of = [], np.zeros((2, 3, 2), np.int32)
    for b in range(2):
        for h in range(3):
            set_of[b, h, 0] = len(sets)
            sets += [(lsh.table_set(codes[b][h][i:i + 40], k), norms[b][h][i:i + 40])
                     for i in range(0, len(codes[b][h]), 40)]
            set_of[b, h, 1] = len(sets)
    tables = (set_of, np.array([len(n) for _, n in sets], np.int32), *stacked(*zip(*sets)))
    many = store.sampled_decode_attention(0, q, q_codes, block_tables, np.asarray(seq_lens, np.int32), 64**-0.5,
                                          tables, mu, log_u, 4, 8)
    assert one[2].sum() > 0
    for a, b in zip(one, many):
        np.testing.assert_array_equal(a, b)
    # the store keeps the kernel's scratch between calls: it must come back zeroed where the kernel needs
    # zeros, so a repeated call (and one for a single sequence, a smaller batch) gives the same results
    (_, _, _, _, _, _, _, count, marks, _, _), = store._sampled.values()
    assert not count.any() and not marks.any()
    again = sampled(store, q, q_codes, codes, seq_lens, block_tables, mu, log_u, sinks=4, window=8, k=k)
    first = sampled(store, q[:1], q_codes[:1], codes[:1], seq_lens[:1], block_tables[:1], mu[:1], log_u, sinks=4,
                    window=8, k=k)
    for a, b, c in zip(one, again, first):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a[:1], c)


@pytest.mark.parametrize("retrieval", ["head", "group"])
def test_magicpig_worker_is_exact_below_min_context_and_samples_above(retrieval):
    """Through the attention worker: short sequences and dense layers get exact attention (the
    same output as a worker without MagicPIG); a long one samples a few percent of its keys."""
    from cpu_attn.magicpig import LshConfig, MagicPig
    from cpu_attn.worker import AttentionWorker, ChunkLayout

    cfg = LshConfig(min_context=256, dense_layers=(1,), retrieval=retrieval)
    stores = [oaken_store(num_blocks=64) for _ in range(2)]
    workers = [AttentionWorker(stores[0], 64), AttentionWorker(stores[1], 64, MagicPig(cfg, 2, 3, 64))]
    coder = workers[1].sparse.coder()
    tables = [tuple(range(0, 30)), tuple(range(30, 34)), tuple(range(34, 36))]
    outs = []
    for w in workers:
        torch.manual_seed(0)
        w.begin_step([ChunkLayout(400, 0, tables[0], 0), ChunkLayout(50, 0, tables[1], 1)])
        for layer in range(2):
            q, k, v = torch.randn(450, 9, 64), torch.randn(450, 3, 64), torch.randn(450, 3, 64)
            w.attend(layer, q, k, v, coder.codes(layer, q, k, [(0, 0, 400, 0), (1, 0, 50, 0)]))
        w.begin_step([ChunkLayout(1, 400, tables[0], 0), ChunkLayout(1, 50, tables[1], 1)])
        step = []
        for layer in range(2):
            q, k, v = (torch.randn(2, h, 64) for h in (9, 3, 3))
            step.append(w.attend(layer, q, k, v, coder.codes(layer, q, k, [(0, 400, 1, 0), (1, 50, 1, 0)])))
        # a mixed step with a single decode row (a one-row index must keep the codes' batch axis)
        w.begin_step([ChunkLayout(1, 401, tables[0], 0), ChunkLayout(20, 0, tables[2], 2)])
        for layer in range(2):
            q, k, v = torch.randn(21, 9, 64), torch.randn(21, 3, 64), torch.randn(21, 3, 64)
            step.append(w.attend(layer, q, k, v, coder.codes(layer, q, k, [(0, 401, 1, 0), (2, 0, 20, 0)])))
        outs.append(step)
    np.testing.assert_allclose(outs[1][3], outs[0][3], rtol=1e-5, atol=1e-6)  # mixed step, dense layer
    assert not np.allclose(outs[1][2][0], outs[0][2][0], atol=1e-4)  # mixed step, long one sampled
    np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)  # dense layer: exact
    np.testing.assert_allclose(outs[1][0][1], outs[0][0][1], rtol=1e-5, atol=1e-6)  # short sequence: exact
    assert not np.allclose(outs[1][0][0], outs[0][0][0], atol=1e-4)  # long one sampled
    touched, eligible = workers[1].sparse.take_stats()
    assert eligible == 2 * 9 * (400 - cfg.window - 4) and 0 < touched < 0.2 * eligible  # indexed at prefill


def test_server_with_magicpig_samples_long_prompts(monkeypatch):
    """hetserve serve --kv-format oaken --attention magicpig: long prompts are answered through
    sampled attention, short ones exactly; concurrent requests all complete; a long prompt, prefilled
    in chunks (a step's budget of 128 tokens), is centered on all its keys once per sampled layer, in
    its first decode steps; a prompt sent again takes its blocks from the prefix cache, is centered on them once, and
    still samples; blocks and every per-sequence MagicPIG state come back once the server is idle."""
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from cpu_attn.magicpig import MagicPig
    from server.config import ServeConfig
    from tests.conftest import SHARED, RunningServer

    centered = Counter()  # (sequence, layer) -> centers chosen by MagicPig itself
    recenter = MagicPig._recenter

    def counted(self, seq_id, layer, *args):
        centered[seq_id, layer] += 1
        return recenter(self, seq_id, layer, *args)

    monkeypatch.setattr(MagicPig, "_recenter", counted)
    cfg = ServeConfig(kv_format="oaken", attention="magicpig", lsh_min_context=256, lsh_window=32,
                      kv_cache_bytes=2**30, max_num_seqs=8, max_num_batched_tokens=128)
    server = RunningServer(cfg)
    assert centered  # the warm-up's prompt is long enough for MagicPIG (its sampled kernel compiled before /health)
    touched, _ = server.engine.backend.attn_worker.sparse.take_stats()
    assert touched > 0
    centered.clear()
    assert server.engine.blocks.spec.reserve_blocks > 0  # a prompt of 256 tokens or more holds room for its tables
    assert server.engine.scheduler.cfg.prefix_caching
    text = (SHARED / "data" / "wikitext-2" / "test.txt").read_text()[:6000]
    try:
        def ask(i):
            body = {"prompt": text[i * 100:i * 100 + 1800] if i % 2 else "Hello, my name is", "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text
            return r.json()
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(ask, range(6)))
        assert all(r["usage"]["completion_tokens"] == 24 for r in replies)
        assert all(r["usage"]["prompt_tokens"] > 300 for r in replies[1::2])
        touched, eligible = server.engine.backend.attn_worker.sparse.take_stats()
        assert 0 < touched < 0.3 * eligible
        sampled = sum(server.engine.backend.attn_worker.sparse.sampled_layers)
        assert len({seq for seq, _ in centered}) == 3 and set(centered.values()) == {1}
        assert len(centered) == 3 * sampled  # the three long prompts, each sampled layer once
        again = ask(1)  # its prompt from the cache; its tables built from the cached keys
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 300
        assert again["usage"]["completion_tokens"] == 24
        assert len(centered) == 4 * sampled and set(centered.values()) == {1}
        touched, eligible = server.engine.backend.attn_worker.sparse.take_stats()
        assert 0 < touched < 0.3 * eligible
        timings = server.engine.last_step_timings  # the last decode step: 2 of 30 layers attended exactly
        assert 0 < timings.cpu_attn_dense_s < timings.cpu_attn_s
        assert server.engine.blocks.used_bytes == 0
        # once idle, the engine still tells the workers which sequences ended: no tables or key centers stay
        backend = server.engine.backend
        deadline = time.monotonic() + 10
        while (backend.attn_worker.sparse.seqs or backend.model_worker.lsh.centers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not backend.attn_worker.sparse.seqs and not backend.model_worker.lsh.centers
    finally:
        server.close()


def test_topk_keeps_the_highest_scoring_keys():
    """TopK with frac 1 is exact attention; with a budget it equals softmax over sinks, window and
    the top-scoring middle keys, computed in NumPy."""
    from cpu_attn.topk import topk_decode_attention

    rng = np.random.default_rng(7)
    store = oaken_store()
    seq_lens = [300, 90]
    tables, _ = write_sequences(store, rng, seq_lens)
    q = rng.standard_normal((2, 9, 64)).astype(np.float32)
    lens = np.array(seq_lens, np.int32)
    exact, _ = store.decode_attention(0, q, tables, lens, 0.125)
    np.testing.assert_allclose(topk_decode_attention(store, 0, q, tables, lens, 0.125, np.ones(2), 4, 16), exact,
                               atol=1e-5, rtol=1e-4)
    out = topk_decode_attention(store, 0, q, tables, lens, 0.125, np.full(2, 0.1), 4, 16)
    for b, n in enumerate(seq_lens):
        kg, vg = store.gather(0, tables[b], n)
        for h in range(9):
            s = kg[:, h // 3] @ q[b, h] * 0.125
            middle = np.arange(4, n - 16)
            top = middle[np.argsort(-s[middle])[:round(0.1 * len(middle))]]
            keep = np.r_[0:4, top, n - 16:n]
            p = np.exp(s[keep] - s[keep].max())
            np.testing.assert_allclose(out[b, h], p @ vg[keep, h // 3] / p.sum(), atol=1e-5, rtol=1e-4)


def test_ann_topk_finds_most_of_the_exact_top_keys():
    """AnnTopK (faiss HNSW per kv-head): every key before the window is in its graph, ids are
    positions, and the keys it picks overlap the exact top-k; with frac 1 it is exact attention."""
    from cpu_attn.topk import AnnTopK

    rng = np.random.default_rng(8)
    store = oaken_store(num_blocks=64)
    n, window, budget = 460, 16, 40
    ann = AnnTopK(0.1, 4, window, 256, [True, True])
    k = rng.standard_normal((n, 3, 64)).astype(np.float32)
    for start in (0, 400):  # a prefill chunk, then a later chunk: both reach the graphs
        ann.append(0, 7, start, torch.from_numpy(k[start:400 if start == 0 else n]))
    graphs = ann.seqs[7][0][0]
    assert [g.ntotal for g in graphs] == [n - window] * 3
    q = (k[rng.integers(0, n - window, 9), np.arange(9) // 3] * 0.6 + rng.standard_normal((9, 64)) * 0.3)
    q = q.astype(np.float32)[None]
    s = torch.einsum("nhd,hd->hn", torch.from_numpy(k).repeat_interleave(3, 1), torch.from_numpy(q[0]))
    found = ann._chooser(0, [7], q)(0, s, 4, n - window, budget)
    exact = s[:, 4:n - window].topk(budget, dim=1).indices + 4
    recall = np.mean([len(set(f.tolist()) & set(e.tolist())) / budget for f, e in zip(found, exact)])
    assert recall > 0.8
    tables, _ = write_sequences(store, rng, [300])
    lens = np.array([300], np.int32)
    exact_out, _ = store.decode_attention(0, q, tables, lens, 0.125)
    np.testing.assert_allclose(AnnTopK(1.0, 4, 16, 256, [True])
                               .decode_attention(store, 0, [0], q, None, tables, lens, 0.125)[0], exact_out, atol=1e-5, rtol=1e-4)


def test_table_arrays_are_separate_zeroed_views_of_one_buffer():
    """table_arrays: per set, offsets [L, buckets + 1] uint16 and ids shaped as empty_ids, zeroed, aligned for
    merge_tables' uint64 view, packed in one buffer without overlapping; table_set into them builds the same tables."""
    arrays = lsh.table_arrays(3, 5, 16, 1000)
    spans = []
    for offsets, ids in arrays:
        assert offsets.shape == (5, 17) and offsets.dtype == np.uint16 and offsets.flags.c_contiguous
        assert ids.shape == lsh.empty_ids(5, 1000).shape and ids.dtype == np.uint8 and not ids.any()
        assert ids.ctypes.data % 8 == 0
        spans += [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in (offsets, ids)]
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] - spans[0][0] < sum(end - start for start, end in spans) + 6 * 64  # one buffer, padding only
    codes = np.random.default_rng(0).integers(0, 16, (1000, 5)).astype(np.int32)
    offsets, ids = lsh.table_set(codes, 4, arrays[1])
    ref_offsets, ref_ids = lsh.table_set(codes, 4)
    assert offsets is arrays[1][0] and np.array_equal(offsets, ref_offsets) and np.array_equal(ids, ref_ids)
    assert not arrays[0][1].any() and not arrays[2][1].any()


def test_magicpig_clone_copies_the_state_into_buffers_of_its_own():
    """MagicPig.clone: the same tables, key norms, pending codes and centers as the source, none of them shared."""
    from cpu_attn.magicpig import LshConfig, MagicPig

    rng = np.random.default_rng(1)
    sparse = MagicPig(LshConfig(k=4, l=6, window=8, min_context=16, merge_every=8, dense_layers=(0,)), 2, 2, 64)
    keys = torch.from_numpy(rng.standard_normal((40, 2, 64)).astype(np.float32))
    sparse.append(1, 7, 0, keys, rng.integers(0, 16, (40, 2, 6)).astype(np.int32))
    sparse.clone(7, 8)
    src, dst = sparse.seqs[7][1], sparse.seqs[8][1]
    assert sparse.seqs[8][0] is None and dst.indexed == src.indexed == 32
    for a, b in [(src.mu, dst.mu), *zip(src.pending, dst.pending), *zip(src.pending_norms, dst.pending_norms),
                 *zip(src.offsets[0], dst.offsets[0]), *zip(src.ids[0], dst.ids[0]), *zip(src.norms, dst.norms)]:
        assert np.array_equal(a, b) and not np.shares_memory(a, b)


def test_magicpig_drops_rejected_drafts_and_indexes_only_accepted_keys():
    """Decode chunks with draft rows, rewritten from the first rejected position the next step: the state
    (indexed keys' tables and norms, pending codes and norms) equals that of a MagicPig that was only ever given
    the accepted keys one at a time, merges across the drafts included; the coder codes the draft rows' queries."""
    from cpu_attn.magicpig import LshConfig, MagicPig

    cfg = LshConfig(k=6, l=12, window=32, min_context=256, merge_every=40, dense_layers=(1,))
    spec, plain = (MagicPig(cfg, num_layers=2, num_kv_heads=2, head_dim=64) for _ in range(2))
    coder = spec.coder()
    rng = np.random.default_rng(5)
    keys = torch.randn(900, 2, 64) + 1.0
    prompt = coder.codes(0, keys[:1], keys[:400], [(7, 0, 400, 0)])[1]
    for mp in (spec, plain):
        mp.append(0, 7, 0, keys[:400], prompt)
    done = 400
    while done < 800:
        drafts = int(rng.integers(1, 6))
        accepted = int(rng.integers(0, drafts + 1))
        rows = keys[done:done + drafts + 1].clone()
        rows[accepted + 1:] = torch.randn(drafts - accepted, 2, 64) * 4  # rejected drafts' keys
        q_codes, k_codes = coder.codes(0, torch.randn(drafts + 2, 4, 64), torch.cat([keys[:1], rows]),
                                       [(8, 0, 1, 0), (7, done, drafts + 1, drafts)])
        assert q_codes.shape[0] == drafts + 2  # a query row each: the one-token chunk's and every draft row's
        spec.begin_step()
        spec.append(0, 7, done, rows, k_codes[1:].numpy(), decode=True)
        for n in range(done, done + accepted + 1):
            plain.begin_step()
            plain.append(0, 7, n, keys[n:n + 1], coder.codes(0, keys[:1], keys[n:n + 1], [(7, n, 1, 0)])[1])
        done += accepted + 1
    last = coder.codes(0, keys[:1], keys[done:done + 1], [(7, done, 1, 0)])[1]
    for mp in (spec, plain):  # one more decode each: the rejected keys of the last step dropped too
        mp.begin_step()
        mp.append(0, 7, done, keys[done:done + 1], last)
    a, b = spec.seqs[7][0], plain.seqs[7][0]
    assert a.indexed == b.indexed >= 400 + 2 * cfg.merge_every
    np.testing.assert_array_equal(np.concatenate(a.pending), np.concatenate(b.pending))
    np.testing.assert_array_equal(np.concatenate(a.pending_norms), np.concatenate(b.pending_norms))
    for x, y in zip(a.norms, b.norms):
        np.testing.assert_array_equal(x, y)
    for sets_a, sets_b in ((a.offsets, b.offsets), (a.ids, b.ids)):
        for x, y in zip(sets_a, sets_b):
            for h in range(2):
                np.testing.assert_array_equal(x[h], y[h])
    with pytest.raises(ValueError, match="written again"):
        spec.append(0, 7, a.indexed - 1, keys[:2], k_codes[:2].numpy(), decode=True)
