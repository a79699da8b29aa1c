"""KV block accounting: which physical blocks each sequence owns. Pure Python.

    block_table[seq] = [7, 2, 9]         block_size = 4
    positions          0..3  4..7  8..11
    a sequence of 10 tokens holds 3 blocks; token p lives in block_table[p // 4], slot p % 4

The KV store (cpu_attn) is the physical memory addressed by these ids; it never allocates.
"""
from __future__ import annotations

from collections import deque

from server.backend import KVSpec


class BlockManager:
    def __init__(self, spec: KVSpec):
        self.spec = spec
        self._free: deque[int] = deque(range(spec.num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.spec.num_blocks - len(self._free)) * self.spec.bytes_per_block

    @property
    def capacity_bytes(self) -> int:
        return self.spec.num_blocks * self.spec.bytes_per_block

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.spec.block_size)

    def num_missing(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_hold(self, seq_id: int, num_tokens: int, reserve: int = 0) -> bool:
        return self.num_missing(seq_id, num_tokens) + reserve <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        """Grow `seq_id`'s table to cover `num_tokens`; returns the whole table."""
        missing = self.num_missing(seq_id, num_tokens)
        if missing > len(self._free):
            raise MemoryError(f"sequence {seq_id} needs {missing} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._free.popleft() for _ in range(missing))
        return tuple(table)

    def free(self, seq_id: int) -> None:
        self._free.extend(self._tables.pop(seq_id, ()))

    def table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables.get(seq_id, ()))
