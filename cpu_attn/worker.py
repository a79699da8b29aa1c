"""The CPU attention worker: owns the KV store and answers one layer's attention at a time.

Per step the worker is told the batch layout once (`begin_step`); then, for each layer, it
receives q, k, v of every token in the flat batch, appends k, v to the store and returns the
attention output. 1-token chunks (decodes) go to the paged Numba kernel; longer chunks
(prefill) to SDPA over the chunk plus the sequence's earlier context read from the store.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from cpu_attn.kv_store import KVStore
from cpu_attn.prefill import prefill_attention


@dataclass(frozen=True)
class ChunkLayout:
    """What the worker needs to know of one sequence's chunk (mirrors server.backend.SeqChunk)."""

    num_tokens: int
    start_pos: int
    block_table: tuple[int, ...]


@dataclass
class _StepPlan:
    slot_mapping: np.ndarray  # [T] int64
    decode_rows: torch.Tensor  # [B] rows of 1-token chunks in the flat batch
    block_tables: np.ndarray  # [B, max_blocks] int32
    seq_lens: np.ndarray  # [B] int32
    prefills: list[tuple[int, int, int, tuple[int, ...]]]  # (first row, num_tokens, start_pos, block_table)


class AttentionWorker:
    def __init__(self, store: KVStore, head_dim: int):
        self.store = store
        self.scale = head_dim**-0.5
        self.busy_s = 0.0
        """Seconds spent in attention and KV writes since the last `take_busy_s`."""
        self._plan: _StepPlan | None = None

    def begin_step(self, chunks: Sequence[ChunkLayout]) -> None:
        bs = self.store.block_size
        slots, decode_rows, tables, seq_lens, prefills = [], [], [], [], []
        row = 0
        for c in chunks:
            pos = np.arange(c.start_pos, c.start_pos + c.num_tokens)
            table = np.asarray(c.block_table, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            if c.num_tokens == 1:
                decode_rows.append(row)
                tables.append(c.block_table)
                seq_lens.append(c.start_pos + 1)
            else:
                prefills.append((row, c.num_tokens, c.start_pos, c.block_table))
            row += c.num_tokens
        width = max((len(t) for t in tables), default=1)
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        self._plan = _StepPlan(
            slot_mapping=np.concatenate(slots) if slots else np.zeros(0, np.int64),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long),
            block_tables=block_tables,
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            prefills=prefills,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k, v: [T, Hkv, D] (CPU float32) -> attention output [T, Hq * D]."""
        t0 = time.perf_counter()
        plan = self._plan
        assert plan is not None, "begin_step must come first"
        self.store.write(layer, plan.slot_mapping, k.contiguous().numpy(), v.contiguous().numpy())
        if not plan.prefills:  # decode-only step: the kernel's output is the whole answer
            o, _ = self.store.decode_attention(layer, q.numpy(), plan.block_tables, plan.seq_lens, self.scale)
            self.busy_s += time.perf_counter() - t0
            return torch.from_numpy(o).reshape(q.shape[0], -1)
        out = torch.empty(q.shape, dtype=q.dtype)
        if len(plan.decode_rows):
            o, _ = self.store.decode_attention(layer, q[plan.decode_rows].numpy(), plan.block_tables, plan.seq_lens,
                                               self.scale)
            out[plan.decode_rows] = torch.from_numpy(o)
        for first, n, start, table in plan.prefills:
            if start == 0:
                k_ctx, v_ctx = k[first : first + n], v[first : first + n]
            else:
                k_np, v_np = self.store.gather(layer, table, start + n)
                k_ctx, v_ctx = torch.from_numpy(k_np), torch.from_numpy(v_np)
            out[first : first + n] = prefill_attention(q[first : first + n], k_ctx, v_ctx, start, self.scale)
        self.busy_s += time.perf_counter() - t0
        return out.reshape(q.shape[0], -1)

    def take_busy_s(self) -> float:
        busy, self.busy_s = self.busy_s, 0.0
        return busy
