"""KV block accounting: which physical blocks each sequence owns. Pure Python.

    block_table[seq] = [7, 2, 9]         block_size = 4
    positions          0..3  4..7  8..11
    a sequence of 10 tokens holds 3 blocks; token p lives in block_table[p // 4], slot p % 4

The KV store (cpu_attn) is the physical memory addressed by these ids; it never allocates.
A sequence may also hold blocks outside its table (KVSpec.reserve_blocks): room for state its
worker keeps beside the KV, counted here so that admission by free blocks bounds that state too.
"""
from __future__ import annotations

from collections import deque

from server.backend import KVSpec


class BlockManager:
    """Blocks split in shards, one per CPU attention worker (`spec.shards`; one shard by default).
    A sequence takes its first block from the live shard with the most free blocks and every
    later one from the same shard; a shard set down (its worker died) takes no new sequences."""

    def __init__(self, spec: KVSpec):
        self.spec = spec
        sizes = spec.shards or (spec.num_blocks,)
        assert sum(sizes) == spec.num_blocks, "shards must add up to num_blocks"
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self._free: list[deque[int]] = [deque(range(a, a + n)) for a, n in zip(starts, sizes)]
        self._tables: dict[int, list[int]] = {}
        self._reserved: dict[int, list[int]] = {}
        self._shard_of: dict[int, int] = {}
        self.live: set[int] = set(range(len(sizes)))
        self.max_seq_blocks = max(sizes)
        """The most blocks one sequence can ever hold (its shard's size)."""

    @property
    def num_shards(self) -> int:
        return len(self._free)

    @property
    def num_free_blocks(self) -> int:
        return sum(len(self._free[i]) for i in self.live)

    @property
    def used_bytes(self) -> int:
        return (self.spec.num_blocks - sum(map(len, self._free))) * self.spec.bytes_per_block

    @property
    def capacity_bytes(self) -> int:
        return self.spec.num_blocks * self.spec.bytes_per_block

    def shard_used_bytes(self) -> list[int]:
        sizes = self.spec.shards or (self.spec.num_blocks,)
        return [(n - len(f)) * self.spec.bytes_per_block for n, f in zip(sizes, self._free)]

    def _missing(self, seq_id: int, num_tokens: int) -> tuple[int, int]:
        """(table blocks, reserved blocks) `seq_id` still needs to hold `num_tokens` tokens."""
        spec = self.spec
        return (max(0, spec.table_blocks(num_tokens) - len(self._tables.get(seq_id, ()))),
                max(0, spec.reserve_for(num_tokens) - len(self._reserved.get(seq_id, ()))))

    def num_missing(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still needs to hold `num_tokens` tokens, its reserve included."""
        return sum(self._missing(seq_id, num_tokens))

    def shard_of(self, seq_id: int) -> int | None:
        return self._shard_of.get(seq_id)

    def _shard_for(self, seq_id: int) -> int | None:
        shard = self._shard_of.get(seq_id)
        if shard is None and self.live:
            shard = max(sorted(self.live), key=lambda i: len(self._free[i]))
        return shard

    def can_hold(self, seq_id: int, num_tokens: int, reserve: int = 0) -> bool:
        shard = self._shard_for(seq_id)
        return shard is not None and self.num_missing(seq_id, num_tokens) + reserve <= len(self._free[shard])

    def allocate(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        """Grow `seq_id`'s table to cover `num_tokens`, and take its reserve once due; returns the
        whole table."""
        to_table, to_reserve = self._missing(seq_id, num_tokens)
        shard = self._shard_for(seq_id)
        free = self._free[shard] if shard is not None else deque()
        if to_table + to_reserve > len(free):
            raise MemoryError(f"sequence {seq_id} needs {to_table + to_reserve} blocks, {len(free)} free in its shard")
        self._shard_of[seq_id] = shard
        table = self._tables.setdefault(seq_id, [])
        table.extend(free.popleft() for _ in range(to_table))
        if to_reserve:
            self._reserved.setdefault(seq_id, []).extend(free.popleft() for _ in range(to_reserve))
        return tuple(table)

    def free(self, seq_id: int) -> None:
        shard = self._shard_of.pop(seq_id, None)
        if shard is not None:
            self._free[shard].extend(self._tables.pop(seq_id, ()))
            self._free[shard].extend(self._reserved.pop(seq_id, ()))

    def table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables.get(seq_id, ()))
