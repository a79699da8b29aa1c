"""Prefill attention for one sequence's chunk: torch SDPA, causal with the chunk's offset."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] at positions start_pos.. ; k, v: [start_pos + T, Hkv, D] -> [T, Hq, D].

    The query at position p attends keys 0..p.
    """
    num_tokens, num_ctx = q.shape[0], k.shape[0]
    assert num_ctx == start_pos + num_tokens, (num_ctx, start_pos, num_tokens)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, S, D]
    if start_pos == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(start_pos, num_ctx)[:, None]
        mask = torch.arange(num_ctx)[None, :] <= q_pos  # [T, S]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
