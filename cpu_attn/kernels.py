"""Numba kernels over the paged KV store.

Numba has no float16 on the CPU, so an fp16 cache is stored as its raw uint16 bits and widened
through a 65536-entry float32 table (256 KiB, stays in L2): exact, and one load per element.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

# bits -> float32 for every float16 bit pattern, including subnormals, inf and nan
FP16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


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


def _widen(x, table):
    """One cache element as float32: fp16 bits through the table, float32 as is."""


@overload(_widen, jit_options={"nogil": True})
def _widen_impl(x, table):
    if isinstance(x, types.Integer):
        return lambda x, table: table[x]
    return lambda x, table: np.float32(x)


@njit(cache=True, nogil=True, parallel=True)
def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, table, out, lse,
                           scores, row, m, l):
    """One query token per sequence against its whole paged context.

    q: [B, Hq, D] float32; k_cache, v_cache: [num_blocks, Hkv, block_size, D]
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (tokens incl. the current one)
    table: FP16_TABLE for a uint16 cache, an empty array for float32
    out: [B, Hq, D] float32 (written); lse: [B, Hq] float32 (written, natural log)
    scratch, one slice per (sequence, kv-head) work item W = B * Hkv:
      scores [W, group, block_size], row [W, D], m [W, group], l [W, group] (all float32)

    Each work item widens every K/V row once and uses it for all `group` query heads that share
    it, with an online softmax (running max m, running sum l) advanced block by block.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for item in prange(num_seqs * num_kv_heads):
        b, kvh = item // num_kv_heads, item % num_kv_heads
        s, x, mi, li = scores[item], row[item], m[item], l[item]
        qs = q[b, kvh * group:(kvh + 1) * group]  # [group, D]
        acc = out[b, kvh * group:(kvh + 1) * group]  # [group, D] view: accumulate in place
        acc[:] = 0.0
        mi[:] = -np.inf
        li[:] = 0.0
        n = seq_lens[b]
        for j in range((n + block_size - 1) // block_size):
            block = block_tables[b, j]
            width = min(block_size, n - j * block_size)
            for t in range(width):
                for d in range(head_dim):
                    x[d] = _widen(k_cache[block, kvh, t, d], table)
                for g in range(group):
                    dot = np.float32(0.0)
                    for d in range(head_dim):
                        dot += qs[g, d] * x[d]
                    s[g, t] = dot * scale
            for g in range(group):
                new_m = mi[g]
                for t in range(width):
                    new_m = max(new_m, s[g, t])
                correction = np.exp(mi[g] - new_m)
                li[g] *= correction
                for d in range(head_dim):
                    acc[g, d] *= correction
                for t in range(width):
                    s[g, t] = np.exp(s[g, t] - new_m)
                    li[g] += s[g, t]
                mi[g] = new_m
            for t in range(width):
                for d in range(head_dim):
                    x[d] = _widen(v_cache[block, kvh, t, d], table)
                for g in range(group):
                    p = s[g, t]
                    for d in range(head_dim):
                        acc[g, d] += p * x[d]
        for g in range(group):
            for d in range(head_dim):
                acc[g, d] /= li[g]
            lse[b, kvh * group + g] = mi[g] + np.log(li[g])
