"""Attention on the accelerator for the sequences whose KV lives there (partial offload, NEO-style).

The same contract as the CPU attention worker (cpu_attn/worker.py: begin_step with the step's chunk
layouts, then attend once per layer), over a paged store of torch tensors on the model's device, each
kv-head's rows in slot order so that a sequence whose blocks are consecutive is one strided view:

    k_cache, v_cache: [layers, Hkv, num_blocks * block_size, D]   (bf16 on CUDA, float32 on the CPU)
    slot of a sequence's position p: table[p // block_size] * block_size + p % block_size

Block ids are the store's own (0 .. num_blocks - 1): the backend gives this worker the shard of block ids
below `num_blocks`. Each layer writes the step's k, v to their slots, then attends:
- the decode rows (one token a sequence) all at once by the paged Triton kernel (gpu_model/paged_attn.py) where
  it runs (CUDA with triton installed; `decode_kernel`): one launch a layer whatever the batch, reading the
  blocks where they are (an fp8 store at one byte a value);
- else, and for prompt chunks, each sequence with SDPA over its context: a view of the cache where its blocks
  are consecutive (no copy), else its rows gathered (one copy of that sequence's KV, never the batch's at once);
  a prompt chunk causal from its offset.
Exact attention; no draft rows (speculative decoding and the sparse KV policies stay on the CPU workers). With
an fp8 store (`--gpu-kv-dtype fp8`) values are kept as float8 e4m3 (1 byte); SDPA widens a sequence's to the
queries' dtype first, the kernel in registers.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn.functional as F

from cpu_attn.worker import ChunkLayout, padded_tables


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
"""An fp8 store's values are clamped to +-448 (e4m3's largest) and rounded, with no scale (vLLM's default)."""


def store_dtype(gpu_kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The store's values for --gpu-kv-dtype: auto (the model's dtype) or fp8."""
    return FP8 if gpu_kv_dtype == "fp8" else model_dtype


def decode_kernel_runs(device: torch.device | str) -> bool:
    """Whether the paged Triton decode kernel runs on `device`: CUDA, with the triton package installed."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _slots_of(block_table, block_size: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks holding positions 0 .. end - 1, those positions' slots), as CPU tensors."""
    table = torch.tensor(block_table[: -(-end // block_size)], dtype=torch.long)
    return table, (table[:, None] * block_size + torch.arange(block_size)).flatten()[:end]


def _write(cache: torch.Tensor, slots, x: torch.Tensor) -> None:
    """cache [Hkv, slots, D] at `slots` = x [T, Hkv, D]; an fp8 cache through its bytes (index_put on a uint8 view,
    which every device has)."""
    x = x.transpose(0, 1)
    if cache.dtype == FP8:
        cache.view(torch.uint8)[:, slots] = x.to(cache.device).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    else:
        cache[:, slots] = x.to(cache.device, cache.dtype)


def _read(cache: torch.Tensor, ctx, dtype: torch.dtype) -> torch.Tensor:
    """cache [Hkv, slots, D] at `ctx` (a slice: a view, no copy), an fp8 cache's widened to `dtype`."""
    if cache.dtype == FP8:
        return cache.view(torch.uint8)[:, ctx].view(FP8).to(dtype)
    return cache[:, ctx]


class DeviceAttentionWorker:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 device: torch.device | str, dtype: torch.dtype, decode_kernel: bool | None = None):
        """dtype: the store's values (the model's, or FP8: attended in the queries' dtype). decode_kernel: attend
        decode rows with the paged Triton kernel (default: where it runs, decode_kernel_runs)."""
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size, self.scale = block_size, head_dim**-0.5
        self.decode_kernel = decode_kernel_runs(device) if decode_kernel is None else decode_kernel
        self._paged = None
        """gpu_model.paged_attn where decode_kernel (imported once: it needs triton)."""
        if self.decode_kernel:
            from gpu_model import paged_attn

            self._paged = paged_attn
        self.busy_s = 0.0
        """Seconds in this worker's calls since the last take_timings (on CUDA: launching, not running)."""
        self._slots: torch.Tensor | None = None  # [T] the slot of each row of the step
        self._seqs: list[tuple[int, int, int, slice | torch.Tensor]] = []
        """Per chunk SDPA attends: (first row, rows, start position, its context's slots: a slice where consecutive)."""
        self._decode: tuple | None = None
        """The decode rows the kernel attends: (their rows: a slice where consecutive, block tables [R, blocks] int32,
        context lengths [R] int32, the longest, splits)."""

    @property
    def num_blocks(self) -> int:
        return self.k_cache.shape[2] // self.block_size

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.itemsize

    def begin_step(self, chunks: Sequence[ChunkLayout]) -> None:
        dev, bs = self.k_cache.device, self.block_size
        slots, self._seqs, decode = [], [], []
        row = 0
        for c in chunks:
            if c.num_draft:
                raise ValueError("draft rows are attended by the CPU workers only")
            end = c.start_pos + c.num_tokens
            table, ctx = _slots_of(c.block_table, bs, end)
            slots.append(ctx[c.start_pos:])
            if self.decode_kernel and c.num_tokens == 1:
                decode.append((row, table, end))
            else:
                consecutive = bool((table[1:] - table[:-1] == 1).all())
                first = int(table[0]) * bs
                self._seqs.append((row, c.num_tokens, c.start_pos,
                                   slice(first, first + end) if consecutive else ctx.to(dev)))
            row += c.num_tokens
        self._slots = torch.cat(slots).to(dev) if slots else None
        self._decode = self._decode_batch(decode) if decode else None

    def _decode_batch(self, decode: list[tuple[int, torch.Tensor, int]]) -> tuple:
        dev = self.k_cache.device
        rows = [r for r, _, _ in decode]
        tables = torch.from_numpy(padded_tables([t.tolist() for _, t, _ in decode]))
        lens = torch.tensor([end for _, _, end in decode], dtype=torch.int32)
        max_len = int(lens.max())
        where = (slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[0] + len(rows)))
                 else torch.tensor(rows, device=dev))
        splits = self._paged.num_splits(len(rows), self.k_cache.shape[1], max_len, dev)
        return where, tables.to(dev), lens.to(dev), max_len, splits

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codes=None) -> torch.Tensor:
        """q: [T, Hq, D], k, v: [T, Hkv, D] on the device (codes: ignored) -> [T, Hq * D] in q's dtype."""
        t0 = time.perf_counter()
        kc, vc = self.k_cache[layer], self.v_cache[layer]  # [Hkv, slots, D]
        if self._slots is not None:
            _write(kc, self._slots, k)
            _write(vc, self._slots, v)
        out = torch.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=q.dtype, device=q.device)
        if self._decode is not None:
            rows, tables, lens, max_len, splits = self._decode
            kb, vb = (kc.view(torch.uint8), vc.view(torch.uint8)) if kc.dtype == FP8 else (kc, vc)
            o = self._paged.paged_decode(q[rows], kb, vb, tables, lens, max_len, self.block_size, self.scale,
                                         splits)
            if not self._seqs:  # every row a decode row, in order
                self.busy_s += time.perf_counter() - t0
                return o
            out[rows] = o
        for first, n, start, ctx in self._seqs:
            # [1, Hkv, start + n, D]: a view where ctx is a slice (fp8: widened to q's dtype)
            kx, vx = _read(kc, ctx, q.dtype)[None], _read(vc, ctx, q.dtype)[None]
            qx = q[first:first + n].to(kx.dtype).transpose(0, 1)[None]  # [1, Hq, n, D]
            mask = None
            if n > 1:  # position start + i sees keys 0 .. start + i
                mask = (torch.arange(start + n, device=q.device)[None, :]
                        <= torch.arange(start, start + n, device=q.device)[:, None])
            o = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[first:first + n] = o[0].transpose(0, 1).flatten(1).to(q.dtype)
        self.busy_s += time.perf_counter() - t0
        return out

    def load(self, layer: int, block_table, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write a sequence's first len(k) positions of one layer: k, v [n, Hkv, D] (a sequence moved here from
        the host's store)."""
        slots = _slots_of(block_table, self.block_size, k.shape[0])[1].to(self.k_cache.device)
        _write(self.k_cache[layer], slots, k)
        _write(self.v_cache[layer], slots, v)

    def free(self, seq_ids) -> None:
        """Nothing per sequence is kept beyond its blocks."""

    def take_centers(self) -> list:
        return []

    def take_timings(self) -> dict[str, float]:
        busy, self.busy_s = self.busy_s, 0.0
        return {"gpu_attn": busy}
