"""The paged KV store: physical K/V memory on the CPU, addressed by block ids.

    k (and v): [num_layers, num_blocks, num_kv_heads, block_size, head_dim]

    block_table of one sequence = [7, 2]    block_size = 4
    layer l, kv-head h:   k[l, 7, h, 0:4, :]  -> positions 0..3
                          k[l, 2, h, 0:4, :]  -> positions 4..7

A kv-head's rows of one block are contiguous, so the decode kernel streams them. Which block
ids a sequence owns is decided by the scheduler's block manager (server.block_manager); this
store never allocates, it only reads and writes the blocks it is told.
"""
from __future__ import annotations

import numpy as np

from cpu_attn.kernels import paged_decode_attention, write_kv

# fp16 is kept as raw uint16 bits (Numba has no CPU float16); see kernels.py
_STORAGE = {"float16": np.uint16, "float32": np.float32}
_ITEMSIZE = {"float16": 2, "float32": 4}


class PagedKVStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: str = "float16"):
        if dtype not in _STORAGE:
            raise ValueError(f"KV dtype must be float16 or float32, not {dtype!r}")
        sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                     num_blocks=num_blocks)
        bad = [k for k, v in sizes.items() if v < 1]
        if bad:
            raise ValueError(f"{', '.join(bad)} must be positive")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.num_blocks, self.dtype = block_size, num_blocks, dtype
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        # np.zeros maps fresh pages lazily: a large capacity costs RAM only once blocks are written
        self.k = np.zeros(shape, dtype=_STORAGE[dtype])
        self.v = np.zeros(shape, dtype=_STORAGE[dtype])

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: str) -> int:
        """Bytes of one block id across K and V of every layer."""
        return 2 * num_layers * num_kv_heads * block_size * head_dim * _ITEMSIZE[dtype]

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim,
                                                      self.block_size, self.dtype)

    def _encode(self, x: np.ndarray) -> np.ndarray:
        return x.astype(np.float16).view(np.uint16) if self.dtype == "float16" else np.ascontiguousarray(x, np.float32)

    def _decode(self, x: np.ndarray) -> np.ndarray:
        return x.view(np.float16).astype(np.float32) if self.dtype == "float16" else x.astype(np.float32)

    def write(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """slot_mapping: [T] int64; k, v: [T, Hkv, D] float32."""
        write_kv(self.k[layer], self.v[layer], slot_mapping, self._encode(k), self._encode(v))

    def gather(self, layer: int, block_table, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's first `seq_len` positions -> k, v: [seq_len, Hkv, D] float32."""
        blocks = np.asarray(block_table[: -(-seq_len // self.block_size)], dtype=np.int64)

        def rows(cache: np.ndarray) -> np.ndarray:
            x = cache[layer, blocks].transpose(0, 2, 1, 3).reshape(-1, self.num_kv_heads, self.head_dim)
            return self._decode(x[:seq_len])

        return rows(self.k), rows(self.v)

    def decode_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                         scale: float) -> tuple[np.ndarray, np.ndarray]:
        """q: [B, Hq, D] float32 -> out [B, Hq, D], lse [B, Hq] (float32)."""
        num_seqs, num_heads, head_dim = q.shape
        group = num_heads // self.num_kv_heads
        work = num_seqs * self.num_kv_heads
        out = np.empty((num_seqs, num_heads, head_dim), dtype=np.float32)
        lse = np.empty((num_seqs, num_heads), dtype=np.float32)
        paged_decode_attention(
            np.ascontiguousarray(q, np.float32), self.k[layer], self.v[layer], block_tables, seq_lens,
            np.float32(scale), out, lse,
            np.empty((work, group, self.block_size), np.float32), np.empty((work, head_dim), np.float32),
            np.empty((work, group), np.float32), np.empty((work, group), np.float32))
        return out, lse
