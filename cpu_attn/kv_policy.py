"""Kernels of layered KV sparsity (hetcore/kv_policy.py): token scores from the attention itself,
the choice of the rows a layer keeps, and their compaction within a sequence's blocks.

Scores: a token's score is the sum of the softmax probabilities queries gave it, summed over the
query heads of its kv-head's GQA group (one score per kv-head, as SnapKV pools).
  - decode (H2O): paged_decode_attention_scored is the exact decode kernel that also writes each
    row's raw score q.k * scale; with the kernel's own log-sum-exp, p = exp(s - lse) needs no
    second pass over K (accumulate_probs).
  - prompt (SnapKV): a prompt chunk's last `observe` queries are attended here, explicitly, over
    the whole context (observed_attention): their output is the chunk's output for those rows,
    and their probabilities are the scores.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from cpu_attn.fp16 import kernel_rows
from cpu_attn.kernels import attend_scores, block_scores, finish_unit, merge_parts, part_blocks, prefetch_rows
from cpu_attn.llvm_ir import _FAST
from cpu_attn.softmax import attend_begin, fast_exp


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def paged_decode_attention_scored(q, k_cache, v_cache, block_tables, seq_lens, scale, out, lse, raw, scratch):
    """kernels.paged_decode_attention, that also writes every row's raw score.

    q: [B, Hq, D] float32; k_cache, v_cache: [num_blocks, Hkv, block_size, D]
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (rows incl. the current one)
    out: [B, Hq, D], lse: [B, Hq] (written); raw: [B, Hq, >= max(seq_lens)] float32, row t of
    sequence b gets scale * q[b, h] . k_t (written for t < seq_lens[b] only)
    scratch: kernels.AttentionScratch as a plain tuple
    """
    scores = scratch[0]
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
            s = scores[unit]
            block_scores(q[b, heads], k, width, scale, s)
            for g in range(group):
                for t in range(width):
                    raw[b, kvh * group + g, j * block_size + t] = s[g, t]
            attend_scores(s, v, width, acc, m[unit], l[unit])
        finish_unit(parts, m, l, out, lse, unit, splits, b, heads)
    merge_parts(parts, m, l, out, lse, num_kv_heads)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def accumulate_probs(raw, lse, seq_lens, num_kv_heads, into):
    """into[b, kvh, t] += sum over the group's heads h of exp(raw[b, h, t] - lse[b, h]), t < seq_lens[b].
    raw: [B, Hq, >= max(seq_lens)], lse: [B, Hq], into: [B, Hkv, >= max(seq_lens)] float32.
    One (sequence, kv-head) item per thread, with exponentials that vectorize (softmax.fast_exp: numba's np.exp
    does not without SVML)."""
    num_seqs, num_heads = lse.shape
    group = num_heads // num_kv_heads
    for item in prange(num_seqs * num_kv_heads):
        b, kvh = item // num_kv_heads, item % num_kv_heads
        for h in range(kvh * group, (kvh + 1) * group):
            top = lse[b, h]
            for t in range(seq_lens[b]):
                into[b, kvh, t] += fast_exp(raw[b, h, t] - top)


def observed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: np.ndarray,
                       scale: float, last: int = 0) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None]:
    """Exact causal attention of a few queries, with their probabilities summed per kv-head.

    q: [A, Hq, D] at rows q_pos [A] (row p attends rows 0..p); k, v: [N, Hkv, D]
    -> out [A, Hq, D], scores [Hkv, N] float32 (sum over the A queries and each kv-head's group), and the
    same sum over the last `last` queries only [Hkv, N] (None when last is 0)."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = (q * scale).reshape(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, A, D]
    kt = k.permute(1, 2, 0)  # [Hkv, D, N]
    s = torch.matmul(qg, kt[:, None])  # [Hkv, G, A, N]
    first = int(np.min(q_pos)) + 1  # rows before it are seen by every query: only the later ones need the mask
    mask = torch.arange(first, k.shape[0])[None, :] > torch.as_tensor(q_pos)[:, None]  # [A, N - first]
    s[..., first:].masked_fill_(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.matmul(p, v.permute(1, 0, 2)[:, None])  # [Hkv, G, A, D]
    out = out.permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim)
    tail = p[:, :, num_q - last:].sum(dim=(1, 2)).numpy().astype(np.float32) if last else None
    return out, p.sum(dim=(1, 2)).numpy().astype(np.float32), tail


def pooled(scores: np.ndarray, width: int) -> np.ndarray:
    """The mean of each row's score and its neighbours', `width` rows centred on it (odd width; the ends
    padded with zeros, as SnapKV's avg_pool1d): scores [Hkv, N] -> [Hkv, N] float32."""
    half = width // 2
    padded = np.pad(scores.astype(np.float64), ((0, 0), (half + 1, half)))
    sums = np.cumsum(padded, axis=1)
    return ((sums[:, width:] - sums[:, :-width]) / width).astype(np.float32)


def select_keep(scores: np.ndarray, budget: int, sinks: int, window: int) -> np.ndarray:
    """The rows a layer keeps, per kv-head: scores [Hkv, N] -> keep [Hkv, budget] int64, ascending.
    Rows 0..sinks-1 and the last `window` always; the rest of the budget goes to the highest scores
    among the rows between (ties: the earlier row). Needs sinks + window <= budget < N."""
    num_kv_heads, num_rows = scores.shape
    assert sinks + window <= budget < num_rows, (sinks, window, budget, num_rows)
    middle = scores[:, sinks:num_rows - window]
    take = budget - sinks - window
    top = np.argsort(-middle, axis=1, kind="stable")[:, :take] + sinks
    fixed = np.concatenate([np.arange(sinks), np.arange(num_rows - window, num_rows)])
    keep = np.concatenate([np.broadcast_to(fixed, (num_kv_heads, fixed.size)), top], axis=1)
    keep.sort(axis=1)
    return keep.astype(np.int64)


@njit(cache=True, nogil=True)
def compact_rows(k_cache, v_cache, table, keep):
    """Move each kv-head's kept rows to the front of a sequence's rows, in order.

    k_cache, v_cache: [num_blocks, Hkv, block_size, D] (one layer); table: [>= blocks] int64, the
    sequence's blocks; keep: [Hkv, K] ascending row numbers -> row i of kv-head h becomes its old
    row keep[h, i]. keep[h, i] >= i, so copying in order never overwrites a row still to be moved."""
    block_size = k_cache.shape[2]
    for h in range(keep.shape[0]):
        for i in range(keep.shape[1]):
            src = keep[h, i]
            if src == i:
                continue
            sb, so = table[src // block_size], src % block_size
            db, do = table[i // block_size], i % block_size
            k_cache[db, h, do, :] = k_cache[sb, h, so, :]
            v_cache[db, h, do, :] = v_cache[sb, h, so, :]
