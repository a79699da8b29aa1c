"""KV block accounting: which physical blocks each sequence owns. Pure Python.

    block_table[seq] = [7, 2, 9]         block_size = 4
    positions          0..3  4..7  8..11
    a sequence of 10 tokens holds 3 blocks; token p lives in block_table[p // 4], slot p % 4

The KV store (cpu_attn) is the physical memory addressed by these ids; it never allocates.
A sequence may also hold blocks outside its table (KVSpec.reserve_blocks): room for state its
worker keeps beside the KV, counted here so that admission by free blocks bounds that state too.

Prefix caching: a full block can be registered under a key that names every token up to its
end (Sequence.block_keys). A later sequence whose tokens start the same way takes those blocks
into its own table instead of computing them again, so a block may sit in several tables
(counted in `_refs`). A registered block no table holds stays cached, idle, until a new block
is needed and no block is free: then the least recently used idle block is taken.

Layered KV sparsity (spec.kv_layout, hetcore/kv_policy.py): a block id then holds one block of rows
for the `slots` layers of one layer group. The table above is group 0's (the full layers'); each
sequence also holds one table per later group, whose rows SeqRows counts:

    seq 5, 4000-token prompt, budget 1024 + slack 16, block_size 16
    group 0 table: 250 blocks  (every token; grows by one block every 16 decodes)
    group 1 table: 250 blocks while the prompt is prefilled; 66 once its last chunk ran
                   (rows 0..1023 are the kept tokens, compacted by the worker; room for
                   budget + slack + 1 rows, the most it holds before it evicts again)

Evicted rows free whole blocks at the end of the sequence's table: the worker compacts the kept
rows to the front of the same blocks, so the blocks past them (and past the group's cap) are
released in commit() (after the step that evicted, never before it has run). A sequence holding no
blocks is admitted only with room for its prompt's peak in every group (admission_reserve). Group tables never enter the prefix cache: a sparse
layer's rows depend on the whole sequence, and a full layer's cached rows are no use without them,
so share_prefix finds nothing under a layered layout.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, deque

from hetcore.backend import KVSpec
from hetcore.kv_policy import KVView, SeqRows


class BlockManager:
    """Blocks split in shards, one per CPU attention worker (`spec.shards`; one shard by default).
    A sequence takes its first block from the live shard with the most free blocks and every
    later one from the same shard; a shard set down (its worker died) takes no new sequences."""

    def __init__(self, spec: KVSpec):
        self.spec = spec
        sizes = spec.shards or (spec.num_blocks,)
        assert sum(sizes) == spec.num_blocks, "shards must add up to num_blocks"
        self._starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self._free: list[deque[int]] = [deque(range(a, a + n)) for a, n in zip(self._starts, sizes)]
        self._idle: list[OrderedDict[int, None]] = [OrderedDict() for _ in sizes]
        """Per shard: registered blocks that no table holds, least recently used first."""
        self._cached: list[dict[bytes, int]] = [{} for _ in sizes]
        """Per shard: block key -> the block registered under it."""
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        """Table blocks -> how many tables hold them."""
        self._uncommitted: list[int] = []
        """Blocks registered for the step now running (their KV is written by it)."""
        self.queried_tokens = 0
        """Tokens of admitted sequences looked up in the prefix cache, and of those found there."""
        self.hit_tokens = 0
        self._tables: dict[int, list[int]] = {}
        self._reserved: dict[int, list[int]] = {}
        self._own: dict[int, list[int]] = {}
        """Blocks held for a sequence's own state of the blocks it shared (KVSpec.own_share)."""
        self._shard_of: dict[int, int] = {}
        self.live: set[int] = set(range(len(sizes)))
        self.open: set[int] = set(range(len(sizes)))
        """Shards new sequences may be placed on (Backend.open_shards); live ones outside it keep their own."""
        self._placed: dict[int, int | None] = {}
        """first_fit: the shard can_hold chose for a sequence holding no blocks yet, for its first allocate."""
        self._layout = spec.kv_layout if spec.kv_layout is not None and spec.kv_layout.is_layered else None
        self._rows: dict[int, SeqRows] = {}
        """Layered: each sequence's rows in groups 1, 2, ... (group 0's rows are its tokens)."""
        self._groups: dict[int, list[list[int]]] = {}
        """Layered: each sequence's tables of groups 1, 2, ..."""
        self._num_tokens: dict[int, int] = {}
        """Layered: tokens each sequence's chunks have covered so far."""
        self._trims: list[int] = []
        self.num_evictions = 0
        """Layered: chunks after which a sequence's sparse groups evicted rows."""
        """Layered: sequences whose group tables may shrink once the step now running has run."""
        self.max_seq_blocks = max(sizes)
        """The most blocks one sequence can ever hold (its shard's size)."""

    @property
    def max_seq_tokens(self) -> int:
        """The most tokens one sequence can ever hold (in max_seq_blocks, its table reserve aside; with a
        layered layout, every group holds the whole prompt while it is prefilled)."""
        groups = self._layout.num_groups if self._layout else 1
        return self.spec.max_tokens(self.max_seq_blocks // groups)

    @property
    def num_shards(self) -> int:
        return len(self._free)

    def _room(self, shard: int) -> int:
        """Blocks a shard can still hand out: free ones and idle cached ones."""
        return len(self._free[shard]) + len(self._idle[shard])

    @property
    def num_free_blocks(self) -> int:
        return sum(self._room(i) for i in self.live)

    @property
    def used_bytes(self) -> int:
        return (self.spec.num_blocks - sum(map(self._room, range(self.num_shards)))) * self.spec.bytes_per_block

    @property
    def capacity_bytes(self) -> int:
        return self.spec.num_blocks * self.spec.bytes_per_block

    def shard_used_bytes(self) -> list[int]:
        sizes = self.spec.shards or (self.spec.num_blocks,)
        return [(n - self._room(i)) * self.spec.bytes_per_block for i, n in enumerate(sizes)]

    def _missing(self, seq_id: int, num_tokens: int) -> tuple[int, int]:
        """(table blocks, reserved blocks) `seq_id` still needs to hold `num_tokens` tokens."""
        spec = self.spec
        return (max(0, spec.table_blocks(num_tokens) - len(self._tables.get(seq_id, ()))),
                max(0, spec.reserve_for(num_tokens) - len(self._reserved.get(seq_id, ()))))

    def _group_missing(self, seq_id: int, num_tokens: int) -> list[int]:
        """Layered: blocks each group past the first still needs for the sequence to reach `num_tokens`."""
        rows = self._rows.get(seq_id) or SeqRows(self._layout)
        tables = self._groups.get(seq_id) or [[] for _ in rows.rows]
        needed = rows.needed(num_tokens - self._num_tokens.get(seq_id, 0))
        return [max(0, self.spec.table_blocks(n) - len(t)) for n, t in zip(needed, tables)]

    def num_missing(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still needs to hold `num_tokens` tokens, its reserve (and later groups' tables) included."""
        groups = sum(self._group_missing(seq_id, num_tokens)) if self._layout is not None else 0
        return sum(self._missing(seq_id, num_tokens)) + groups

    def shard_of(self, seq_id: int) -> int | None:
        return self._shard_of.get(seq_id)

    def _shard_for(self, seq_id: int, need: int) -> int | None:
        """The sequence's shard; for a new one, where it would go when it asks for `need` blocks first."""
        shard = self._shard_of.get(seq_id)
        candidates = sorted(self.live & self.open)
        if shard is None and candidates:
            fits = [s for s in candidates if self._room(s) >= need] if self.spec.first_fit else []
            shard = fits[0] if fits else max(candidates, key=self._room)
        return shard

    def can_hold(self, seq_id: int, num_tokens: int, reserve: int = 0, place_tokens: int = 0) -> bool:
        """Whether `seq_id` can grow to `num_tokens` (and `reserve` blocks more). With first_fit, a sequence holding
        no blocks yet is placed by `place_tokens` (the tokens it will hold, its prompt) too, and the next allocate
        keeps that shard: a prompt the accelerator's pool cannot hold whole goes to the host's."""
        need = self.num_missing(seq_id, num_tokens) + reserve
        shard = self._shard_for(seq_id, max(need, self.num_missing(seq_id, place_tokens) + reserve))
        if self.spec.first_fit and seq_id not in self._shard_of:
            self._placed[seq_id] = shard
        return shard is not None and need <= self._room(shard)

    def allocate(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        """Grow `seq_id`'s table to cover `num_tokens`, and take its reserve once due; returns the
        whole table."""
        to_table, to_reserve = self._missing(seq_id, num_tokens)
        shard = self._placed.pop(seq_id, None)
        if shard is None:
            shard = self._shard_for(seq_id, self.num_missing(seq_id, num_tokens))
        room = 0 if shard is None else self._room(shard)
        if self.num_missing(seq_id, num_tokens) > room:
            raise MemoryError(f"sequence {seq_id} needs {self.num_missing(seq_id, num_tokens)} blocks, {room} free "
                              "in its shard")
        self._shard_of[seq_id] = shard
        table = self._tables.setdefault(seq_id, [])
        for _ in range(to_table):
            block = self._take(shard)
            self._refs[block] = 1
            table.append(block)
        if to_reserve:
            self._reserved.setdefault(seq_id, []).extend(self._take(shard) for _ in range(to_reserve))
        if self._layout is not None:
            missing = self._group_missing(seq_id, num_tokens)
            self._rows.setdefault(seq_id, SeqRows(self._layout))
            groups = self._groups.setdefault(seq_id, [[] for _ in missing])
            for group, n in zip(groups, missing):
                group.extend(self._take(shard) for _ in range(n))
        return tuple(table)

    def advance(self, seq_id: int, num_tokens: int, end: int) -> KVView | None:
        """Layered: the sequence's chunk up to `num_tokens` (allocated) is scheduled; `end`: the sequence's
        token count, where the prefill the chunk is part of ends (a chunk that reaches it is the last: then its
        sparse groups may evict). Returns the chunk's KVView; the
        blocks an eviction frees are released by commit(). None without a layered layout."""
        if self._layout is None:
            return None
        rows, tables = self._rows[seq_id], self._groups[seq_id]
        num_new = num_tokens - self._num_tokens.get(seq_id, 0)
        before, after, observed = rows.advance(num_new, end)
        self._num_tokens[seq_id] = num_tokens
        if any(a < b + num_new for a, b in zip(after, before)):
            self._trims.append(seq_id)
            self.num_evictions += 1
        return KVView(tuple(tuple(t) for t in tables), before, after, observed)

    def admission_reserve(self, seq_id: int, num_tokens: int, chunk: int, num_running: int) -> int:
        """Layered: blocks to keep free, beyond its first chunk's, before a sequence holding no blocks is
        admitted: the rest of its prompt's peak in every group (prefilled `chunk` tokens a step), and one
        block for each of the `num_running` sequences' growth meanwhile. Admitting into room a long
        prompt then outgrows preempts (and recomputes) the latest arrival again and again. 0 without a
        layered layout, or for a sequence that holds blocks."""
        if self._layout is None or seq_id in self._shard_of:
            return 0
        rows = SeqRows(self._layout)
        first = sum(self.spec.table_blocks(n) for n in [chunk, *rows.needed(chunk)])
        peak = sum(self.spec.table_blocks(n) for n in [num_tokens, *rows.peak(num_tokens, chunk)])
        return max(0, peak - first) + num_running

    def group_used_blocks(self) -> list[int]:
        """Blocks held per layer group (group 0: every block in use that no later group holds)."""
        groups = self._layout.num_groups if self._layout else 1
        later = [sum(len(t[g]) for t in self._groups.values()) for g in range(groups - 1)]
        used = self.spec.num_blocks - sum(map(self._room, range(self.num_shards)))
        return [used - sum(later), *later]

    def _take(self, shard: int) -> int:
        """A free block, else the least recently used idle one (it leaves the cache)."""
        if self._free[shard]:
            return self._free[shard].popleft()
        block, _ = self._idle[shard].popitem(last=False)
        del self._cached[shard][self._key_of.pop(block)]
        return block

    def free(self, seq_id: int) -> None:
        self._placed.pop(seq_id, None)
        shard = self._shard_of.pop(seq_id, None)
        if shard is None:
            return
        self._release(shard, self._tables.pop(seq_id, ()))
        self._free[shard].extend(self._reserved.pop(seq_id, ()))
        self._free[shard].extend(self._own.pop(seq_id, ()))
        for group in self._groups.pop(seq_id, ()):
            self._free[shard].extend(group)
        self._rows.pop(seq_id, None)
        self._num_tokens.pop(seq_id, None)

    def _release(self, shard: int, table) -> None:
        """A table gives up its blocks: those no other table holds go free, or stay cached (idle) if registered."""
        for block in table:
            self._refs[block] -= 1
        released = [b for b in table if not self._refs[b]]
        for block in released:
            del self._refs[block]
        self._free[shard].extend(b for b in released if b not in self._key_of)
        # cached ones last block first: a prefix's end is evicted before its start, which every later block needs
        self._idle[shard].update((b, None) for b in reversed(released) if b in self._key_of)

    def can_move(self, seq_id: int, shard: int, spare: int = 0) -> bool:
        """Whether `seq_id` could move to `shard` (move) and leave `spare` blocks there: it holds a table in another
        live shard and nothing beside it (no reserve, own or group blocks)."""
        src = self._shard_of.get(seq_id)
        return (src is not None and src != shard and shard in self.live
                and seq_id not in self._reserved and seq_id not in self._own and self._layout is None
                and self._room(shard) >= len(self._tables[seq_id]) + spare)

    def move(self, seq_id: int, shard: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Give `seq_id` (can_move) as many blocks in `shard` as its table holds, in place of that table, which is
        released as free() releases it (registered blocks stay cached in their shard; the new ones are not
        registered, later blocks are as usual); returns (old table, new table)."""
        assert self.can_move(seq_id, shard), "move needs can_move"
        old = self._tables[seq_id]
        new = [self._take(shard) for _ in old]
        for block in new:
            self._refs[block] = 1
        self._release(self._shard_of[seq_id], old)
        self._tables[seq_id], self._shard_of[seq_id] = new, shard
        return tuple(old), tuple(new)

    # ---- prefix caching
    def share_prefix(self, seq_id: int, keys: list[bytes]) -> int:
        """Give `seq_id`, which holds no blocks yet, the cached blocks of its first full blocks'
        `keys`, from the live shard that has the longest run of them, and the blocks for its own
        state of them (KVSpec.own_blocks) when that shard has room; returns how many it shares."""
        assert seq_id not in self._shard_of, "share_prefix is for a sequence's first blocks"
        if self._layout is not None:
            return 0
        best, shard = 0, None
        for s in sorted(self.live):
            n = 0
            while n < len(keys) and keys[n] in self._cached[s]:
                n += 1
            if n > best or (n == best and n and self._room(s) > self._room(shard)):
                best, shard = n, s
        table = [self._cached[shard][k] for k in keys[:best]] if best else []
        own = self.spec.own_blocks(best)
        idle = sum(b not in self._refs for b in table)  # idle blocks count as room until taken
        if not best or own > self._room(shard) - idle:
            return 0
        for block in table:
            if block not in self._refs:
                del self._idle[shard][block]
            self._refs[block] = self._refs.get(block, 0) + 1
        self._shard_of[seq_id], self._tables[seq_id] = shard, table
        if own:
            self._own[seq_id] = [self._take(shard) for _ in range(own)]
        return best

    def register(self, seq_id: int, keys: list[bytes], first: int = 0) -> None:
        """Register `seq_id`'s table blocks first, first + 1, ... under `keys[first:]`, the blocks this
        step fills (their KV is written before any later attention reads it: layer by layer, writes
        come first). A block whose key another block already has stays unregistered."""
        shard, table = self._shard_of[seq_id], self._tables[seq_id]
        cached = self._cached[shard]
        for block, key in zip(table[first:], keys[first:]):
            if block not in self._key_of and key not in cached:
                cached[key], self._key_of[block] = block, key
                self._uncommitted.append(block)

    def commit(self) -> None:
        """The step ran: the blocks it registered hold their KV, and the group blocks its evictions emptied
        go free."""
        self._uncommitted.clear()
        for seq_id in self._trims:
            if seq_id not in self._shard_of:
                continue
            shard = self._shard_of[seq_id]
            rows = self._rows[seq_id]
            for group, held, cap in zip(self._groups[seq_id], rows.rows, rows.caps()):
                keep = self.spec.table_blocks(max(held, cap))
                self._free[shard].extend(group[keep:])
                del group[keep:]
        self._trims.clear()

    def forget_uncommitted(self) -> None:
        """The step failed (no commit came): its blocks' KV may be missing, so they leave the cache."""
        for block in self._uncommitted:
            self._forget(block)
        self._uncommitted.clear()

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is None:
            return
        shard = bisect.bisect_right(self._starts, block) - 1
        del self._cached[shard][key]
        if block in self._idle[shard]:  # no table holds it: now plainly free
            del self._idle[shard][block]
            self._free[shard].append(block)

    def set_live(self, shards: set[int]) -> None:
        """The shards able to take sequences now. One no longer among them (its worker died) loses its
        cache: a restarted worker's store is empty."""
        for s in self.live - shards:
            for block in list(self._cached[s].values()):
                self._forget(block)
        self.live = set(shards)

    def table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables.get(seq_id, ()))
