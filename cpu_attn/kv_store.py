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

from typing import Protocol

import numpy as np

from cpu_attn.calibrate import SPARSE_FRACTION, OakenThresholds
from cpu_attn.kernels import (attention_scratch, gather_rows, paged_decode_attention, paged_verify_groups,
                              split_parts, verify_row_groups, verify_scratch, write_kv, zeros_aligned)
from cpu_attn.kv_policy import compact_rows, paged_decode_attention_scored
from cpu_attn.oaken.store import OakenKVStore

# fp16 is kept as raw uint16 bits (Numba has no CPU float16); see fp16.py
_STORAGE = {"float16": np.uint16, "float32": np.float32}
_ITEMSIZE = {"float16": 2, "float32": 4}


class KVStore(Protocol):
    """What the attention worker needs of a store, whatever its format."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    def write(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray,
              positions: np.ndarray | None = None, provisional: np.ndarray | None = None) -> None:
        """provisional: [T] bool, rows a later write may replace (draft tokens), which must leave no trace then."""

    def gather(self, layer: int, block_table, seq_len: int) -> tuple[np.ndarray, np.ndarray]: ...

    def decode_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                         scale: float) -> tuple[np.ndarray, np.ndarray]: ...

    def verify_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                         row_first: np.ndarray, row_count: np.ndarray,
                         scale: float) -> tuple[np.ndarray, np.ndarray]: ...

    # layered KV sparsity's worker (cpu_attn/layered_worker.py) also needs:
    rows_per_head: bool
    """Whether compact may keep other rows in each kv-head (the layered worker needs it)."""

    def scored_decode_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                                scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def compact(self, layer: int, block_table, held: int, keep: np.ndarray) -> None: ...


class PagedKVStore:
    rows_per_head = True  # a row of one kv-head is independent of the others'

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
        self.k = zeros_aligned(shape, _STORAGE[dtype])
        self.v = zeros_aligned(shape, _STORAGE[dtype])

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: str) -> int:
        """Bytes of one block id across K and V of every layer."""
        return 2 * num_layers * num_kv_heads * block_size * head_dim * _ITEMSIZE[dtype]

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim,
                                                      self.block_size, self.dtype)

    def rows_as_written(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The caches k, v [layers, num_blocks, Hkv, block_size, D] (float32, or uint16 fp16 bits) for a kernel that
        writes rows itself (gpu_model/cpu_decode.decode_layers): a row is stored as it comes, narrowed to fp16 or
        not. None where `write` does more."""
        return self.k, self.v

    def _encode(self, x: np.ndarray) -> np.ndarray:
        return x.astype(np.float16).view(np.uint16) if self.dtype == "float16" else np.ascontiguousarray(x, np.float32)

    def write(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray,
              positions: np.ndarray | None = None, provisional: np.ndarray | None = None) -> None:
        """slot_mapping: [T] int64; k, v: [T, Hkv, D] float32 (positions, provisional: unused here: rows are
        independent, a row written again replaces the old one)."""
        write_kv(self.k[layer], self.v[layer], slot_mapping, self._encode(k), self._encode(v))

    def gather(self, layer: int, block_table, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's first `seq_len` positions -> k, v: [seq_len, Hkv, D] float32 (kernels.gather_rows)."""
        blocks = np.asarray(block_table[: -(-seq_len // self.block_size)], dtype=np.int64)
        k, v = (np.empty((seq_len, self.num_kv_heads, self.head_dim), np.float32) for _ in range(2))
        gather_rows(self.k[layer], blocks, seq_len, k)
        gather_rows(self.v[layer], blocks, seq_len, v)
        return k, v

    def decode_scratch(self, num_heads: int, seq_lens: np.ndarray) -> tuple:
        """paged_decode_attention's scratch for one query row of `num_heads` heads per sequence of `seq_lens`, as a
        plain tuple (see oaken/records.py)."""
        work = len(seq_lens) * self.num_kv_heads
        return tuple(attention_scratch(work, num_heads // self.num_kv_heads, self.block_size, self.head_dim,
                                       split_parts(work, seq_lens, self.block_size)))

    def verify_rows_scratch(self, num_heads: int, seq_lens: np.ndarray, row_count: np.ndarray) -> tuple:
        """paged_verify_groups' scratch and row groups for row_count[b] rows of sequence b, its first seeing
        seq_lens[b] tokens (kernels.verify_row_groups: each row cut into a one-row decode's parts)."""
        work, most = len(seq_lens) * self.num_kv_heads, int(row_count.max())
        groups = verify_row_groups(self.num_kv_heads, seq_lens, row_count, self.block_size)
        return (*verify_scratch(work, most, num_heads // self.num_kv_heads, self.block_size, self.head_dim,
                                int(groups[:, 2].max())), groups)

    def decode_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                         scale: float) -> tuple[np.ndarray, np.ndarray]:
        """q: [B, Hq, D] float32 -> out [B, Hq, D], lse [B, Hq] (float32)."""
        num_seqs, num_heads, head_dim = q.shape
        out = np.empty((num_seqs, num_heads, head_dim), dtype=np.float32)
        lse = np.empty((num_seqs, num_heads), dtype=np.float32)
        paged_decode_attention(np.ascontiguousarray(q, np.float32), self.k[layer], self.v[layer], block_tables, seq_lens,
                               np.float32(scale), out, lse, self.decode_scratch(num_heads, seq_lens))
        return out, lse

    def scored_decode_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                                scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """decode_attention that also returns every row's logit: raw [B, Hq, max(seq_lens)] float32, row t of
        sequence b scale * q[b, h] . k_t (t < seq_lens[b]), from the kernel's own scores
        (kv_policy.paged_decode_attention_scored)."""
        num_seqs, num_heads, head_dim = q.shape
        out = np.empty((num_seqs, num_heads, head_dim), np.float32)
        lse = np.empty((num_seqs, num_heads), np.float32)
        raw = np.empty((num_seqs, num_heads, int(seq_lens.max())), np.float32)
        paged_decode_attention_scored(np.ascontiguousarray(q, np.float32), self.k[layer], self.v[layer], block_tables,
                                      seq_lens, np.float32(scale), out, lse, raw,
                                      self.decode_scratch(num_heads, seq_lens))
        return out, lse, raw

    def compact(self, layer: int, block_table, held: int, keep: np.ndarray) -> None:
        """Keep keep.shape[1] of a sequence's first `held` rows, compacted to the front: row i of kv-head h becomes
        its old row keep[h, i] (keep [Hkv, K] ascending; layered KV sparsity, kv_policy.compact_rows)."""
        compact_rows(self.k[layer], self.v[layer], np.asarray(block_table, np.int64), keep)

    def verify_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                         row_first: np.ndarray, row_count: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Consecutive positions per sequence (kernels.paged_verify_groups): q [T, Hq, D] float32, sequence b's
        row_count[b] rows from row_first[b], its first row seeing seq_lens[b] tokens -> out [T, Hq, D], lse [T, Hq]."""
        num_rows, num_heads, head_dim = q.shape
        out = np.empty((num_rows, num_heads, head_dim), dtype=np.float32)
        lse = np.empty((num_rows, num_heads), dtype=np.float32)
        paged_verify_groups(np.ascontiguousarray(q, np.float32), self.k[layer], self.v[layer], block_tables, seq_lens,
                            row_first, row_count, np.float32(scale), out, lse,
                            *self.verify_rows_scratch(num_heads, seq_lens, row_count))
        return out, lse


def _int_roundtrip(x: np.ndarray, axis: int, bits: int = 4) -> np.ndarray:
    """Asymmetric `bits`-bit quantize-dequantize along `axis`, min and scale kept as float16."""
    top = 2**bits - 1
    lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    scale = ((hi - lo) / top).astype(np.float16).astype(np.float32)
    lo = lo.astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, 1)
    return (np.clip(np.rint((x - lo) / safe), 0, top) * scale + lo).astype(np.float32)


_INT_BITS = {"int4": 4, "int5": 5, "int6": 6}  # the per-token integer baselines


class SimQuantKVStore(PagedKVStore):
    """The integer baselines of the accuracy table, simulated on an fp32 store: values are
    quantized and dequantized as they are appended, so attention sees exactly what the format
    would give, but memory is fp32 (they are for comparison, not for serving).

    int4: per token, one min/scale over all KV heads of a layer (the same unit as Oaken's scales),
          no outlier handling.
    int5, int6: the same with 5 and 6 bits: 5.17 and 6.17 bits per value at SmolLM2's shape, around
          Oaken's realized 5.17 (the paper's ratios, the default) and 5.49 (the ratios 0.06 / 0.08), so Oaken compares
          with a per-token INT at equal and at more bits.
    kivi: KIVI-style; keys per channel and values per token (per head) over each full block, the
          block being filled (the most recent < block_size tokens) kept in full precision.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 kind: str):
        if kind not in (*_INT_BITS, "kivi"):
            raise ValueError(f"unknown simulated KV format {kind!r}")
        super().__init__(num_layers, num_kv_heads, head_dim, block_size, num_blocks, "float32")
        self.kind = kind

    def rows_as_written(self) -> None:
        return None  # write quantizes

    def write(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray,
              positions: np.ndarray | None = None, provisional: np.ndarray | None = None) -> None:
        if self.kind in _INT_BITS:
            c = self.num_kv_heads * self.head_dim
            k, v = (_int_roundtrip(x.reshape(-1, c), 1, _INT_BITS[self.kind]).reshape(x.shape) for x in (k, v))
        super().write(layer, slot_mapping, k, v)
        if self.kind == "kivi":
            for block in slot_mapping[slot_mapping % self.block_size == self.block_size - 1] // self.block_size:
                kb, vb = self.k[layer, block], self.v[layer, block]  # [Hkv, block_size, D]
                kb[:] = _int_roundtrip(kb, 1)  # per channel, over the block's tokens
                vb[:] = _int_roundtrip(vb, 2)  # per token and head

    def effective_bits(self) -> float:
        c = self.num_kv_heads * self.head_dim
        if self.kind in _INT_BITS:
            return _INT_BITS[self.kind] + 32 / c
        return 4 + (32 / self.block_size + 32 / self.head_dim) / 2


KV_FORMATS = ("oaken", "fp16", "fp32", "int4", "int5", "int6", "kivi")


def bytes_per_block(kv_format: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    sparse_fraction: float = SPARSE_FRACTION) -> int:
    if kv_format == "oaken":
        return OakenKVStore.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, sparse_fraction)
    dtype = "float16" if kv_format == "fp16" else "float32"
    return PagedKVStore.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)


def make_store(kv_format: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
               oaken_cal: OakenThresholds | None = None, sparse_fraction: float = SPARSE_FRACTION, recent_blocks: int = 0):
    """The KV store for one of KV_FORMATS (oaken needs the calibration of `hetserve calibrate`;
    recent_blocks: its full-precision tail slots per layer, see OakenKVStore)."""
    geometry = (num_layers, num_kv_heads, head_dim, block_size, num_blocks)
    if kv_format == "oaken":
        return _oaken_store(geometry, oaken_cal, sparse_fraction, recent_blocks)
    if kv_format in (*_INT_BITS, "kivi"):
        return SimQuantKVStore(*geometry, kv_format)
    if kv_format in ("fp16", "fp32"):
        return PagedKVStore(*geometry, "float16" if kv_format == "fp16" else "float32")
    raise ValueError(f"kv_format must be one of {', '.join(KV_FORMATS)}, not {kv_format!r}")


def layered_bytes_per_block(kv_format: str, slots: int, num_kv_heads: int, head_dim: int, block_size: int,
                            sparse_fraction: float = SPARSE_FRACTION) -> int:
    """Bytes of one block id of a layered cache (a group's `slots` layers): as bytes_per_block, but Oaken's
    stores there keep one kv-head a layer (HeadRowsStore: scales, counts and sparse room per kv-head)."""
    if kv_format == "oaken":
        return OakenKVStore.bytes_per_block(slots * num_kv_heads, 1, head_dim, block_size, sparse_fraction)
    return bytes_per_block(kv_format, slots, num_kv_heads, head_dim, block_size, sparse_fraction)


def layered_stores(kv_format: str, slots: int, num_groups: int, num_kv_heads: int, head_dim: int, block_size: int,
                   num_blocks: int, oaken_cal: OakenThresholds | None = None, sparse_fraction: float = SPARSE_FRACTION,
                   recent_blocks: int = 0) -> list[KVStore]:
    """The stores of a layered cache's `num_groups` layer groups of `slots` layers each over one pool of blocks
    (cpu_attn/layered_worker.py): one fp16 / fp32 store for every group, or for Oaken one store per group
    (HeadRowsStore: each kv-head its own rows) with its layers' calibration (oaken_cal sliced, split per kv-head) and
    its own tails, all over the first one's codes and row positions."""
    geometry = (slots, num_kv_heads, head_dim, block_size, num_blocks)
    if kv_format in ("fp16", "fp32"):
        return [PagedKVStore(*geometry, "float16" if kv_format == "fp16" else "float32")] * num_groups
    if kv_format != "oaken":
        raise ValueError(f"a layered cache needs kv_format fp16, fp32 or oaken, not {kv_format!r}")
    inner: list[OakenKVStore] = []
    per_head = (slots * num_kv_heads, 1, head_dim, block_size, num_blocks)
    for g in range(num_groups):
        cal = None if oaken_cal is None else oaken_cal.for_layers(slice(g * slots, (g + 1) * slots)).per_head(
            num_kv_heads)
        inner.append(_oaken_store(per_head, cal, sparse_fraction, recent_blocks,
                                  codes_of=inner[0] if inner else None, row_positions=True))
    return [HeadRowsStore(x, num_kv_heads) for x in inner]


class HeadRowsStore:
    """An Oaken store of `num_layers` layers whose kv-heads keep rows of their own (rows_per_head): layer l's
    kv-head h is layer l * Hkv + h of `inner`, an OakenKVStore of one kv-head a layer, so a row's scales span one
    kv-head and compact moves each kv-head's own rows as their codes. The layered cache over Oaken
    (layered_stores); each call runs the inner store once a kv-head."""

    dtype = "oaken"
    rows_per_head = True

    def __init__(self, inner: OakenKVStore, num_kv_heads: int):
        assert inner.num_kv_heads == 1 and inner.num_layers % num_kv_heads == 0
        self.inner, self.num_kv_heads = inner, num_kv_heads
        self.num_layers = inner.num_layers // num_kv_heads
        self.head_dim, self.block_size, self.num_blocks = inner.head_dim, inner.block_size, inner.num_blocks

    def write(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray,
              positions: np.ndarray | None = None, provisional: np.ndarray | None = None) -> None:
        for h in range(self.num_kv_heads):
            self.inner.write(layer * self.num_kv_heads + h, slot_mapping, k[:, h:h + 1], v[:, h:h + 1], positions,
                             provisional)

    def _heads(self, layer: int, q: np.ndarray, attend) -> tuple[np.ndarray, ...]:
        """attend(inner layer, q of its query heads) for each kv-head, joined along the query heads."""
        group = q.shape[1] // self.num_kv_heads
        parts = [attend(layer * self.num_kv_heads + h, np.ascontiguousarray(q[:, h * group:(h + 1) * group]))
                 for h in range(self.num_kv_heads)]
        return tuple(np.concatenate(x, axis=1) for x in zip(*parts))

    def decode_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                         scale: float, splits: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self._heads(layer, q, lambda i, x: self.inner.decode_attention(i, x, block_tables, seq_lens, scale,
                                                                               splits))

    def scored_decode_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                                scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._heads(layer, q, lambda i, x: self.inner.scored_decode_attention(i, x, block_tables, seq_lens,
                                                                                      scale))

    def gather(self, layer: int, block_table, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        heads = [self.inner.gather(layer * self.num_kv_heads + h, block_table, seq_len)
                 for h in range(self.num_kv_heads)]
        return tuple(np.concatenate(x, axis=1) for x in zip(*heads))

    def compact(self, layer: int, block_table, held: int, keep: np.ndarray) -> None:
        for h in range(self.num_kv_heads):
            self.inner.compact(layer * self.num_kv_heads + h, block_table, held, keep[h:h + 1])


def _oaken_store(geometry: tuple, cal: OakenThresholds | None, sparse_fraction: float, recent_blocks: int,
                 **kw) -> OakenKVStore:
    """An OakenKVStore of `geometry` with the calibration `cal` (kw: OakenKVStore's codes_of, row_positions)."""
    if cal is None:
        raise ValueError("the oaken KV format needs calibrated thresholds (hetserve calibrate)")
    return OakenKVStore(*geometry, cal.values, sparse_fraction, cal.key_scales, recent_blocks, cal.key_bias,
                        cal.value_scales, cal.rope_inv_freq, cal.rotation, **kw)
