"""The paged KV store and its kernels against plain NumPy references."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from numba import njit

from cpu_attn.fp16 import F16C, widen, widen_exact
from cpu_attn.softmax import fast_exp
from cpu_attn.kv_store import PagedKVStore
from cpu_attn.prefill import prefill_attention


def naive_attention(q, k, v, scale):
    """q: [Hq, D]; k, v: [S, Hkv, D] -> out [Hq, D], lse [Hq]; float64 softmax attention with GQA."""
    group = q.shape[0] // k.shape[1]
    out, lse = np.zeros(q.shape), np.zeros(q.shape[0])
    for h in range(q.shape[0]):
        s = k[:, h // group, :].astype(np.float64) @ q[h].astype(np.float64) * scale
        m = s.max()
        p = np.exp(s - m)
        out[h] = p @ v[:, h // group, :] / p.sum()
        lse[h] = m + np.log(p.sum())
    return out, lse


def fill(store, rng, seq_lens, num_heads, scale_k=1.0):
    """Write random K/V for each sequence into shuffled blocks; return tables and the float32 K/V written."""
    bs = store.block_size
    free = list(rng.permutation(store.num_blocks))
    tables, kv = [], []
    for n in seq_lens:
        table = [int(free.pop()) for _ in range(-(-n // bs))]
        k = (rng.standard_normal((n, store.num_kv_heads, store.head_dim)) * scale_k).astype(np.float32)
        v = rng.standard_normal((n, store.num_kv_heads, store.head_dim)).astype(np.float32)
        pos = np.arange(n)
        slots = np.asarray(table)[pos // bs] * bs + pos % bs
        store.write(0, slots.astype(np.int64), k, v)
        if store.dtype == "float16":  # the reference sees what the cache holds
            k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        tables.append(table)
        kv.append((k, v))
    width = max(len(t) for t in tables)
    block_tables = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t
    return block_tables, kv


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens", [
    (9, 3, 64, 16, [1, 17, 100, 5]),
    (4, 4, 128, 8, [8, 9, 3]),
    (6, 2, 64, 1, [7, 1]),
    (3, 1, 12, 16, [33, 5]),  # head_dim not a multiple of 8: the plain scoring loop
    (2, 1, 32, 32, [300]),
])
def test_decode_attention_matches_numpy(dtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens):
    rng = np.random.default_rng(1)
    store = PagedKVStore(2, num_kv_heads, head_dim, block_size, num_blocks=64, dtype=dtype)
    block_tables, kv = fill(store, rng, seq_lens, num_heads)
    q = rng.standard_normal((len(seq_lens), num_heads, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    out, lse = store.decode_attention(0, q, block_tables, np.asarray(seq_lens, np.int32), scale)
    for b, (k, v) in enumerate(kv):
        ref_out, ref_lse = naive_attention(q[b], k, v, scale)
        np.testing.assert_allclose(out[b], ref_out, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(lse[b], ref_lse, atol=2e-5, rtol=1e-5)


def test_large_scores_do_not_overflow_and_zero_query_averages():
    rng = np.random.default_rng(2)
    store = PagedKVStore(1, 1, 64, 16, num_blocks=8, dtype="float32")
    block_tables, kv = fill(store, rng, [40], 1, scale_k=30.0)
    k, v = kv[0]
    q = rng.standard_normal((1, 1, 64)).astype(np.float32) * 30  # scores ~ 1e3
    out, lse = store.decode_attention(0, q, block_tables, np.array([40], np.int32), 0.125)
    ref_out, ref_lse = naive_attention(q[0], k, v, 0.125)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0], ref_out, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(lse[0], ref_lse, rtol=1e-5)
    out0, lse0 = store.decode_attention(0, np.zeros_like(q), block_tables, np.array([40], np.int32), 0.125)
    np.testing.assert_allclose(out0[0, 0], v[:, 0].mean(0), atol=1e-5)
    np.testing.assert_allclose(lse0[0, 0], np.log(40), rtol=1e-6)


def test_fast_exp_matches_numpy_where_the_softmax_uses_it():
    """The kernels' vectorizable exp: relative error < 2e-7 from -86 to 88 (a stale running max lets
    weights reach e^8), ~0 (not NaN) for -inf and below -87."""
    @njit
    def run(x, out):
        for i in range(x.size):
            out[i] = fast_exp(x[i])

    x = np.linspace(-86, 88, 100001).astype(np.float32)
    out = np.empty_like(x)
    run(x, out)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) < 2e-7
    low = np.array([-np.inf, -1e4, -87.5], np.float32)
    run(low, out[:3])
    assert (out[:3] >= 0).all() and (out[:3] < 1e-37).all()


def test_fp16_widening_is_exact_for_every_bit_pattern():
    bits = np.arange(65536, dtype=np.uint16)
    ref = bits.view(np.float16).astype(np.float32).view(np.uint32)
    out = np.empty(65536, np.float32)
    widen_exact(bits, out)  # the path without F16C
    # bit-exact, subnormals, signed zeros, inf and nan payloads included
    np.testing.assert_array_equal(out.view(np.uint32), ref)
    # a block at a time, as the kernel widens: F16C where the CPU has it. Its NaNs come out quiet
    # (vcvtph2ps sets the payload's top bit), every other pattern bit-exact
    out = np.empty((4096, 16), np.float32)
    widen(bits.reshape(4096, 16), out)
    got = out.ravel().view(np.uint32)
    quiet = np.isnan(bits.view(np.float16)) if F16C else np.zeros(65536, bool)
    np.testing.assert_array_equal(got[~quiet], ref[~quiet])
    np.testing.assert_array_equal(got[quiet], ref[quiet] | 0x400000)


def test_float32_blocks_widen_to_themselves():
    rows = np.arange(64, dtype=np.float32).reshape(4, 16)
    out = np.zeros((4, 16), np.float32)
    widen(rows, out)
    np.testing.assert_array_equal(out, rows)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_write_then_gather_roundtrip(dtype):
    rng = np.random.default_rng(3)
    store = PagedKVStore(3, 2, 16, 4, num_blocks=10, dtype=dtype)
    k = rng.standard_normal((11, 2, 16)).astype(np.float32)
    v = rng.standard_normal((11, 2, 16)).astype(np.float32)
    table = [9, 0, 4]
    pos = np.arange(11)
    store.write(2, (np.asarray(table)[pos // 4] * 4 + pos % 4).astype(np.int64), k, v)
    gk, gv = store.gather(2, table, 11)
    tol = 1e-3 if dtype == "float16" else 0
    np.testing.assert_allclose(gk, k, atol=tol * 4)
    np.testing.assert_allclose(gv, v, atol=tol * 4)
    assert not store.k[1].any()  # other layers untouched


@pytest.mark.parametrize("start_pos,num_tokens", [(0, 7), (5, 3), (12, 1), (5, 9), (64, 64), (300, 17)])
def test_prefill_attention_matches_numpy(start_pos, num_tokens):
    """Each query attends keys 0 .. its position: one SDPA with a mask where the chunk is longer than what came
    before it, else the earlier keys and the chunk's own in two parts joined by their log-sum-exps."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((num_tokens, 6, 32)).astype(np.float32)
    k = rng.standard_normal((start_pos + num_tokens, 2, 32)).astype(np.float32)
    v = rng.standard_normal((start_pos + num_tokens, 2, 32)).astype(np.float32)
    out = prefill_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), start_pos, 32 ** -0.5)
    for t in range(num_tokens):
        p = start_pos + t
        ref, _ = naive_attention(q[t], k[:p + 1], v[:p + 1], 32 ** -0.5)
        np.testing.assert_allclose(out[t].numpy(), ref, atol=1e-5)


def test_store_accounting_and_validation():
    assert PagedKVStore.bytes_per_block(30, 3, 64, 16, "float16") == 2 * 30 * 3 * 16 * 64 * 2
    store = PagedKVStore(30, 3, 64, 16, num_blocks=10, dtype="float32")
    assert store.capacity_bytes == 10 * 2 * 30 * 3 * 16 * 64 * 4
    with pytest.raises(ValueError, match="float16 or float32"):
        PagedKVStore(1, 1, 8, 4, 4, dtype="int8")
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVStore(1, 1, 8, 4, 0)


def test_kernel_cache_is_keyed_by_the_package_sources(tmp_path, monkeypatch):
    """A kernel inlining code from another module must not survive a change to that module in
    Numba's cache (Numba checks only the kernel's own file): the cache directory hashes them all,
    subpackages' included."""
    import numba

    from cpu_attn import KERNEL_PACKAGES, numba_cache_dir, sampled

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    before = numba_cache_dir(tmp_path)
    assert before.parent == tmp_path / "cache" and numba_cache_dir(tmp_path) == before
    (tmp_path / "b.py").write_text("y = 2\n")
    assert numba_cache_dir(tmp_path) != before
    (tmp_path / "sub").mkdir()  # a subpackage's modules count too (cpu_attn/oaken/)
    (tmp_path / "sub" / "c.py").write_text("z = 1\n")
    before = numba_cache_dir(tmp_path)
    (tmp_path / "sub" / "c.py").write_text("z = 2\n")
    assert numba_cache_dir(tmp_path) != before
    assert sampled.sampled_decode_attention._cache._cache_path.startswith(numba.config.CACHE_DIR)
    from gpu_model import cpu_decode  # its kernels inline gpu_model/quant_vnni.py's: its sources count too

    assert cpu_decode._decode_layers._cache._cache_path.startswith(numba.config.CACHE_DIR)
    assert Path(cpu_decode.__file__).parent in KERNEL_PACKAGES
