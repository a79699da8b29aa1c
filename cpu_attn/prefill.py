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
    if start_pos == 0:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    if not _flash_parts(q, start_pos):
        return masked_attention(q, k, v, start_pos, scale)
    return prefill_attention_lse(q, k, v, start_pos, scale)[0]


def prefill_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """prefill_attention, with each query's log-sum-exp of its scaled scores -> out [T, Hq, D], lse [Hq, T]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    assert k.shape[0] == start_pos + num_tokens, (k.shape[0], start_pos, num_tokens)
    if not (start_pos == 0 or _flash_parts(q, start_pos)):
        mask = torch.arange(k.shape[0])[None, :] <= torch.arange(start_pos, k.shape[0])[:, None]  # [T, S]
        s = torch.matmul(q.transpose(0, 1) * scale, k.repeat_interleave(group, dim=1).permute(1, 2, 0))  # [Hq, T, S]
        s.masked_fill_(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse[..., None]), v.repeat_interleave(group, dim=1).transpose(0, 1))
        return out.transpose(0, 1), lse
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, S, D]
    own_k = kh[0, :, start_pos:].repeat_interleave(group, dim=0)[None]
    own_v = vh[0, :, start_pos:].repeat_interleave(group, dim=0)[None]
    own, own_lse = _FLASH(qh, own_k, own_v, 0.0, True, scale=scale)
    own, own_lse = own[0], own_lse[0, :, :, None]
    if start_pos == 0:
        return own.transpose(0, 1), own_lse[..., 0]
    rows = q.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads,
                                                                                           group * num_tokens, head_dim)
    past, past_lse = _FLASH(rows, kh[:, :, :start_pos], vh[:, :, :start_pos], 0.0, False, scale=scale)
    past = past.reshape(num_heads, num_tokens, head_dim)
    past_lse = past_lse.reshape(num_heads, num_tokens, 1)
    top = torch.maximum(past_lse, own_lse)
    w_past, w_own = torch.exp(past_lse - top), torch.exp(own_lse - top)
    total = w_past + w_own
    return ((past * w_past + own * w_own) / total).transpose(0, 1), (top + torch.log(total))[..., 0]


def _flash_parts(q: torch.Tensor, start_pos: int) -> bool:
    """Whether a chunk at start_pos attends in flash attention's two parts (prefill_attention)."""
    return start_pos >= q.shape[0] and q.dtype == torch.float32 and q.device.type == "cpu"


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float) -> torch.Tensor:
    """prefill_attention by one SDPA over the whole context with a boolean causal mask at the chunk's offset."""
    num_ctx = k.shape[0]
    mask = torch.arange(num_ctx)[None, :] <= torch.arange(start_pos, num_ctx)[:, None]  # [T, S]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
