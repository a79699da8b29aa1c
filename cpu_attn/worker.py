"""The CPU attention worker: owns the KV store and answers one layer's attention at a time.

Per step the worker is told the batch layout once (`begin_step`); then, for each layer, it
receives q, k, v of every token in the flat batch, appends k, v to the store and returns the
attention output. 1-token chunks (decodes) go to the paged Numba kernel, or, with a sparse
part (MagicPig, or the TopK yardstick), to sampled attention on the layers and sequences it
takes; longer chunks (prefill) to SDPA over the chunk plus the sequence's earlier context read
from the store.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from cpu_attn.kv_store import KVStore, PagedKVStore
from cpu_attn.magicpig import MagicPig
from cpu_attn.prefill import prefill_attention
from cpu_attn.topk import TopK


@dataclass(frozen=True)
class ChunkLayout:
    """What the worker needs to know of one sequence's chunk (mirrors hetcore.backend.SeqChunk)."""

    num_tokens: int
    start_pos: int
    block_table: tuple[int, ...]
    seq_id: int = -1
    num_draft: int = 0
    """Of num_tokens, the last ones that are draft tokens (speculative decoding): then every row of the chunk
    is attended as a decode row of its own position, after the KV of all rows is written."""


def padded_tables(tables: Sequence[Sequence[int]]) -> np.ndarray:
    """Block tables as one int32 array [len(tables), the longest], each row padded with zeros."""
    out = np.zeros((len(tables), max((len(t) for t in tables), default=1)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


@dataclass
class _StepPlan:
    slot_mapping: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64, of each row in its sequence
    decode_rows: torch.Tensor  # [B] rows of 1-token chunks in the flat batch
    block_tables: np.ndarray  # [B, max_blocks] int32
    seq_lens: np.ndarray  # [B] int32
    prefills: list[tuple[int, int, int, tuple[int, ...]]]  # (first row, num_tokens, start_pos, block_table)
    chunks: list[tuple[int, int, int, int, tuple[int, ...], bool]]
    """(first row, num_tokens, start_pos, seq_id, block_table, decode: a one-token chunk or one with drafts)"""
    decode_seq_ids: list[int]
    provisional: np.ndarray | None = None
    """[T] bool with draft tokens: the rows of chunks with drafts, which the next step may write again."""
    verify: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    """With a chunk with draft tokens: the decode rows per sequence, (block_tables [S, max_blocks], the first row's
    seq_len [S], first decode row [S], rows [S]) for the store's verify_attention; None otherwise."""


class DecodeKV(NamedTuple):
    """A step of decode rows only, for a kernel that runs the step's layers in one call and writes and attends the
    rows itself (gpu_model/cpu_decode.decode_layers), as `attend` would layer by layer (kernels.attend_rows)."""

    k: np.ndarray
    """[layers, num_blocks, Hkv, block_size, D] float32, or uint16 fp16 bits (PagedKVStore.rows_as_written)."""
    v: np.ndarray
    slot_mapping: np.ndarray  # [T] int64, each row's slot
    block_tables: np.ndarray  # [B, max_blocks] int32: per row, or per sequence with drafts
    seq_lens: np.ndarray  # [B] int32: tokens a row sees, or a sequence's first row sees with drafts
    row_first: np.ndarray  # with drafts: [B] int32, each sequence's first row; else empty
    row_count: np.ndarray  # with drafts: [B] int32, each sequence's rows; else empty
    scale: float
    scratch: tuple
    """kernels.attention_scratch (one row a sequence) or verify_scratch (drafts), as a plain tuple."""


class AttentionWorker:
    def __init__(self, store: KVStore, head_dim: int, sparse: MagicPig | TopK | None = None):
        self.store = store
        self.sparse = sparse
        self.scale = head_dim**-0.5
        self.busy_s = 0.0
        """Seconds spent in attention and KV writes since the last `take_timings`."""
        self.dense_s = 0.0
        """Of those, the layers a sparse part keeps exact (MagicPIG's dense layers)."""
        self._plan: _StepPlan | None = None

    def begin_step(self, chunks: Sequence[ChunkLayout]) -> None:
        bs = self.store.block_size
        slots, positions, decode_rows, tables, seq_lens, prefills, spans, decode_ids = [], [], [], [], [], [], [], []
        groups = []  # (first decode row, rows, first row's seq_len, block table) of each decoding sequence
        row = 0
        for c in chunks:
            pos = np.arange(c.start_pos, c.start_pos + c.num_tokens)
            table = np.asarray(c.block_table, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            positions.append(pos)
            decode = c.num_tokens == 1 or c.num_draft > 0
            spans.append((row, c.num_tokens, c.start_pos, c.seq_id, c.block_table, decode))
            if decode:
                groups.append((len(decode_rows), c.num_tokens, c.start_pos + 1, c.block_table))
                for i in range(c.num_tokens):
                    decode_ids.append(c.seq_id)
                    decode_rows.append(row + i)
                    tables.append(c.block_table)
                    seq_lens.append(c.start_pos + 1 + i)
            else:
                prefills.append((row, c.num_tokens, c.start_pos, c.block_table))
            row += c.num_tokens
        block_tables = padded_tables(tables)
        drafting = any(c.num_draft for c in chunks)
        if self.sparse is not None:
            self.sparse.begin_step()
        self._plan = _StepPlan(
            slot_mapping=np.concatenate(slots) if slots else np.zeros(0, np.int64),
            positions=np.concatenate(positions) if positions else np.zeros(0, np.int64),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long),
            block_tables=block_tables,
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            prefills=prefills,
            chunks=spans,
            decode_seq_ids=decode_ids,
            provisional=np.repeat([c.num_draft > 0 for c in chunks], [c.num_tokens for c in chunks])
            if drafting else None,
            verify=self._verify_plan(groups) if drafting else None,
        )

    @staticmethod
    def _verify_plan(groups: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        tables = padded_tables([t for *_, t in groups])
        first, rows, lens = (np.array([g[i] for g in groups], dtype=np.int32) for i in range(3))
        return tables, lens, first, rows

    def decode_kv(self, num_heads: int) -> DecodeKV | None:
        """The step's KV for a whole-step decode kernel where every row is a decode row (one-token decodes, or
        decodes with draft tokens) attended exactly over a store that keeps rows as written (fp16, fp32), with no
        sparse part; else None (then `attend`, a layer at a time). After such a kernel, call `decoded`."""
        plan = self._plan
        rows = self.store.rows_as_written() if isinstance(self.store, PagedKVStore) else None
        if rows is None or self.sparse is not None or plan.prefills:
            return None
        if plan.verify is None:
            none = np.zeros(0, np.int32)
            return DecodeKV(*rows, plan.slot_mapping, plan.block_tables, plan.seq_lens, none, none, self.scale,
                            self.store.decode_scratch(num_heads, plan.seq_lens))
        tables, seq_lens, row_first, row_count = plan.verify
        return DecodeKV(*rows, plan.slot_mapping, tables, seq_lens, row_first, row_count, self.scale,
                        self.store.verify_rows_scratch(num_heads, seq_lens, row_count))

    def decoded(self, kv: DecodeKV, seconds: float) -> None:
        """After a whole-step kernel ran this step's `kv` (decode_kv): add its `seconds` of attention and KV writes
        to the step's timings."""
        self.busy_s += seconds

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codes=None) -> torch.Tensor:
        """q: [T, Hq, D], k, v: [T, Hkv, D] (CPU float32), codes: (decode rows' q codes, k codes)
        from the model worker's LshCoder or None -> attention output [T, Hq * D]."""
        t0 = time.perf_counter()
        plan = self._plan
        self.append(layer, k, v, None if codes is None else codes[1])
        q_codes = None if codes is None else codes[0].numpy()
        if not plan.prefills:  # decode-only step: the kernel's output is the whole answer
            o = self._decode(layer, q.numpy(), q_codes)
            self._count(layer, t0)
            return torch.from_numpy(o).reshape(q.shape[0], -1)
        out = torch.empty(q.shape, dtype=q.dtype)
        if len(plan.decode_rows):
            rows = plan.decode_rows
            out[rows] = torch.from_numpy(self._decode(layer, q[rows].numpy(), q_codes))
        for first, n, start, table in plan.prefills:
            if start == 0:
                k_ctx, v_ctx = k[first : first + n], v[first : first + n]
            else:
                k_np, v_np = self.store.gather(layer, table, start + n)
                k_ctx, v_ctx = torch.from_numpy(k_np), torch.from_numpy(v_np)
            out[first : first + n] = prefill_attention(q[first : first + n], k_ctx, v_ctx, start, self.scale)
        self._count(layer, t0)
        return out.reshape(q.shape[0], -1)

    def _count(self, layer: int, t0: float) -> None:
        took = time.perf_counter() - t0
        self.busy_s += took
        if self.sparse is not None and not self.sparse.sampled_layers[layer]:
            self.dense_s += took

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_codes: torch.Tensor | None = None) -> None:
        """Write the step's k, v [T, Hkv, D] to the store (and k to the sparse part's tables) only."""
        plan = self._plan
        assert plan is not None, "begin_step must come first"
        self.store.write(layer, plan.slot_mapping, k.contiguous().numpy(), v.contiguous().numpy(), plan.positions,
                         plan.provisional)
        if self.sparse is not None and self.sparse.sampled_layers[layer]:
            codes = None if k_codes is None else k_codes.numpy()  # sliced below as NumPy: ~1 us a row less
            for first, n, start, seq_id, table, decode in plan.chunks:
                self.sparse.append(layer, seq_id, start, k[first:first + n],
                                   None if codes is None else codes[first:first + n],
                                   functools.partial(self._stored_keys, layer, table, start), decode)

    def _stored_keys(self, layer: int, table: tuple[int, ...], n: int) -> torch.Tensor:
        """A sequence's first `n` keys as stored (those it took from the prefix cache)."""
        return torch.from_numpy(self.store.gather(layer, table, n)[0])

    def _decode(self, layer: int, q: np.ndarray, q_codes: np.ndarray | None) -> np.ndarray:
        plan = self._plan
        if self.sparse is not None:  # each row, draft rows too, as the decode row of its position
            sampled = self.sparse.decode_attention(self.store, layer, plan.decode_seq_ids, q, q_codes,
                                                     plan.block_tables, plan.seq_lens, self.scale)
            if sampled is not None:
                return sampled[0]
        if plan.verify is not None:  # rows of draft tokens
            return self.store.verify_attention(layer, q, *plan.verify, self.scale)[0]
        return self.store.decode_attention(layer, q, plan.block_tables, plan.seq_lens, self.scale)[0]

    def take_centers(self) -> list:
        """MagicPIG key centers chosen here since the last call (MagicPig.take_centers), for the
        model worker's coder (ModelWorker.set_centers) after the step: the keys of the step that
        chose them were coded here."""
        return self.sparse.take_centers() if self.sparse is not None else []

    def free(self, seq_ids) -> None:
        """Drop per-sequence state of finished or preempted sequences."""
        if self.sparse is not None:
            self.sparse.free(seq_ids)

    def take_timings(self) -> dict[str, float]:
        """Seconds since the last call: `cpu_attn`, and with a sparse part `cpu_attn_dense`, of those the
        layers it keeps exact."""
        timings = {"cpu_attn": self.busy_s, **({"cpu_attn_dense": self.dense_s} if self.sparse is not None else {})}
        self.busy_s = self.dense_s = 0.0
        return timings
