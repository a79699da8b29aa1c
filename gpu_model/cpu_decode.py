"""A decoder layer's linears at a decode step on the CPU in two Numba calls, around attention.

    pre:  qkv = rms_norm(x) @ Wqkv.T, RoPE on its q and k heads
    post: h = x + attn @ Wo.T;  out = h + silu(gate) * up @ Wdown.T,  gate | up = rms_norm(h) @ Wgate_up.T

with the weights in the integer-dot layout (gpu_model/quant_vnni.py; steps of several tokens by AMX tiles,
gpu_model/quant_amx.py): each norm and the gate are
computed while the matmul's input is rounded, and each call is one parallel region per matmul. At
one token a step, the nine tensor operations and five kernel calls these replace cost more than the
matmuls of a small model's layer.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from numba import njit

from gpu_model.quant_amx import block_matvec
from gpu_model.quant_vnni import VnniWeight


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
