"""A decoder layer's linears at a decode step on the CPU in two Numba calls, around attention.

    pre:  qkv = rms_norm(x) @ Wqkv.T, RoPE on its q and k heads
    post: h = x + attn @ Wo.T;  out = h + silu(gate) * up @ Wdown.T,  gate | up = rms_norm(h) @ Wgate_up.T

with the weights in the integer-dot layout (gpu_model/quant_vnni.py; steps of several tokens by AMX tiles,
gpu_model/quant_amx.py): each norm and the gate are
computed while the matmul's input is rounded, and each call is one parallel region per matmul. At
one token a step, the nine tensor operations and five kernel calls these replace cost more than the
matmuls of a small model's layer.

A step of decode rows only (one-token decodes, or decodes with draft tokens) whose attention is exact over a
store that keeps rows as written runs all its layers in one call, `decode_layers`: pre, the KV rows' write, the
paged decode (or verify) attention and post of each layer, the same kernels in the same order, so the same bits
as layer by layer. At one token a step on two cores the Python between a layer's calls (~60-100 us a layer) was
a third of the step. Over a layered cache (cpu_attn/layered_worker.py) the same call runs each layer on its
group's rows, and a sparse group's attention also gives each row's probabilities for its score.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch
from numba import njit

from cpu_attn.fp16 import narrow_row
from cpu_attn.kernels import attend_rows, paged_decode_attention
from cpu_attn.kv_policy import accumulate_probs, paged_decode_attention_scored
from cpu_attn.layered_worker import LayeredDecodeKV
from cpu_attn.llvm_ir import cycles
from cpu_attn.worker import DecodeKV
from gpu_model.quant_amx import block_matvec, parallel_matvec
from gpu_model.quant_vnni import ROWS, VnniWeight


@njit(cache=True, nogil=True)
def rope_rows(x, num_heads, head_dim, cos, sin):
    """RoPE (rotate-half layout) in place on the first num_heads heads of each row of x [T, W] float32; cos,
    sin: [T, D]. The operations of model.apply_rope (a * cos - b * sin, unfused), so the same bits."""
    half = head_dim // 2
    for t in range(x.shape[0]):
        for h in range(num_heads):
            base = h * head_dim
            for j in range(half):
                a, b = x[t, base + j], x[t, base + half + j]
                x[t, base + j] = a * cos[t, j] - b * sin[t, j]
                x[t, base + half + j] = b * cos[t, half + j] + a * sin[t, half + j]


class DecodeWeights(NamedTuple):
    """A layer's linears in the integer-dot layout (model.LINEARS order), all rotated or none (one format)."""

    qkv: VnniWeight
    o: VnniWeight
    gate_up: VnniWeight
    down: VnniWeight


class DecodeStack(NamedTuple):
    """Every layer's norms and integer-dot linears on a leading layer axis, for decode_layers (the model's per-layer
    weights are views of these)."""

    attn_norms: np.ndarray  # [L, hidden] float32
    mlp_norms: np.ndarray
    qkv: VnniWeight  # scales and qs with a leading [L] axis
    o: VnniWeight
    gate_up: VnniWeight
    down: VnniWeight


def stack_layers(layers: list[DecodeWeights | None], attn_norms: np.ndarray,
                 mlp_norms: np.ndarray) -> tuple[DecodeStack, list[DecodeWeights]] | None:
    """The layers' weights stacked, and each layer's DecodeWeights as views of the stack; None unless every layer has
    DecodeWeights of one kind, shape and rotation per linear."""
    if not layers or any(w is None for w in layers):
        return None
    stacked = []
    for ws in zip(*layers):  # one linear of every layer
        first = ws[0]
        if any((w.kind, w.rotation, w.scales.dtype, w.scales.shape, w.qs.dtype, w.qs.shape)
               != (first.kind, first.rotation, first.scales.dtype, first.scales.shape, first.qs.dtype, first.qs.shape)
               for w in ws):
            return None
        stacked.append(dataclasses.replace(first, scales=np.stack([w.scales for w in ws]),
                                           qs=np.stack([w.qs for w in ws])))
    if len({w.rotation for w in stacked}) != 1:
        return None
    views = [DecodeWeights(*(dataclasses.replace(w, scales=w.scales[i], qs=w.qs[i]) for w in stacked))
             for i in range(len(layers))]
    return DecodeStack(attn_norms, mlp_norms, *stacked), views


@njit(cache=True, nogil=True)
def _layer_in(x, i, eps, hadamard, attn_norms, qkv_scales, qkv_qs, cos, sin, qkv, num_rotated, head_dim, tile_rows):
    """Layer i's qkv projection of x to qkv, RoPE on its first num_rotated heads."""
    parallel_matvec(x, attn_norms[i], eps, False, hadamard, qkv_scales[i], qkv_qs[i], qkv, tile_rows)
    rope_rows(qkv, num_rotated, head_dim, cos, sin)


@njit(cache=True, nogil=True)
def _write_rows(qkv, k_cache, v_cache, slots, q):
    """Each row's K and V from qkv written at its slot of the caches (one layer's), its q heads copied to q."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    q_width = num_heads * head_dim
    q_rows = q.reshape(num_tokens, q_width)
    for t in range(num_tokens):
        block, offset = slots[t] // block_size, slots[t] % block_size
        for kvh in range(num_kv_heads):
            k_at, v_at = (num_heads + kvh) * head_dim, (num_heads + num_kv_heads + kvh) * head_dim
            narrow_row(qkv[t, k_at:k_at + head_dim], k_cache[block, kvh, offset])
            narrow_row(qkv[t, v_at:v_at + head_dim], v_cache[block, kvh, offset])
        q_rows[t] = qkv[t, :q_width]


@njit(cache=True, nogil=True)
def _layer_out(x, i, eps, hadamard, attn, o_scales, o_qs, mlp_norms, gu_scales, gu_qs, down_scales, down_qs, h,
               gate_up, tile_rows):
    """Layer i after attention, in place: h = x + o(attn); x = h + down(silu(gate) * up), gate | up = gate_up(norm(h))."""
    attn_rows = attn.reshape(attn.shape[0], attn.shape[1] * attn.shape[2])
    no_norm = np.empty(0, np.float32)
    parallel_matvec(attn_rows, no_norm, 0.0, False, hadamard, o_scales[i], o_qs[i], h, tile_rows)
    h += x
    parallel_matvec(h, mlp_norms[i], eps, False, hadamard, gu_scales[i], gu_qs[i], gate_up, tile_rows)
    parallel_matvec(gate_up, no_norm, 0.0, True, hadamard, down_scales[i], down_qs[i], x, tile_rows)
    x += h


@njit(cache=True, nogil=True)
def _decode_layers(x, eps, hadamard, attn_norms, qkv_scales, qkv_qs, o_scales, o_qs, mlp_norms, gu_scales, gu_qs,
                   down_scales, down_qs, cos, sin, k_cache, v_cache, slots, block_tables, seq_lens, row_first,
                   row_count, scale, scratch, qkv, q, attn, lse, h, gate_up, tile_rows, spent):
    num_rotated, head_dim = q.shape[1] + k_cache.shape[2], q.shape[2]
    start, in_attn = cycles(), 0
    for i in range(attn_norms.shape[0]):
        _layer_in(x, i, eps, hadamard, attn_norms, qkv_scales, qkv_qs, cos, sin, qkv, num_rotated, head_dim, tile_rows)
        t0 = cycles()
        _write_rows(qkv, k_cache[i], v_cache[i], slots, q)
        attend_rows(q, k_cache[i], v_cache[i], block_tables, seq_lens, row_first, row_count, scale, attn, lse, scratch)
        in_attn += cycles() - t0
        _layer_out(x, i, eps, hadamard, attn, o_scales, o_qs, mlp_norms, gu_scales, gu_qs, down_scales, down_qs, h,
                   gate_up, tile_rows)
    spent[0] = in_attn
    spent[1] = cycles() - start


@njit(cache=True, nogil=True)
def _decode_layers_layered(x, eps, hadamard, attn_norms, qkv_scales, qkv_qs, o_scales, o_qs, mlp_norms, gu_scales,
                           gu_qs, down_scales, down_qs, cos, sin, k_cache, v_cache, layer_group, layer_slot,
                           group_sparse, slots, block_tables, seq_lens, scale, full_scratch, sparse_scratch, raw, probs,
                           qkv, q, attn, lse, h, gate_up, tile_rows, spent):
    """_decode_layers over a layered cache (LayeredDecodeKV): layer i's rows in slot layer_slot[i] of its group's
    blocks, with that group's slots, tables and lengths; a sparse group's attention also adds each row's
    probabilities, summed over the kv-head's query heads, to probs[i] (kv_policy.accumulate_probs)."""
    num_kv_heads = k_cache.shape[2]
    num_rotated, head_dim = q.shape[1] + num_kv_heads, q.shape[2]
    start, in_attn = cycles(), 0
    for i in range(attn_norms.shape[0]):
        g, s = layer_group[i], layer_slot[i]
        _layer_in(x, i, eps, hadamard, attn_norms, qkv_scales, qkv_qs, cos, sin, qkv, num_rotated, head_dim, tile_rows)
        t0 = cycles()
        _write_rows(qkv, k_cache[s], v_cache[s], slots[g], q)
        if group_sparse[g]:
            paged_decode_attention_scored(q, k_cache[s], v_cache[s], block_tables[g], seq_lens[g], scale, attn, lse,
                                          raw, sparse_scratch)
            accumulate_probs(raw, lse, seq_lens[g], num_kv_heads, probs[i])
        else:
            paged_decode_attention(q, k_cache[s], v_cache[s], block_tables[g], seq_lens[g], scale, attn, lse,
                                   full_scratch)
        in_attn += cycles() - t0
        _layer_out(x, i, eps, hadamard, attn, o_scales, o_qs, mlp_norms, gu_scales, gu_qs, down_scales, down_qs, h,
                   gate_up, tile_rows)
    spent[0] = in_attn
    spent[1] = cycles() - start


def decode_layers(x: np.ndarray, w: DecodeStack, eps: float, cos: np.ndarray, sin: np.ndarray,
                  kv: DecodeKV | LayeredDecodeKV, num_heads: int, tile_rows: int) -> float:
    """Run every layer over x [T, hidden] float32 (C, overwritten with the last layer's output), T decode rows
    laid out as `kv` says: their K, V rows are written to its caches and attended (kernels.attend_rows; over a
    layered cache, each layer on its group's rows, sparse groups' probabilities added to kv.probs); cos, sin
    [T, D]. Returns the share of the call's time spent writing and attending KV."""
    num_tokens, head_dim = x.shape[0], cos.shape[1]
    num_kv_heads = kv.k.shape[2]
    qkv = np.empty((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), np.float32)
    q, attn = (np.empty((num_tokens, num_heads, head_dim), np.float32) for _ in range(2))
    lse, h = np.empty((num_tokens, num_heads), np.float32), np.empty_like(x)
    gate_up = np.empty((num_tokens, w.gate_up.qs.shape[1] * ROWS), np.float32)
    spent = np.zeros(2, np.int64)
    linears = (x, eps, w.qkv.rotated, w.attn_norms, w.qkv.scales, w.qkv.qs, w.o.scales, w.o.qs, w.mlp_norms,
               w.gate_up.scales, w.gate_up.qs, w.down.scales, w.down.qs, cos, sin)
    if isinstance(kv, LayeredDecodeKV):
        _decode_layers_layered(*linears, kv.k, kv.v, kv.layer_group, kv.layer_slot, kv.group_sparse, kv.slot_mapping,
                               kv.block_tables, kv.seq_lens, np.float32(kv.scale), kv.full_scratch, kv.sparse_scratch,
                               kv.raw, kv.probs, qkv, q, attn, lse, h, gate_up, tile_rows, spent)
    else:
        _decode_layers(*linears, kv.k, kv.v, kv.slot_mapping, kv.block_tables, kv.seq_lens, kv.row_first,
                       kv.row_count, np.float32(kv.scale), kv.scratch, qkv, q, attn, lse, h, gate_up, tile_rows, spent)
    return float(spent[0] / spent[1]) if spent[1] > 0 else 0.0


@njit(cache=True, nogil=True, parallel=True)
def _pre(x, norm, eps, hadamard, scales, qs, num_rotated, head_dim, cos, sin, out, tile_rows):
    block_matvec(x, norm, eps, False, hadamard, scales, qs, out, tile_rows)
    rope_rows(out, num_rotated, head_dim, cos, sin)


@njit(cache=True, nogil=True, parallel=True)
def _post(x, attn, norm, eps, hadamard, o_scales, o_qs, gu_scales, gu_qs, down_scales, down_qs, h, gate_up, out,
          tile_rows):
    no_norm = np.empty(0, np.float32)
    block_matvec(attn, no_norm, 0.0, False, hadamard, o_scales, o_qs, h, tile_rows)
    h += x
    block_matvec(h, norm, eps, False, hadamard, gu_scales, gu_qs, gate_up, tile_rows)
    block_matvec(gate_up, no_norm, 0.0, True, hadamard, down_scales, down_qs, out, tile_rows)
    out += h


def _np(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().numpy())


def pre(x: torch.Tensor, norm: torch.Tensor, eps: float, w: DecodeWeights, cos: torch.Tensor, sin: torch.Tensor,
        num_rotated: int, head_dim: int, tile_rows: int) -> torch.Tensor:
    """x: [T, hidden] -> qkv: [T, qkv out] with RoPE applied to its first num_rotated heads; cos, sin: [T, 1, D]. Steps
    of at least tile_rows tokens (> 0) multiply by AMX tiles (quant_amx.block_matvec)."""
    out = np.empty((x.shape[0], w.qkv.shape[0]), np.float32)
    _pre(_np(x), _np(norm), eps, w.qkv.rotated, w.qkv.scales, w.qkv.qs, num_rotated, head_dim,
         _np(cos).reshape(x.shape[0], -1), _np(sin).reshape(x.shape[0], -1), out, tile_rows)
    return torch.from_numpy(out)


def post(x: torch.Tensor, attn: torch.Tensor, norm: torch.Tensor, eps: float, w: DecodeWeights,
         tile_rows: int) -> torch.Tensor:
    """x: [T, hidden] (the layer's input), attn: [T, Hq * D] -> the next layer's input [T, hidden] (tile_rows as pre)."""
    num_tokens, hidden = x.shape
    h, out = np.empty((num_tokens, hidden), np.float32), np.empty((num_tokens, hidden), np.float32)
    gate_up = np.empty((num_tokens, w.gate_up.shape[0]), np.float32)
    _post(_np(x), _np(attn), _np(norm), eps, w.o.rotated, w.o.scales, w.o.qs, w.gate_up.scales, w.gate_up.qs,
          w.down.scales, w.down.qs, h, gate_up, out, tile_rows)
    return torch.from_numpy(out)
