"""Decode attention over the accelerator's paged KV in one Triton launch per layer (split-K, "flash-decoding").

The store is DeviceAttentionWorker's: per layer [Hkv, slots, D] in bf16, float32 or float8 e4m3 (read as its bytes
and widened in registers, so an fp8 cache is read once at one byte a value); a sequence's position p sits in slot
table[p // block_size] * block_size + p % block_size. Every decode row of a step is attended at once:

    _split:  grid (rows, Hkv, splits). A program takes one kv-head's GQA group of query heads (padded to 16 rows for
             tl.dot) over one split of the sequence's context, BLOCK_N tokens at a time with an online softmax,
             and writes its partial output with the split's running max and sum.
    _reduce: grid (rows, Hq). The splits' partials merged (each scaled by exp(its max - the max of all)).

The splits spread a step with few sequences over the GPU's multiprocessors (a 64k context and two sequences is
16 programs without them). Tested against plain NumPy attention with Triton's interpreter (TRITON_INTERPRET=1)
on the CPU; used on CUDA only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64
"""Context tokens a program reads per iteration (any block size: each token's slot is looked up)."""
GROUP_PAD = 16
"""Query rows of one program: a GQA group padded to tl.dot's least M."""


@triton.jit
def _split(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, ml_ptr,
           stride_qr, stride_qh, stride_kh, stride_ks, stride_tr, split_len, num_splits, num_q_heads, scale,
           GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
           GROUP_PAD: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr):
    r, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, D)
    heads = h * GROUP + g
    seq_len = tl.load(lens_ptr + r)
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)
    q = tl.load(q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None],
                other=0.0).to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(tables_ptr + r * stride_tr + pos // BLOCK_SIZE, mask=valid, other=0)
        rows = (block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_ks + h * stride_kh
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0)
        if FP8:  # the cache's bytes as e4m3
            k, v = k.to(tl.float8e4nv, bitcast=True), v.to(tl.float8e4nv, bitcast=True)
        k, v = k.to(tl.float32), v.to(tl.float32)
        # bf16 queries and bf16 or e4m3 values are exact in tf32; float32 ones take the full-precision product
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    part = (r * num_q_heads + heads) * num_splits + s
    keep = g < GROUP
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=keep)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=keep)


@triton.jit
def _reduce(acc_ptr, ml_ptr, out_ptr, stride_or, num_splits, num_q_heads,
            D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    r, hq = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, SPLITS_PAD), tl.arange(0, D)
    part = (r * num_q_heads + hq) * num_splits + s
    used = s < num_splits
    m = tl.load(ml_ptr + part * 2, mask=used, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=used, other=0.0)
    top = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # a split past the sequence's end counts nothing
    acc = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + r * stride_or + hq * D + d, out.to(out_ptr.dtype.element_ty))


def num_splits(rows: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits of the context so that a step has about four programs per multiprocessor (one on the CPU)."""
    if device.type != "cuda":
        return min(2, -(-max_len // BLOCK_N))
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-max_len // BLOCK_N), -(-target // (rows * num_kv_heads))))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, max_len: int, block_size: int, scale: float, splits: int) -> torch.Tensor:
    """One query row per sequence. q [R, Hq, D]; k_cache, v_cache [Hkv, slots, D] (D contiguous; uint8 holding
    float8 e4m3, bf16 or float32); tables [R, blocks] int32 (a sequence's blocks, padded); lens [R] int32 (the
    context each row attends, its own token included); max_len = max(lens) -> [R, Hq * D] in q's dtype."""
    rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_q_heads // num_kv_heads
    if group > GROUP_PAD or head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"paged_decode takes GQA groups up to {GROUP_PAD} and head dims 16, 32, 64, ...; "
                         f"got {group} and {head_dim}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("paged_decode needs the head dim contiguous and K, V laid out alike")
    fp8 = k_cache.dtype == torch.uint8
    split_len = -(-max_len // (splits * BLOCK_N)) * BLOCK_N
    acc = torch.empty((rows, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((rows, num_q_heads, splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((rows, num_q_heads * head_dim), dtype=q.dtype, device=q.device)
    _split[(rows, num_kv_heads, splits)](
        q, k_cache, v_cache, tables, lens, acc, ml, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        tables.stride(0), split_len, splits, num_q_heads, scale, GROUP=group, D=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N, GROUP_PAD=GROUP_PAD, FP8=fp8,
        PRECISION="ieee" if torch.float32 in (q.dtype, k_cache.dtype) else "tf32")
    _reduce[(rows, num_q_heads)](acc, ml, out, out.stride(0), splits, num_q_heads, D=head_dim,
                                 SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
    return out
