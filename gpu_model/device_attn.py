"""Attention on the accelerator for the sequences whose KV lives there (partial offload, NEO-style).

The same contract as the CPU attention worker (cpu_attn/worker.py: begin_step with the step's chunk
layouts, then attend once per layer), over a paged store of torch tensors on the model's device:

    k_cache, v_cache: [layers, num_blocks, Hkv, block_size, D]   (bf16 on CUDA, float32 on the CPU)

Block ids are the store's own (0 .. num_blocks - 1): the backend gives this worker the shard of block ids
below `num_blocks`. Each layer writes the step's k, v to their slots, then attends with SDPA: the decode
rows (one-token chunks) of all sequences at once over their gathered blocks, padded to the longest and
masked, and each longer chunk (a prompt's) over its sequence's context, causal from its offset. Exact
attention; no draft rows (speculative decoding and the sparse KV policies stay on the CPU workers).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn.functional as F

from cpu_attn.worker import ChunkLayout


class DeviceAttentionWorker:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 device: torch.device | str, dtype: torch.dtype):
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size, self.scale = block_size, head_dim**-0.5
        self.busy_s = 0.0
        """Seconds in this worker's calls since the last take_timings (on CUDA: launching, not running)."""
        self._slots: torch.Tensor | None = None  # [T] block * block_size + offset of each row
        self._decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """(rows [B], block tables [B, W], lengths [B], key mask [B, W * block_size]) of the decode rows."""
        self._prefills: list[tuple[int, int, int, torch.Tensor]] = []  # (first row, rows, start, table)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.itemsize

    def begin_step(self, chunks: Sequence[ChunkLayout]) -> None:
        dev, bs = self.k_cache.device, self.block_size
        slots, decode_rows, tables, lens, self._prefills = [], [], [], [], []
        row = 0
        for c in chunks:
            if c.num_draft:
                raise ValueError("draft rows are attended by the CPU workers only")
            table = torch.tensor(c.block_table, dtype=torch.long)
            pos = torch.arange(c.start_pos, c.start_pos + c.num_tokens)
            slots.append(table[pos // bs] * bs + pos % bs)
            if c.num_tokens == 1:
                decode_rows.append(row)
                tables.append(c.block_table)
                lens.append(c.start_pos + 1)
            else:
                self._prefills.append((row, c.num_tokens, c.start_pos, table[: -(-(c.start_pos + c.num_tokens) // bs)]))
            row += c.num_tokens
        self._slots = torch.cat(slots).to(dev) if slots else None
        self._decode = None
        if decode_rows:
            width = max(map(len, tables))
            padded = torch.zeros(len(tables), width, dtype=torch.long)
            for i, t in enumerate(tables):
                padded[i, : len(t)] = torch.tensor(t)
            lengths = torch.tensor(lens)
            mask = torch.arange(width * bs)[None, :] < lengths[:, None]  # [B, W * bs]: a row's own keys
            self._decode = (torch.tensor(decode_rows, device=dev), padded.to(dev), lengths, mask.to(dev))

    def _context(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tables [B, W] -> k, v [B, Hkv, W * block_size, D] (every row of the tables' blocks)."""
        def rows(cache: torch.Tensor) -> torch.Tensor:
            x = cache[layer][tables]  # [B, W, Hkv, bs, D]
            b, w, h, s, d = x.shape
            return x.permute(0, 2, 1, 3, 4).reshape(b, h, w * s, d)
        return rows(self.k_cache), rows(self.v_cache)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codes=None) -> torch.Tensor:
        """q: [T, Hq, D], k, v: [T, Hkv, D] on the device (codes: ignored) -> [T, Hq * D] in q's dtype."""
        t0 = time.perf_counter()
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if self._slots is not None:  # [num_blocks, Hkv, bs, D] viewed as [num_blocks * bs, Hkv, D] slots
            n, h, s, d = kc.shape
            blocks, offsets = self._slots // s, self._slots % s
            kc[blocks, :, offsets] = k.to(kc.dtype)
            vc[blocks, :, offsets] = v.to(vc.dtype)
        out = torch.empty_like(q)
        if self._decode is not None:
            rows, tables, _, mask = self._decode
            kx, vx = self._context(layer, tables)
            qx = q[rows].to(kx.dtype)[:, :, None]  # [B, Hq, 1, D]
            o = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask[:, None, None], scale=self.scale,
                                               enable_gqa=True)
            out[rows] = o[:, :, 0].to(q.dtype)
        for first, n, start, table in self._prefills:
            kx, vx = self._context(layer, table[None].to(kc.device))
            ctx = start + n
            qx = q[first:first + n].to(kx.dtype).transpose(0, 1)[None]  # [1, Hq, n, D]
            allowed = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(start, ctx, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(qx, kx[:, :, :ctx], vx[:, :, :ctx], attn_mask=allowed, scale=self.scale,
                                               enable_gqa=True)
            out[first:first + n] = o[0].transpose(0, 1).to(q.dtype)
        self.busy_s += time.perf_counter() - t0
        return out.reshape(q.shape[0], -1)

    def free(self, seq_ids) -> None:
        """Nothing per sequence is kept beyond its blocks."""

    def take_centers(self) -> list:
        return []

    def take_timings(self) -> dict[str, float]:
        busy, self.busy_s = self.busy_s, 0.0
        return {"gpu_attn": busy}
