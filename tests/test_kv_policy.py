"""Layered KV sparsity: the policy's rules, its kernels against plain NumPy, and the layered attention
worker against a plain implementation of the same policy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_attn.kernels import attention_scratch
from cpu_attn.kv_policy import (accumulate_probs, compact_rows, observed_attention, paged_decode_attention_scored,
                                pooled, select_keep)
from cpu_attn.kv_store import PagedKVStore
from cpu_attn.layered_worker import LayeredAttentionWorker, LayeredChunkLayout
from cpu_attn.worker import AttentionWorker, ChunkLayout
from hetcore.kv_policy import KVPolicy, KVPolicyError, KVView, SeqRows
from tests.test_cpu_attn import fill, naive_attention


# ---- the policy's settings and rules

@pytest.mark.parametrize("policy,num_layers,context,message", [
    (KVPolicy("layered", full_layers=31, budget_tokens=256), 30, 8192, "kv_full_layers 31 is outside 1..30"),
    (KVPolicy("layered", full_layers=0, budget_tokens=256), 30, 8192, "kv_full_layers 0 is outside 1..30"),
    (KVPolicy("layered", budget_tokens=9000), 30, 8192, "kv_budget_tokens 9000 is larger than the context"),
    (KVPolicy("layered", budget_tokens=64, window=64), 30, 8192, "kv_window 64 plus kv_sinks 4 is larger"),
    (KVPolicy("layered", budget_tokens=100, window=64, schedule="pyramid"), 30, 8192, "smallest layer budget (50"),
])
def test_bad_layouts_are_refused_in_one_line(policy, num_layers, context, message):
    with pytest.raises(KVPolicyError, match=message.replace("(", r"\(")) as err:
        policy.layout(num_layers, context)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw,message", [
    (dict(kind="sparse"), "kv_policy must be one of full, layered"),
    (dict(budget_tokens=10, budget_ratio=0.5), "not both"),
    (dict(budget_ratio=1.5), r"kv_budget_ratio must be in \(0, 1\]"),
    (dict(schedule="steps"), "kv_budget_schedule must be one of flat, pyramid"),
    (dict(window_ratio=1.0), r"kv_window_ratio must be in \(0, 1\)"),
    (dict(focus=-1), "kv focus must be >= 0"),
    (dict(window=64, window_ratio=0.25), "give kv_window or kv_window_ratio, not both"),
])
def test_bad_settings_are_refused_in_one_line(kw, message):
    with pytest.raises(KVPolicyError, match=message):
        KVPolicy(**kw)


def test_window_ratio_follows_the_budget_and_always_fits():
    policy = KVPolicy("layered", full_layers=1, budget_ratio=0.25, window_ratio=0.375, sinks=4)
    layout = policy.layout(30, 8192)
    assert [policy.window_rows(layout.budget(1, n)) for n in (8000, 2000, 1)] == [750, 187, 2]
    assert layout.budget(1, 1) == 7  # the least budget that holds 4 sinks and a window of 0.375 of it
    assert policy.sinks + policy.window_rows(7) <= 7


def test_groups_of_smollm2_shape():
    layout = KVPolicy("layered", full_layers=3, budget_tokens=1024).layout(30, 8192)
    assert (layout.slots, layout.num_groups) == (3, 10)
    assert [layout.group_of(l) for l in (0, 2, 3, 29)] == [(0, 0), (0, 2), (1, 0), (9, 2)]
    assert [layout.budget(g, 4000) for g in range(1, 10)] == [1024] * 9
    pyramid = KVPolicy("layered", full_layers=3, budget_tokens=1024, schedule="pyramid").layout(30, 8192)
    budgets = [pyramid.budget(g, 4000) for g in range(1, 10)]
    assert budgets[0] == 1536 and budgets[-1] == 512 and budgets == sorted(budgets, reverse=True)
    assert abs(np.mean(budgets) - 1024) <= 1
    uneven = KVPolicy("layered", full_layers=4, budget_tokens=1024).layout(30, 8192)
    assert (uneven.slots, uneven.factors[:3]) == (2, (None, None, 1.0))  # two full groups of 2 layers
    assert KVPolicy().layout(30, 8192).num_groups == 1
    ratio = KVPolicy("layered", budget_ratio=0.25).layout(30, 8192)
    assert ratio.budget(1, 4000) == 1000 and ratio.budget(1, 100) == 25  # the window a share of it
    fixed = KVPolicy("layered", budget_ratio=0.25, window=64).layout(30, 8192)
    assert fixed.budget(1, 100) == 68  # never below sinks + window


def test_rows_grow_through_the_prompt_then_evict_at_its_end_and_every_slack():
    layout = KVPolicy("layered", full_layers=1, budget_tokens=100, window=8, sinks=2, evict_slack=16,
                      observe=32).layout(3, 4096)
    rows = SeqRows(layout)
    assert layout.num_groups == 3 and rows.rows == [0, 0]
    assert rows.advance(280, end=300) == ((0, 0), (280, 280), 12)  # a middle chunk: nothing evicted
    assert rows.advance(20, end=300) == ((280, 280), (100, 100), 20)  # the prompt's end
    for i in range(16):
        assert rows.advance(1, end=301 + i)[:2] == ((100 + i,) * 2, (101 + i,) * 2)
    assert rows.advance(1, end=317)[:2] == ((116, 116), (100, 100))  # 117 > 100 + 16
    chunked = SeqRows(KVPolicy("layered", full_layers=1, budget_tokens=100, window=8, sinks=2, evict_slack=16,
                               prefill_evict=True, observe=1024, chunk_observe=32).layout(3, 4096))
    assert chunked.advance(64, end=192) == ((0, 0), (64, 64), 32)  # each chunk's last 32 score
    assert chunked.advance(64, end=192) == ((64, 64), (100, 100), 32)  # 128 > 116: within the prompt
    assert chunked.advance(64, end=192) == ((100, 100), (100, 100), 32) and chunked.prompt_tokens == 192


@pytest.mark.parametrize("schedule", ["flat", "pyramid"])
def test_a_prompt_of_evicting_prompt_tokens_evicts_in_every_sparse_group(schedule):
    """What the server's warm-up sends, so that the eviction kernels are compiled before it is ready."""
    layout = KVPolicy("layered", full_layers=2, budget_tokens=100, schedule=schedule).layout(30, 4096)
    rows = SeqRows(layout)
    n = layout.evicting_prompt()
    before, after, _ = rows.advance(n, end=n)
    assert before == (0,) * 14 and max(after) < n
    assert (KVPolicy("layered", budget_ratio=0.25).layout(30, 4096).evicting_prompt() == 0
            == KVPolicy().layout(30, 4096).evicting_prompt())


# ---- kernels against plain NumPy

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens", [
    (9, 3, 64, 16, [1, 17, 100, 5]),
    (3, 1, 12, 16, [33, 5]),  # head_dim not a multiple of 8
    (2, 1, 64, 8, [900]),  # a long context cut into parts (split_parts)
])
def test_scored_decode_matches_numpy(dtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens):
    rng = np.random.default_rng(3)
    store = PagedKVStore(1, num_kv_heads, head_dim, block_size, 300, dtype)
    tables, kv = fill(store, rng, seq_lens, num_heads)
    q = rng.standard_normal((len(seq_lens), num_heads, head_dim)).astype(np.float32)
    scale = head_dim**-0.5
    lens = np.asarray(seq_lens, np.int32)
    out, lse = np.empty_like(q), np.empty(q.shape[:2], np.float32)
    raw = np.full((len(lens), num_heads, lens.max()), np.nan, np.float32)
    work = len(lens) * num_kv_heads
    scratch = attention_scratch(work, num_heads // num_kv_heads, block_size, head_dim, 1 if len(lens) > 1 else 4)
    paged_decode_attention_scored(q, store.k[0], store.v[0], tables, lens, np.float32(scale), out, lse, raw,
                                  tuple(scratch))
    probs = np.zeros((len(lens), num_kv_heads, lens.max()), np.float32)
    accumulate_probs(raw, lse, lens, num_kv_heads, probs)
    group = num_heads // num_kv_heads
    for b, (k, v) in enumerate(kv):
        ref_out, ref_lse = naive_attention(q[b], k, v, scale)
        np.testing.assert_allclose(out[b], ref_out, atol=2e-5)
        np.testing.assert_allclose(lse[b], ref_lse, atol=2e-5)
        s = np.einsum("hd,thd->ht", q[b].astype(np.float64), np.repeat(k, group, axis=1).astype(np.float64)) * scale
        np.testing.assert_allclose(raw[b, :, :seq_lens[b]], s, atol=2e-5)
        p = np.exp(s - ref_lse[:, None]).reshape(num_kv_heads, group, -1).sum(1)
        np.testing.assert_allclose(probs[b, :, :seq_lens[b]], p, atol=2e-5)
        np.testing.assert_allclose(probs[b].sum(-1), group, rtol=1e-5)  # each head's probabilities sum to 1


def test_observed_attention_matches_numpy():
    rng = np.random.default_rng(4)
    n, num_heads, num_kv_heads, d = 40, 6, 2, 16
    q = rng.standard_normal((5, num_heads, d)).astype(np.float32)
    k, v = (rng.standard_normal((n, num_kv_heads, d)).astype(np.float32) for _ in range(2))
    pos = np.arange(n - 5, n) - 3  # causal: query at row p sees rows 0..p
    out, scores, tail = observed_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), pos, 0.25,
                                           last=2)
    ref, ref_tail = np.zeros((num_kv_heads, n)), np.zeros((num_kv_heads, n))
    for i, p in enumerate(pos):
        if i == 3:
            ref_tail[:] = ref
        o, lse = naive_attention(q[i], k[:p + 1], v[:p + 1], 0.25)
        np.testing.assert_allclose(out[i].numpy(), o, atol=1e-5)
        for h in range(num_heads):
            s = k[:p + 1, h // 3] @ q[i, h] * 0.25
            ref[h // 3, :p + 1] += np.exp(s - lse[h])
    np.testing.assert_allclose(scores, ref, atol=1e-5)
    np.testing.assert_allclose(tail, ref - ref_tail, atol=1e-5)


def plain_pooled(scores, pool):
    n, half = len(scores), pool // 2
    return [sum(scores[j] for j in range(r - half, r + half + 1) if 0 <= j < n) / pool for r in range(n)]


def plain_keep(scores, budget, sinks, window):
    """select_keep, one row at a time."""
    n = len(scores)
    fixed = set(range(sinks)) | set(range(n - window, n))
    ranked = sorted((r for r in range(n) if r not in fixed), key=lambda r: (-scores[r], r))
    return sorted(fixed | set(ranked[:budget - len(fixed)]))


@pytest.mark.parametrize("n,budget,sinks,window", [(50, 20, 4, 8), (21, 20, 0, 1), (64, 12, 4, 8), (30, 10, 0, 10)])
def test_select_keep_matches_plain(n, budget, sinks, window):
    rng = np.random.default_rng(n)
    scores = (rng.integers(0, 1000, (3, n)) / 1000).astype(np.float32)
    scores[1, ::3] = 0.5  # ties: the earlier row wins
    keep = select_keep(scores, budget, sinks, window)
    assert keep.shape == (3, budget)
    for h in range(3):
        assert keep[h].tolist() == plain_keep(scores[h].tolist(), budget, sinks, window)


@pytest.mark.parametrize("n,width", [(50, 7), (21, 3), (40, 31), (10, 31)])
def test_pooled_matches_plain(n, width):
    scores = np.random.default_rng(n).random((3, n)).astype(np.float32)
    got = pooled(scores, width)
    for h in range(3):
        np.testing.assert_allclose(got[h], plain_pooled(scores[h].tolist(), width), rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_compact_rows_matches_numpy_gather(dtype):
    rng = np.random.default_rng(5)
    store = PagedKVStore(1, 2, 8, 4, 20, dtype)
    table = np.asarray([7, 3, 11, 0, 5], np.int64)
    k, v = (rng.standard_normal((19, 2, 8)).astype(np.float32) for _ in range(2))
    rows = np.arange(19)
    store.write(0, table[rows // 4] * 4 + rows % 4, k, v)
    before_k, before_v = store.gather(0, table, 19)
    keep = np.stack([select_keep(rng.random((1, 19)), 9, 2, 3)[0] for _ in range(2)])
    compact_rows(store.k[0], store.v[0], table, keep)
    after_k, after_v = store.gather(0, table, 9)
    for h in range(2):
        np.testing.assert_array_equal(after_k[:, h], before_k[keep[h], h])
        np.testing.assert_array_equal(after_v[:, h], before_v[keep[h], h])


# ---- Oaken stores: the scored kernel and compaction

def _oaken_sequence(transforms, int_dots, recent_blocks, n=45, seed=8, sparse_fraction=0.5):
    """An Oaken store (2 layers, 3 kv-heads, head_dim 64, blocks of 16) holding one sequence of n rows written
    as write_sequences does (a prompt, then one row at a time), and its table."""
    from tests.test_kv_formats import channel_transforms, oaken_store, write_sequences

    tf = channel_transforms(np.random.default_rng(2), 3, 64, transforms)
    store = oaken_store(num_blocks=12, sparse_fraction=sparse_fraction, recent_blocks=recent_blocks,
                        row_positions=True, **tf)
    offset = tf["key_bias"][0].reshape(3, 64) if "bias" in transforms else 0.0
    tables, kv = write_sequences(store, np.random.default_rng(seed), [n], offset=offset,
                                 rope_inv_freq=tf.get("rope_inv_freq"))
    store.int_dots = int_dots
    return store, tables, kv[0]


@pytest.mark.parametrize("transforms", [(), ("smooth", "bias", "rotate")])
@pytest.mark.parametrize("int_dots,recent_blocks", [(False, 0), (True, 0), (True, 2)])
def test_oaken_scored_decode_is_its_decode_with_the_logits(transforms, int_dots, recent_blocks):
    """scored_decode_attention: decode_attention's outputs to the bit, and every row's logit as q . k over the
    keys the store holds (gather) within the int16 dot products' rounding."""
    from cpu_attn import oaken

    if int_dots and not oaken.INT16:
        pytest.skip("no AVX2 here (or NUMBA_CPU_NAME set)")
    store, tables, _ = _oaken_sequence(transforms, int_dots, recent_blocks)
    rng = np.random.default_rng(9)
    lens = np.asarray([45], np.int32)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    scale = 64**-0.5
    out, lse = store.decode_attention(0, q, tables, lens, scale)
    out_s, lse_s, raw = store.scored_decode_attention(0, q, tables, lens, scale)
    np.testing.assert_array_equal(out_s, out)
    np.testing.assert_array_equal(lse_s, lse)
    k, _ = store.gather(0, tables[0], 45)
    s = np.einsum("hd,thd->ht", q[0].astype(np.float64), np.repeat(k, 3, axis=1).astype(np.float64)) * scale
    np.testing.assert_allclose(raw[0], s, atol=(2e-3 if int_dots else 2e-5) * np.abs(s).max())
    probs = np.zeros((1, 3, 45), np.float32)
    accumulate_probs(raw, lse, lens, 3, probs)
    np.testing.assert_allclose(probs[0].sum(-1), 3, rtol=1e-3)  # each query head's probabilities sum to 1


def _whole_tokens(rng, held, kept, sinks, window, num_kv_heads=3):
    """A keep [Hkv, kept] of whole tokens (the same rows in every kv-head), rows 0..3 among them."""
    scores = rng.random((1, held))
    scores[0, :4] = 2.0
    return np.repeat(select_keep(scores, kept, sinks, window), num_kv_heads, axis=0)


def _goes_on(store, tables, rng, kept, n=10, skip=20):
    """Rows written after a compaction, one at a time at the next positions (`skip` past the rows' own), are
    attended by the kernel as over the rows gather returns (its full blocks' keys centered at each row's position,
    or, where a block's rows are in order, from its first one's)."""
    table = tables[0]
    k_new, v_new = (rng.standard_normal((n, 3, 64)).astype(np.float32) for _ in range(2))
    rows = np.arange(kept, kept + n)
    for t in range(n):
        store.write(0, table[rows[t:t + 1] // 16] * 16 + rows[t:t + 1] % 16, k_new[t:t + 1], v_new[t:t + 1],
                    rows[t:t + 1] + skip)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    k, v = store.gather(0, table, kept + n)
    ref_out, ref_lse = naive_attention(q[0], k, v, 64**-0.5)
    from cpu_attn import oaken

    for int_dots in {False, oaken.INT16}:  # rows decoded; full blocks in int16 dot products (looser: their rounding)
        store.int_dots = int_dots
        out, lse = store.decode_attention(0, q, tables, np.asarray([kept + n], np.int32), 64**-0.5)
        bound = 2e-3 if int_dots else 1e-4
        np.testing.assert_allclose(out[0], ref_out, atol=bound * np.abs(ref_out).max())
        np.testing.assert_allclose(lse[0], ref_lse, atol=bound)


@pytest.mark.parametrize("transforms", [(), ("smooth", "bias", "rotate")])
@pytest.mark.parametrize("recent_blocks", [0, 2])
def test_oaken_compact_moves_codes_and_goes_on(transforms, recent_blocks):
    """compact: row i holds its old row keep[i], as a store that quantized every row when it was written holds
    it, to the bit: a quantized row's codes move (its key centered at its own position), a row still in a
    full-precision tail is quantized once, or stays a float while its block stays a tail. The tails past the rows
    kept go free, and the sequence goes on from there."""
    store, tables, _ = _oaken_sequence(transforms, False, recent_blocks)
    quantized, _, _ = _oaken_sequence(transforms, False, 0)  # the same rows, every one quantized at its write
    table = tables[0]
    ref_k, ref_v = quantized.gather(0, table, 45)
    rng = np.random.default_rng(10)
    for held, kept in ((45, 40), (40, 25)):  # the first keeps the tail block, the second empties it
        keep = _whole_tokens(rng, held, kept, 2, 6)
        order = keep[0] if held == 45 else order[keep[0]]  # the rows written, of the rows kept
        store.compact(0, table, held, keep)
        if held == 45 and recent_blocks:
            assert store.tail_of[0, table[2]] >= 0 and store.tail_len[0, store.tail_of[0, table[2]]] == 40 - 32
    k, v = store.gather(0, table, 25)
    np.testing.assert_array_equal(store._row_positions(0, table, 25), np.repeat(order[:, None], 3, axis=1))
    np.testing.assert_array_equal(k, ref_k[order])
    np.testing.assert_array_equal(v, ref_v[order])
    assert (store.tail_of[0, table] < 0).all()  # the tail past the rows kept went free
    _goes_on(store, tables, rng, 25)


def test_oaken_compact_requantizes_rows_past_a_blocks_sparse_room():
    """Rows whose sparse entries overflow the room left in their new block are quantized again within it: every
    block keeps its budget, the other rows move to the bit, and those rows stay within twice a row's error."""
    store, tables, written = _oaken_sequence((), False, 0, n=64, sparse_fraction=0.135)  # ~26 entries a row
    table = tables[0]
    before_k, _ = store.gather(0, table, 64)
    per_row = store.counts[0, 0, table[np.arange(64) // 16], np.arange(64) % 16].sum(-1)  # [64] entries of K rows
    heavy = np.argsort(per_row[4:56], kind="stable")[::-1][:20] + 4  # the rows of the most entries, kept
    keep = np.repeat(np.unique(np.concatenate([np.arange(4), heavy, np.arange(56, 64)]))[None], 3, 0)
    assert per_row[keep[0, :16]].sum() > store.budget  # the first block cannot hold them all
    store.compact(0, table, 64, keep)
    kept = keep.shape[1]
    assert all(int(store.counts[0, kv, b].sum()) <= store.budget for kv in (0, 1) for b in table[:-(-kept // 16)])
    k, _ = store.gather(0, table, kept)
    same = (k == before_k[keep[0]]).all(axis=(1, 2))
    assert 0 < (~same).sum() < kept // 2
    once = np.abs(before_k - written[0]).max(axis=-1) / np.abs(written[0]).max(axis=-1)
    again = np.abs(k - written[0][keep[0]]).max(axis=-1) / np.abs(written[0][keep[0]]).max(axis=-1)
    assert again.max() <= 2 * once.max(), (again, once)
    _goes_on(store, tables, np.random.default_rng(3), kept)


def test_head_rows_store_compacts_each_kv_head_by_its_own_rows():
    """HeadRowsStore (the layered cache over Oaken): each kv-head a one-head Oaken layer with its calibration's
    share, so each kv-head keeps its own rows, moved as their codes (bit-exact), and attention over them is
    NumPy's over the rows gather returns."""
    from cpu_attn.calibrate import OakenThresholds, hadamard
    from cpu_attn.kv_store import layered_stores

    rng = np.random.default_rng(12)
    c = 3 * 64
    cal = OakenThresholds(values=np.tile(np.array([-2.0, -0.1, 0.1, 2.0], np.float32), (2, 2, 1)),
                          key_bias=rng.uniform(-3, 3, (2, c)).astype(np.float32),
                          rope_inv_freq=10000.0 ** -(np.arange(32) * 2 / 64), rotation=hadamard(64, seed=3))
    stores = layered_stores("oaken", 1, 2, 3, 64, 16, 12, cal, 0.5)
    store = stores[1]  # layer 1's group
    assert store.rows_per_head and store.inner.num_kv_heads == 1 and store.inner.num_layers == 3
    table = np.asarray([5, 2, 9], np.int64)
    k, v = (rng.standard_normal((45, 3, 64)).astype(np.float32) for _ in range(2))
    rows = np.arange(45)
    store.write(0, table[rows // 16] * 16 + rows % 16, k, v, rows)
    before_k, before_v = store.gather(0, table, 45)
    assert np.abs(before_k - k).max() < 0.5 * np.abs(k).max()  # quantized, not garbage
    keep = np.stack([select_keep(rng.random((1, 45)), 25, 2, 6)[0] for _ in range(3)])
    assert not (keep == keep[0]).all()
    store.compact(0, table, 45, keep)
    after_k, after_v = store.gather(0, table, 25)
    for h in range(3):
        np.testing.assert_array_equal(after_k[:, h], before_k[keep[h], h])
        np.testing.assert_array_equal(after_v[:, h], before_v[keep[h], h])
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    tables = table[None].astype(np.int32)
    out, lse, raw = store.scored_decode_attention(0, q, tables, np.asarray([25], np.int32), 64**-0.5)
    ref_out, ref_lse = naive_attention(q[0], after_k, after_v, 64**-0.5)
    np.testing.assert_allclose(out[0], ref_out, atol=2e-3 * np.abs(ref_out).max())
    np.testing.assert_allclose(lse[0], ref_lse, atol=2e-3)
    assert raw.shape == (1, 9, 25)


# ---- the layered worker against a plain implementation

class PlainLayered:
    """The policy on one sparse layer, position lists and float64 NumPy: kept[h] is kv-head h's kept
    positions in order, score[h] their scores."""

    def __init__(self, num_kv_heads, scale, observe, sinks, window, decay=1.0, pool=1, prefill_evict=False, focus=0):
        self.k, self.v = {}, {}
        self.kept = [[] for _ in range(num_kv_heads)]
        self.score = [[] for _ in range(num_kv_heads)]
        self.scale, self.observe, self.sinks, self.window, self.decay = scale, observe, sinks, window, decay
        self.pool, self.prefill_evict, self.focus = pool, prefill_evict, focus

    def chunk(self, q, k, v, start, keep_after, end):
        """A chunk of the prefill (or decode) that runs to position `end`: the prompt's last `observe` queries
        score (with prefill_evict, each chunk's last `observe`, KVPolicy.chunk_observe); at an eviction after it,
        the chunk's last `focus` queries rank the rows a second time."""
        n, num_heads, _ = q.shape
        num_kv_heads = len(self.kept)
        group = num_heads // num_kv_heads
        for i in range(n):
            self.k[start + i], self.v[start + i] = k[i], v[i]
            for h in range(num_kv_heads):
                self.kept[h].append(start + i)
                self.score[h].append(0.0)
        out = np.zeros(q.shape)
        focus = [[0.0] * len(row) for row in self.score]
        if n == 1:  # a decode step: the scores so far fade by the decay first
            self.score = [[x * self.decay for x in row] for row in self.score]
        for i in range(n):
            pos = start + i
            scored = n == 1 or (i >= n - self.observe if self.prefill_evict else pos >= end - self.observe)
            for h in range(num_heads):
                kvh = h // group
                rows = [j for j, p in enumerate(self.kept[kvh]) if p <= pos]
                kk = np.stack([self.k[self.kept[kvh][j]][kvh] for j in rows]).astype(np.float64)
                vv = np.stack([self.v[self.kept[kvh][j]][kvh] for j in rows]).astype(np.float64)
                s = kk @ q[i, h] * self.scale
                p = np.exp(s - s.max())
                p /= p.sum()
                out[i, h] = p @ vv
                if scored:
                    for j, pj in zip(rows, p):
                        self.score[kvh][j] += pj
                        if n > 1 and i >= n - self.focus:
                            focus[kvh][j] += pj
        for h in range(num_kv_heads):
            if keep_after < len(self.kept[h]):  # after a prompt chunk, ranked and carried on pooled
                pool = self.pool if n > 1 else 1
                if self.focus and n > 1:
                    f = [max(a, b) for a, b in zip(focus[h], plain_pooled(focus[h], pool))]
                    ranked = [max(a, b * sum(self.score[h]) / sum(f)) for a, b in zip(self.score[h], f)]
                else:
                    ranked = [max(a, b) for a, b in zip(self.score[h], plain_pooled(self.score[h], pool))]
                keep = plain_keep(ranked, keep_after, self.sinks, self.window)
                self.kept[h] = [self.kept[h][j] for j in keep]
                self.score[h] = [ranked[j] for j in keep]
        return out


@pytest.mark.parametrize("decay,prefill_evict,pool,focus,window_ratio",
                         [(1.0, False, 1, 0, None), (0.8, False, 1, 0, None), (1.0, True, 3, 0, None),
                          (1.0, False, 5, 0, None), (1.0, False, 5, 3, 0.5), (1.0, True, 3, 2, None)])
def test_layered_worker_matches_plain_policy(decay, prefill_evict, pool, focus, window_ratio):
    """Two sequences, 2 layers (layer 0 full, layer 1 sparse), chunked prompts then decodes with
    evictions, mixed in steps: every output of the sparse layer as the plain implementation's, the
    full layer's as AttentionWorker's over a plain store."""
    rng = np.random.default_rng(6)
    num_heads, num_kv_heads, d, bs = 4, 2, 64, 4
    policy = KVPolicy("layered", full_layers=1, budget_tokens=12, sinks=2, observe=10, chunk_observe=6, evict_slack=3,
                      score_decay=decay, prefill_evict=prefill_evict, score_pool=pool, focus=focus,
                      window=None if window_ratio else 4, window_ratio=window_ratio)
    layout = policy.layout(2, 1024)
    store = PagedKVStore(layout.slots, num_kv_heads, d, bs, 64, "float32")
    worker = LayeredAttentionWorker([store] * layout.num_groups, d, layout)
    full = AttentionWorker(PagedKVStore(1, num_kv_heads, d, bs, 64, "float32"), d)
    scale = d**-0.5
    prompts = {0: [9, 8, 7], 1: [23]}  # chunk sizes of each sequence's prompt (17 > 12 + 3 rows after two)
    rows = {s: SeqRows(layout) for s in prompts}
    observe = policy.chunk_observe if prefill_evict else policy.observe
    plain = {s: PlainLayered(num_kv_heads, scale, observe, policy.sinks, policy.window_rows(12), decay, pool,
                             prefill_evict, focus) for s in prompts}
    tables = {0: (list(range(0, 10)), list(range(10, 20))), 1: (list(range(20, 32)), list(range(32, 44)))}
    pos = {s: 0 for s in prompts}
    evicted = 0
    for step in range(16):
        chunks = []
        for s, sizes in prompts.items():
            n = sizes[step] if step < len(sizes) else 1
            end = sum(sizes) if step < len(sizes) else pos[s] + 1
            before, after, observed = rows[s].advance(n, end)
            evicted += after[0] < before[0] + n
            view = KVView((tuple(tables[s][1]),), before, after, observed)
            chunks.append((s, n, view, end))
        layouts = [LayeredChunkLayout(num_tokens=n, start_pos=pos[s], block_table=tuple(tables[s][0]), seq_id=s,
                                      kv_view=view) for s, n, view, _ in chunks]
        worker.begin_step(layouts)
        full.begin_step([ChunkLayout(num_tokens=n, start_pos=pos[s], block_table=tuple(tables[s][0]), seq_id=s)
                         for s, n, _, _ in chunks])
        total = sum(n for _, n, _, _ in chunks)
        q = rng.standard_normal((total, num_heads, d)).astype(np.float32)
        k, v = (rng.standard_normal((total, num_kv_heads, d)).astype(np.float32) for _ in range(2))
        tq, tk, tv = torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)
        o0 = worker.attend(0, tq, tk, tv).reshape(total, num_heads, d).numpy()
        np.testing.assert_allclose(o0, full.attend(0, tq, tk, tv).reshape(total, num_heads, d).numpy(), atol=1e-5)
        o1 = worker.attend(1, tq, tk, tv).reshape(total, num_heads, d).numpy()
        row = 0
        for s, n, view, end in chunks:
            ref = plain[s].chunk(q[row:row + n], k[row:row + n], v[row:row + n], pos[s], view.keep_after[0], end)
            np.testing.assert_allclose(o1[row:row + n], ref, atol=2e-5, err_msg=f"step {step} seq {s}")
            row += n
            pos[s] += n
    assert evicted >= 6  # both prompts' ends and several decode evictions were exercised


# ---- through hetserve eval's path, on a tiny random model

def test_eval_layered_runs_beside_full_and_equals_it_when_nothing_is_evicted(tmp_path):
    from cpu_attn.calibrate import text_windows
    from evaluation.evaluate import evaluate
    from gpu_model.loader import load_model
    from tests.test_model import tiny_model_dir

    model_dir, _ = tiny_model_dir(tmp_path, head_dim=64, hidden_size=128)
    model = load_model(model_dir)
    windows = text_windows(list(np.random.default_rng(4).integers(0, 101, 1000)), 3, 60)
    layers = model.cfg.num_layers
    roomy = KVPolicy("layered", full_layers=1, budget_tokens=64, window=8, sinks=2)  # budget >= every window
    full, layered = evaluate(model, windows, ["fp32"], prefill_tokens=20, batch_windows=2, block_size=4,
                             progress=False, kv_policy=roomy, prefill_chunk_tokens=8)
    assert layered["kv_policy"] == "layered" and layered["kv_kept_frac"] == 1.0
    assert layered["ppl"] == pytest.approx(full["ppl"], rel=1e-5) and layered["kl_mean"] == pytest.approx(0, abs=1e-7)
    tight = KVPolicy("layered", full_layers=1, budget_tokens=12, window=4, sinks=2, evict_slack=4)
    _, sparse = evaluate(model, windows, ["fp32"], prefill_tokens=20, batch_windows=2, block_size=4,
                         progress=False, kv_policy=tight)
    # layer 0 keeps every token, the others 12 to 16 of 21..59
    lo, hi = ((1 + (layers - 1) * rows / n) / layers for rows, n in ((12, 59), (16, 21)))
    assert lo < sparse["kv_kept_frac"] < hi < 1
    assert sparse["kl_mean"] > 0 and sparse["ppl_full"] == pytest.approx(full["ppl"], rel=1e-6)
    with pytest.raises(ValueError, match="fp16, fp32 and oaken KV formats, not int4"):
        evaluate(model, windows, ["int4"], prefill_tokens=20, kv_policy=tight)


def test_eval_layered_over_oaken_equals_full_oaken_when_nothing_is_evicted(tmp_path):
    """Oaken KV under the layered policy: each layer group's own store over one pool of codes, with its layers'
    calibration, a row's scales spanning one kv-head. With a budget no window reaches, the full Oaken cache's
    perplexity within 1 % (its rows' scales span every kv-head); with a tight one, rows are compacted and
    perplexity stays within a few percent of it on this tiny model."""
    from cpu_attn.calibrate import calibrate, text_windows
    from evaluation.evaluate import evaluate
    from gpu_model.loader import load_model
    from tests.test_model import tiny_model_dir

    model_dir, _ = tiny_model_dir(tmp_path, head_dim=64, hidden_size=128)
    model = load_model(model_dir)
    ids = list(np.random.default_rng(4).integers(0, 101, 2000))
    cal = calibrate(model, text_windows(ids[:1000], 4, 64), progress=False)
    windows = text_windows(ids[1000:], 3, 60)
    roomy = KVPolicy("layered", full_layers=1, budget_tokens=64, window=8, sinks=2)
    full, layered = evaluate(model, windows, ["oaken"], prefill_tokens=20, batch_windows=2, block_size=4,
                             oaken_cal=cal, progress=False, kv_policy=roomy, prefill_chunk_tokens=8)
    assert layered["kv_format"] == "oaken" and layered["kv_kept_frac"] == 1.0
    assert layered["ppl"] == pytest.approx(full["ppl"], rel=0.01)
    assert layered["effective_bits"] == pytest.approx(full["effective_bits"], rel=0.2)
    tight = KVPolicy("layered", full_layers=1, budget_tokens=12, window=4, sinks=2, evict_slack=4)
    _, sparse = evaluate(model, windows, ["oaken"], prefill_tokens=20, batch_windows=2, block_size=4, oaken_cal=cal,
                         progress=False, kv_policy=tight)
    assert sparse["kv_kept_frac"] < 0.7 and sparse["kl_mean"] > 0
    assert abs(sparse["ppl_vs_full_pct"]) < 10


def test_task_harness_runs_layered_beside_full():
    """SmolLM2 on two 400-token passkey prompts with a budget no sequence reaches: the layered answers
    are the full cache's."""
    from evaluation.tasks import evaluate_task
    from gpu_model.loader import load_model, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer
    from tests.test_tasks import haystack

    model_dir = resolve_model_dir(None)
    model = load_model(model_dir)
    tok = Tokenizer(model_dir, model.cfg.eos_token_ids)
    rows = evaluate_task(model, tok, "passkey", [400], 2, ["fp32"], haystack=haystack(), progress=False,
                         kv_policy=KVPolicy("layered", budget_tokens=1024))
    assert [(r["kv_policy"], r["attention"]) for r in rows] == [("full", "exact"), ("layered", "exact")]
    assert rows[0]["task_accuracy"] == rows[1]["task_accuracy"] == rows[0]["task_accuracy_ref"]
    assert rows[1]["kv_policy_settings"]["budget_tokens"] == 1024 and "kv_policy_settings" not in rows[0]
