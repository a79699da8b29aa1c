"""Prefill attention for one sequence's chunk: torch SDPA, causal with the chunk's offset."""
from __future__ import annotations

import torch
import torch.nn.functional as F

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""The CPU flash kernel behind F.scaled_dot_product_attention, called directly for its log-sum-exp."""


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] at positions start_pos.. ; k, v: [start_pos + T, Hkv, D] -> [T, Hq, D].

    The query at position p attends keys 0..p. A chunk after at least as many earlier tokens as its own
    attends in two parts joined by their log-sum-exps: the earlier tokens without a mask, a kv-head's
    query heads as the rows of one matrix (each key block read once for all of them), and its own tokens
    causally; a boolean mask over the whole context costs SDPA more (at 4k tokens ~20 % more).
    """
    num_tokens, num_ctx = q.shape[0], k.shape[0]
    assert num_ctx == start_pos + num_tokens, (num_ctx, start_pos, num_tokens)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, S, D]
    if start_pos == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    if start_pos < num_tokens or q.dtype != torch.float32 or q.device.type != "cpu":
        return masked_attention(q, k, v, start_pos, scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    rows = q.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads,
                                                                                           group * num_tokens, head_dim)
    past, past_lse = _FLASH(rows, kh[:, :, :start_pos], vh[:, :, :start_pos], 0.0, False, scale=scale)
    past = past.reshape(num_heads, num_tokens, head_dim)
    past_lse = past_lse.reshape(num_heads, num_tokens, 1)
    own_k = kh[0, :, start_pos:].repeat_interleave(group, dim=0)[None]
    own_v = vh[0, :, start_pos:].repeat_interleave(group, dim=0)[None]
    own, own_lse = _FLASH(qh, own_k, own_v, 0.0, True, scale=scale)
    own, own_lse = own[0], own_lse[0, :, :, None]
    top = torch.maximum(past_lse, own_lse)
    w_past, w_own = torch.exp(past_lse - top), torch.exp(own_lse - top)
    return ((past * w_past + own * w_own) / (w_past + w_own)).transpose(0, 1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float) -> torch.Tensor:
    """prefill_attention by one SDPA over the whole context with a boolean causal mask at the chunk's offset."""
    num_ctx = k.shape[0]
    mask = torch.arange(num_ctx)[None, :] <= torch.arange(start_pos, num_ctx)[:, None]  # [T, S]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
