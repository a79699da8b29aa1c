"""The attention worker of layered KV sparsity (hetcore/kv_policy.py).

Every block holds `layout.slots` layers; layer l lives in slot l % slots of the blocks of its group
l // slots, in that group's store (`stores[g]`: one store over the block pool for every group, or for
Oaken KV one per group, each with its layers' calibration over the same codes). Group 0's layers run
as in AttentionWorker, on the chunk's block_table. Every other group's layers run on the chunk's
KVView: its rows are appended after the rows the group holds,
attention reads rows [0, rows_before + n), and a sparse group then scores its rows and, when the
view says so, keeps the best `keep_after` of them, compacted to the front of its blocks (the store's
`compact`, which keeps each row's position):

    before (budget 6, sinks 1, window 2)    rows  0 1 2 3 4 5 6 7 8      kept: 0, 3, 5, 6, 7, 8
    after                                   rows  0 3 5 6 7 8 . . .      (the last blocks go free)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from cpu_attn.kv_policy import accumulate_probs, observed_attention, pooled, select_keep
from cpu_attn.kv_store import KVStore, PagedKVStore
from cpu_attn.prefill import prefill_attention
from cpu_attn.worker import AttentionWorker, ChunkLayout, DecodeKV, _StepPlan, padded_tables
from hetcore.kv_policy import KVLayout, KVView


@dataclass(frozen=True)
class LayeredChunkLayout(ChunkLayout):
    """A ChunkLayout with its rows in the groups past the first."""

    kv_view: KVView | None = None


@dataclass
class _GroupPlan:
    slot_mapping: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64: each token's position in its sequence
    decode_rows: torch.Tensor  # [B] rows of 1-token chunks in the flat batch
    decode_seq_ids: list[int]
    block_tables: np.ndarray  # [B, max_blocks] int32
    seq_lens: np.ndarray  # [B] int32: rows attended, the new one included
    prefills: list[tuple[int, int, int, tuple[int, ...], int, int]]
    """(first row, num_tokens, rows_before, table, seq_id, observed: the last rows whose queries score)"""
    evictions: list[tuple[int, int, int, tuple[int, ...], bool]]
    """(seq_id, rows held, rows kept, table, after a prompt chunk)"""


def _group_plan(chunks: Sequence[LayeredChunkLayout], index: int, block_size: int, step: _StepPlan) -> _GroupPlan:
    """The plan of group index + 1 (view entry `index`). Positions and decode rows are the step's (`step`, group
    0's plan); a one-token chunk's slot is plain integer arithmetic (a step plans every group: 29 with one full
    layer of SmolLM2-135M)."""
    slots = np.empty(len(step.positions), np.int64)
    tables, seq_lens, prefills, evictions = [], [], [], []
    row = 0
    for c in chunks:
        v = c.kv_view
        table, before, after = v.tables[index], v.rows_before[index], v.keep_after[index]
        if c.num_tokens == 1:
            slots[row] = table[before // block_size] * block_size + before % block_size
            tables.append(table)
            seq_lens.append(before + 1)
        else:
            rows = np.arange(before, before + c.num_tokens)
            slots[row:row + c.num_tokens] = (np.asarray(table, dtype=np.int64)[rows // block_size] * block_size
                                             + rows % block_size)
            prefills.append((row, c.num_tokens, before, table, c.seq_id, v.observed))
        if after < before + c.num_tokens:
            evictions.append((c.seq_id, before + c.num_tokens, after, table, c.num_tokens > 1))
        row += c.num_tokens
    return _GroupPlan(slots, step.positions, step.decode_rows, step.decode_seq_ids, padded_tables(tables),
                      np.asarray(seq_lens, dtype=np.int32), prefills, evictions)


class LayeredDecodeKV(NamedTuple):
    """A step of one-token decodes over a layered cache whose groups share one fp16 / fp32 store, for the kernel that
    runs every layer in one call (gpu_model/cpu_decode.decode_layers): DecodeKV with each layer on its group's
    rows, and the sparse layers' row probabilities for their scores."""

    k: np.ndarray
    """[slots, num_blocks, Hkv, block_size, D] (PagedKVStore.rows_as_written)."""
    v: np.ndarray
    layer_group: np.ndarray  # [L] int64
    layer_slot: np.ndarray  # [L] int64
    group_sparse: np.ndarray  # [G] bool
    slot_mapping: np.ndarray  # [G, B] int64: each row's slot in each group's blocks
    block_tables: np.ndarray  # [G, B, max_blocks] int32
    seq_lens: np.ndarray  # [G, B] int32: rows each sequence attends in each group, the new one included
    scale: float
    full_scratch: tuple
    """kernels.attention_scratch for the rows of the full groups, as a plain tuple."""
    sparse_scratch: tuple
    """The same for the sparse groups' rows (the longest of them, where budgets differ)."""
    raw: np.ndarray  # [B, Hq, longest sparse row count] float32: the scored kernel's scratch
    probs: np.ndarray
    """[L, B, Hkv, longest sparse row count] float32 zeros; a sparse layer's row probabilities are added to its own."""


class LayeredAttentionWorker(AttentionWorker):
    """AttentionWorker over stores of `layout.slots` layers, one per layer group, with per-group rows and eviction.
    A store needs, beside KVStore's methods, scored_decode_attention and compact (PagedKVStore, OakenKVStore)."""

    def __init__(self, stores: Sequence[KVStore], head_dim: int, layout: KVLayout):
        assert len(stores) == layout.num_groups and all(s.num_layers == layout.slots for s in stores), \
            "a store of `slots` layers for each group"
        assert all(s.rows_per_head for s in stores), "stores whose kv-heads keep rows of their own (compact)"
        super().__init__(stores[0], head_dim, None)
        self.stores = list(stores)
        self.layout = layout
        self._scores: dict[int, np.ndarray] = {}
        """seq_id -> [num_layers, Hkv, capacity] float32: each row's accumulated attention (sparse layers')."""
        self._groups: list[_GroupPlan] = []
        self._layer_group, self._layer_slot = (np.array(x, np.int64) for x in zip(*map(layout.group_of,
                                                                                   range(layout.num_layers))))
        """Each layer's group and its slot in the group's store (decode_kv)."""
        self._sparse = np.array([layout.is_sparse(g) for g in range(layout.num_groups)])
        """Which groups evict by score (decode_kv)."""

    def begin_step(self, chunks: Sequence[LayeredChunkLayout]) -> None:
        super().begin_step(chunks)
        bs = self.store.block_size
        self._groups = [_group_plan(chunks, i, bs, self._plan) for i in range(self.layout.num_groups - 1)]
        for c in chunks:
            need = max((b + c.num_tokens for b in c.kv_view.rows_before), default=0)
            have = self._scores.get(c.seq_id)
            if have is None or have.shape[2] < need:
                grown = np.zeros((self.layout.num_layers, self.store.num_kv_heads, max(need, 2 * (0 if have is None
                                                                                                  else have.shape[2]))),
                                 np.float32)
                if have is not None:
                    grown[:, :, :have.shape[2]] = have
                self._scores[c.seq_id] = grown

    def decode_kv(self, num_heads: int) -> LayeredDecodeKV | None:
        """The step's KV for the whole-step decode kernel where every row is a one-token decode and every group
        lives in one store that keeps rows as written (fp16, fp32); else None (Oaken, prefill chunks: `attend`, a
        layer at a time). After the kernel, `decoded` adds the probabilities to the scores and evicts."""
        plan = self._plan
        rows = self.store.rows_as_written() if isinstance(self.store, PagedKVStore) else None
        if rows is None or plan.prefills or plan.verify is not None or any(s is not self.store for s in self.stores):
            return None
        groups: list[_StepPlan | _GroupPlan] = [plan, *self._groups]
        num_seqs = len(plan.seq_lens)
        tables = np.zeros((len(groups), num_seqs, max(g.block_tables.shape[1] for g in groups)), np.int32)
        for i, g in enumerate(groups):
            tables[i, :, :g.block_tables.shape[1]] = g.block_tables
        seq_lens = np.stack([g.seq_lens for g in groups])
        sparse = self._sparse
        sparse_lens = seq_lens[sparse].max(axis=0) if sparse.any() else plan.seq_lens
        longest, num_layers = int(sparse_lens.max()), self.layout.num_layers
        return LayeredDecodeKV(*rows, self._layer_group, self._layer_slot, sparse,
                               np.stack([g.slot_mapping for g in groups]), tables, seq_lens, self.scale,
                               self.store.decode_scratch(num_heads, plan.seq_lens),
                               self.store.decode_scratch(num_heads, sparse_lens),
                               np.empty((num_seqs, num_heads, longest), np.float32),
                               np.zeros((num_layers, num_seqs, self.store.num_kv_heads, longest), np.float32))

    def decoded(self, kv: DecodeKV | LayeredDecodeKV, seconds: float) -> None:
        """After the whole-step kernel ran `kv` (decode_kv): each sparse layer's row probabilities join the rows'
        scores, then each group's evictions run, as `attend` does them a layer at a time."""
        t0 = time.perf_counter()
        for layer in range(self.layout.num_layers):
            group, slot = self.layout.group_of(layer)
            if group == 0:
                continue
            plan = self._groups[group - 1]
            if self._sparse[group]:
                self._add_probs(layer, plan, kv.probs[layer])
            self._run_evictions(self.stores[group], layer, slot, plan, {})
        self.busy_s += seconds + time.perf_counter() - t0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codes=None) -> torch.Tensor:
        """As AttentionWorker.attend; layers past group 0 on their group's rows."""
        group, slot = self.layout.group_of(layer)
        if group == 0:
            return super().attend(slot, q, k, v)
        t0 = time.perf_counter()
        plan, store = self._groups[group - 1], self.stores[group]
        sparse = self.layout.is_sparse(group)
        store.write(slot, plan.slot_mapping, k.contiguous().numpy(), v.contiguous().numpy(), plan.positions)
        if not plan.prefills:  # a decode-only step: every row is a decode row, in order
            out = torch.from_numpy(self._decode_rows(store, layer, slot, np.ascontiguousarray(q.numpy(), np.float32),
                                                     plan, sparse))
        else:
            out = torch.empty(q.shape, dtype=q.dtype)
        if len(plan.decode_rows) and plan.prefills:
            rows = plan.decode_rows
            out[rows] = torch.from_numpy(self._decode_rows(store, layer, slot,
                                                           np.ascontiguousarray(q[rows].numpy(), np.float32), plan,
                                                           sparse))
        policy = self.layout.policy
        at_prompt_end = {e[0] for e in plan.evictions if e[4]}
        focus = {}
        for first, n, before, table, seq_id, observed in plan.prefills:
            last = min(policy.focus, observed) if sparse and seq_id in at_prompt_end else 0
            out[first:first + n], focus[seq_id] = self._prefill(
                store, layer, slot, q[first:first + n], k[first:first + n], v[first:first + n], before, table, seq_id,
                observed if sparse else 0, last)
        self._run_evictions(store, layer, slot, plan, focus)
        self.busy_s += time.perf_counter() - t0
        return out.reshape(q.shape[0], -1)

    def _run_evictions(self, store: KVStore, layer: int, slot: int, plan: _GroupPlan, focus: dict) -> None:
        """The plan's evictions at one layer: at a prompt's end over the policy's score pool with the prefill's
        `focus` (seq_id -> its observed queries' scores), during decode one row at a time."""
        pool = self.layout.policy.score_pool
        for seq_id, held, kept, table, prompt in plan.evictions:
            self._evict(store, layer, slot, seq_id, held, kept, table, pool if prompt else 1,
                        focus.get(seq_id) if prompt else None)

    def _decode_rows(self, store: KVStore, layer: int, slot: int, q: np.ndarray, plan: _GroupPlan,
                     sparse: bool) -> np.ndarray:
        """q: [B, Hq, D] of the plan's decode rows -> their attention output [B, Hq, D]."""
        if sparse:
            return self._scored_decode(store, layer, slot, q, plan)
        return store.decode_attention(slot, q, plan.block_tables, plan.seq_lens, self.scale)[0]

    def _scored_decode(self, store: KVStore, layer: int, slot: int, q: np.ndarray, plan: _GroupPlan) -> np.ndarray:
        """Exact decode attention over the group's rows; each row's probabilities add to its score."""
        out, lse, raw = store.scored_decode_attention(slot, q, plan.block_tables, plan.seq_lens, self.scale)
        num_seqs, longest = len(q), raw.shape[2]
        probs = np.zeros((num_seqs, store.num_kv_heads, longest), np.float32)
        accumulate_probs(raw, lse, plan.seq_lens, store.num_kv_heads, probs)
        self._add_probs(layer, plan, probs)
        return out

    def _add_probs(self, layer: int, plan: _GroupPlan, probs: np.ndarray) -> None:
        """probs [B, Hkv, >= rows] of the plan's decode rows added to their sequences' scores at `layer` (after
        the scores decay, KVPolicy.score_decay)."""
        decay = self.layout.policy.score_decay
        for b, seq_id in enumerate(plan.decode_seq_ids):
            n = int(plan.seq_lens[b])
            scores = self._scores[seq_id][layer, :, :n]
            if decay != 1.0:
                scores *= decay
            scores += probs[b, :, :n]

    def _prefill(self, store: KVStore, layer: int, slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 before: int, table: tuple[int, ...], seq_id: int, observed: int,
                 last: int) -> tuple[torch.Tensor, np.ndarray | None]:
        """A prompt chunk's attention (q: [n, Hq, D]) over the group's rows (its own at before ..
        before + n - 1, causal by row: the rows before it are earlier tokens, kept); its last `observed`
        queries also score the rows (a sparse group's, KVView.observed). Returns the output and, when `last`,
        the scores of the chunk's last `last` queries alone [Hkv, before + n] (KVPolicy.focus)."""
        n = q.shape[0]
        if before:
            k_np, v_np = store.gather(slot, table, before + n)
            k_ctx, v_ctx = torch.from_numpy(k_np), torch.from_numpy(v_np)
        else:
            k_ctx, v_ctx = k, v
        if observed == 0:
            return prefill_attention(q, k_ctx, v_ctx, before, self.scale), None
        m = n - observed  # rows that only attend
        out = torch.empty(q.shape, dtype=q.dtype)
        if m:
            out[:m] = prefill_attention(q[:m], k_ctx[:before + m], v_ctx[:before + m], before, self.scale)
        o, scores, tail = observed_attention(q[m:], k_ctx, v_ctx, np.arange(before + m, before + n), self.scale, last)
        out[m:] = o
        self._scores[seq_id][layer, :, :before + n] += scores
        return out, tail

    def _evict(self, store: KVStore, layer: int, slot: int, seq_id: int, held: int, kept: int, table: tuple[int, ...],
               pool: int, focus: np.ndarray | None) -> None:
        """Keep `kept` of the `held` rows of each kv-head, each ranked by the larger of its score and the mean of the
        `pool` rows around it; the kept rows carry that on. With `focus` (the prompt's last queries' scores,
        KVPolicy.focus), a row ranks by the larger of its own score and its pooled focus score, scaled to the same
        total."""
        p = self.layout.policy
        scores = self._scores[seq_id][layer]  # [Hkv, capacity]
        own = scores[:, :held]
        if focus is not None:
            ranked_focus = focus if pool == 1 else np.maximum(focus, pooled(focus, pool))
            scale = own.sum(axis=1, keepdims=True) / np.maximum(ranked_focus.sum(axis=1, keepdims=True), 1e-30)
            ranked = np.maximum(own, ranked_focus * scale)
        else:
            ranked = own if pool == 1 else np.maximum(own, pooled(own, pool))
        keep = select_keep(ranked, kept, p.sinks, p.window_rows(kept))
        store.compact(slot, table, held, keep)
        scores[:, :kept] = np.take_along_axis(ranked, keep, axis=1)
        scores[:, kept:] = 0.0

    def free(self, seq_ids) -> None:
        super().free(seq_ids)
        for seq_id in seq_ids:
            self._scores.pop(seq_id, None)
