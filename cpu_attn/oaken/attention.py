"""Exact decode attention over the Oaken store: blocks decoded (or scored in int16) in registers
and small scratch, never a full-precision copy of the cache."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from cpu_attn.kernels import AttentionScratch, attend_scores, block_scores, finish_unit, merge_parts, part_blocks
from cpu_attn.llvm_ir import _FAST
from cpu_attn.softmax import attend_begin, softmax_rows16
from cpu_attn.oaken.avx2 import avx2_add_weighted_rows, avx2_block_scores
from cpu_attn.oaken.center import (add_center_scores, add_row_center_scores, center_codes, center_codes_at,
                                   center_scales, consecutive_from, vnni_center_scores)
from cpu_attn.oaken.codec import SEGMENT
from cpu_attn.oaken.codes import ROWS, VNNI
from cpu_attn.oaken.decode import load_block, prefetch_block
from cpu_attn.oaken.records import OakenScratch
from cpu_attn.oaken.vnni import vnni_add_weighted_rows, vnni_block_scores

int16_block_scores = vnni_block_scores if VNNI else avx2_block_scores
int16_add_weighted_rows = vnni_add_weighted_rows if VNNI else avx2_add_weighted_rows
"""The int16 kernels this CPU runs (the exact kernel, bench_oaken_rows): resolved once, at import."""


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def oaken_decode_attention(queries, k_parts, v_parts, center, block_tables, seq_lens, scale, out, lse, raw, scratch):
    """paged_decode_attention (cpu_attn/kernels.py) over an Oaken store: each block's K and V rows
    of one kv-head are decoded into small scratch (kb, vb: [U, block_size, D], L1-sized) and used
    at once; no full-precision copy of the cache is ever made. Scratch and states are per unit, a
    (sequence, kv-head, part) as in paged_decode_attention, but a parallel task is a (sequence,
    part) that takes every kv-head of each of its blocks: a row holds all kv-heads, so the block's
    lines are fetched once, and the int16 kernels take all kv-heads of a block in one call (a
    row's levels made once, not once a kv-head). A task's units are consecutive (unit = (b *
    splits + part) * Hkv + kvh), so its scores, kacc and outputs are [Hq, ...] arrays.

    queries: DecodeQueries; k_parts, v_parts: one layer's K and V (OakenParts); center:
    ScoreCenter; scratch: OakenScratch (records as plain tuples, records.py); block_tables,
    seq_lens, scale, out, lse as in paged_decode_attention. With query codes, every full quantized block
    is not decoded: its keys are scored by vnni_block_scores (or avx2_block_scores), their
    centers by vnni_center_scores (see center_codes) and its values summed by
    vnni_add_weighted_rows; without (codes [0, 0, 0]) every block is decoded. Without center
    terms (queries.center [0, 0, 0]) the keys are not centered; else their centers are added in
    the score domain (add_center_scores; with center's row_pos, at each row's own position:
    add_row_center_scores). raw: [B, Hq, >= max(seq_lens)] float32, where row t of sequence b
    gets its logit scale * q[b, h] . k_t (written for t < seq_lens[b] only), as the layered cache's scores
    need (cpu_attn/kv_policy.py); [0, 0, 0]: not written."""
    q, q_center, qi, qscale = queries  # read only: unpacked (records.py)
    k_dense, k_scales, k_counts, k_sparse, _, k_tail_of, thr_k = k_parts
    v_dense, v_scales, v_counts, v_sparse, _, _, thr_v = v_parts
    offset_pairs = center[3]
    row_pos, pos_cos, pos_sin = center[4], center[5], center[6]
    positioned = row_pos.shape[0] > 0
    scores = scratch[0]  # written: by index, one statement each
    kb = scratch[1]
    vb = scratch[2]
    m = scratch[3]
    l = scratch[4]
    parts = scratch[5]
    qcb = scratch[6]
    sc = scratch[7]
    kacc = scratch[8]
    abq_all = scratch[9]
    factor_all = scratch[10]
    inv_all = scratch[11]
    num_seqs, num_heads, head_dim = q.shape
    block_size = k_dense.shape[1]
    num_kv_heads = k_dense.shape[2] * 2 // head_dim
    group = num_heads // num_kv_heads
    splits = parts.shape[0] // (num_seqs * num_kv_heads)
    int_dots = qi.shape[0] > 0
    scored = raw.shape[0] > 0
    for task in prange(num_seqs * splits):  # a part of one sequence, every kv-head of each of its blocks in turn
        b, part = task // splits, task % splits
        n = seq_lens[b]
        first, end = part_blocks(n, block_size, splits, part)
        units = slice(task * num_kv_heads, (task + 1) * num_kv_heads)  # the task's kv-heads: one unit each
        task_scores = scores[units].reshape((num_heads, block_size))
        task_acc = parts[units].reshape((num_heads, head_dim))
        task_m, task_l = m[units].reshape(num_heads), l[units].reshape(num_heads)
        attend_begin(task_acc, task_m, task_l)
        if int_dots:
            task_kacc = kacc[units].reshape((num_heads, ROWS, 16))
        centered = int_dots and q_center.shape[0] > 0
        if centered:
            abq = abq_all[units].reshape((num_heads, head_dim))
            factor, inv = factor_all[units].reshape(num_heads), inv_all[units].reshape(num_heads)
            center_scales(q_center[b], scale, inv, factor)
        for j in range(first, end):
            block = block_tables[b, j]
            width = min(block_size, n - j * block_size)
            if j + 1 < end:
                prefetch_block(k_parts, block_tables[b, j + 1], 0, num_kv_heads * head_dim)
                prefetch_block(v_parts, block_tables[b, j + 1], 0, num_kv_heads * head_dim)
            if int_dots and width == block_size and k_tail_of[block] < 0:  # full and quantized, K and V alike
                # the block's lines, loaded once, serve every kv-head; each step one call for all query heads
                int16_block_scores(task_scores, qi[b], qscale[b], k_dense[block], k_scales[block], k_counts[block],
                                   k_sparse[block], thr_k, scale, task_kacc)
                start = consecutive_from(row_pos[block], block_size) if centered and positioned else -1
                if start >= 0:  # rows in order (a window, new rows): one center turn for the block
                    center_codes_at(q_center[b], pos_cos, pos_sin, start, inv, abq)
                    vnni_center_scores(task_scores, abq, factor, offset_pairs)
                elif centered and positioned:
                    for kvh in range(num_kv_heads):
                        heads = slice(kvh * group, (kvh + 1) * group)
                        add_row_center_scores(task_scores[heads], q_center[b, heads], pos_cos, pos_sin,
                                              row_pos[block, kvh], block_size, scale)
                elif centered:
                    center_codes(q_center[b], center, j, inv, abq)
                    vnni_center_scores(task_scores, abq, factor, offset_pairs)
                if scored:
                    for h in range(num_heads):
                        raw[b, h, j * block_size:(j + 1) * block_size] = task_scores[h]
                softmax_rows16(task_scores, task_acc, task_m, task_l)
                int16_add_weighted_rows(task_acc, task_scores, v_dense[block], v_scales[block], v_counts[block],
                                        v_sparse[block], thr_v)
                continue
            for kvh in range(num_kv_heads):
                unit = task * num_kv_heads + kvh
                heads = slice(kvh * group, (kvh + 1) * group)
                first_seg = kvh * head_dim // SEGMENT
                load_block(k_parts, block, first_seg, width, kb[unit])
                block_scores(q[b, heads], kb[unit], width, scale, scores[unit])
                if q_center.shape[0] and positioned:
                    add_row_center_scores(scores[unit], q_center[b, heads], pos_cos, pos_sin, row_pos[block, kvh],
                                          width, scale)
                elif q_center.shape[0]:
                    add_center_scores(scores[unit], q_center[b, heads], center, j, width, scale, qcb[unit], sc[unit])
                if scored:
                    for g in range(group):
                        raw[b, kvh * group + g, j * block_size:j * block_size + width] = scores[unit, g, :width]
                load_block(v_parts, block, first_seg, width, vb[unit])
                attend_scores(scores[unit], vb[unit], width, parts[unit], m[unit], l[unit])
        for kvh in range(num_kv_heads):
            heads = slice(kvh * group, (kvh + 1) * group)
            finish_unit(parts, m, l, out, lse, task * num_kv_heads + kvh, splits, b, heads)
    merge_parts(parts, m, l, out, lse, num_kv_heads, kv_inner=True)


def oaken_scratch(base: AttentionScratch, int_dots: bool) -> OakenScratch:
    """oaken_decode_attention's scratch: attention_scratch's arrays, the center's, and the int16
    kernels' (none without int_dots, when every block is decoded)."""
    units, group, block_size = base.scores.shape
    head_dim, int_units, f32 = base.parts.shape[2], units if int_dots else 0, np.float32
    return OakenScratch(*base, np.empty((units, group, head_dim), f32), np.empty((units, group, block_size), f32),
                        np.empty((int_units, group, ROWS, 16), f32), np.empty((int_units, group, head_dim), np.int16),
                        np.empty((int_units, group), f32), np.empty((int_units, group), f32))
