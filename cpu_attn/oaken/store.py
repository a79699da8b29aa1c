"""OakenKVStore: K and V of every layer in Oaken's fused dense-sparse form, paged like
kv_store.PagedKVStore, with the calibration's per-channel transforms, full-precision tails for
blocks still filling, and exact and MagicPIG-sampled decode attention over it."""
from __future__ import annotations

import threading

import numba
import numpy as np

from cpu_attn import oaken, sampled
from cpu_attn.calibrate import SPARSE_FRACTION, rotate_half, turn
from cpu_attn.kernels import attention_scratch, split_parts, zeros_aligned


def _not_finite(what: str, layer: int, bad: int) -> ValueError:
    return ValueError(f"{what} of layer {layer} has NaN or inf in {bad} token(s); "
                      "Oaken quantization needs finite values")


def _block_runs(slot_mapping: np.ndarray, block_size: int) -> np.ndarray:
    """Boundaries [R + 1] of runs of consecutive rows that land in the same block."""
    blocks = slot_mapping // block_size
    return np.concatenate(([0], np.flatnonzero(np.diff(blocks)) + 1, [len(blocks)])).astype(np.int64)


class OakenKVStore:
    """K and V of every layer in Oaken's fused dense-sparse form (this package), paged like
    PagedKVStore. Each block owns a fixed sparse budget (`sparse_fraction` of its values), so a
    block's size in bytes is exact; a token that finds the budget full has its inner (then outer)
    values nearest the middle thresholds stored as middle values instead.

    Per-channel transforms from calibration ([L, Hkv * D] each, None = off): the store holds
    (K - R(p) key_bias) / key_scales and V / value_scales, where R(p) key_bias is the keys' mean
    before RoPE turned to the key's position p by the RoPE frequencies rope_inv_freq (zeros: a
    fixed center). Attention multiplies q by key_scales (q.k is the same, the keys' heavy channels
    are tamed), adds the turned center back to each key as it decodes it, and multiplies outputs by
    value_scales (attention is linear in V). Writes of centered keys need their positions.
    With a `rotation` ([D, D] orthogonal, calibrate.hadamard), each head's transformed K and V are
    stored times it (x @ rotation): queries are turned the same way (q.k is unchanged), outputs
    turned back, and the keys' center, which does not turn with them, is added in the score
    domain (oaken.add_center_scores; the MagicPIG kernel in a second dot product per row).

    With recent_blocks > 0, a block that is still filling (its first row written, not yet its
    last) stays in full precision in one of `recent_blocks` tail slots per layer and is quantized
    when its last row arrives, so a sequence's newest tokens are exact (as KIVI's window). When
    every slot is taken, the least recently written tail is quantized early (still correct, only
    less exact), so slots never leak: size them to the running batch.

    Rows a later write may replace (speculative drafts: `write(..., provisional=)`) may be rejected
    and written again from some position on. A quantized row's values depend only on the rows before
    it in its block (the block's sparse entries are laid out in row order), so rewriting rows in
    position order replaces them without a trace. A tail that provisional rows fill is quantized as
    usual but held: its slot keeps the rows in full precision until the layer's next write, which
    reopens the tail if it goes on into the block (the row that filled it was rejected), else lets
    the slot go. So the store ends as a write of the accepted rows alone would have left it, tails
    included. While a tail is held, attention reads the block from it for the rows before the one
    that filled it, as one-token decodes of those rows would have (_tail_passes)."""

    dtype = "oaken"
    rows_per_head = False
    """compact keeps whole tokens: a token's scales span all its kv-heads, so a row made of several tokens' heads
    would have to be quantized anew at the scale of its largest (on SmolLM2's values 6-9 % mean error a row, up to
    2x on small ones); whole tokens move as their codes."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 thresholds: np.ndarray, sparse_fraction: float = SPARSE_FRACTION, key_scales: np.ndarray | None = None,
                 recent_blocks: int = 0, key_bias: np.ndarray | None = None, value_scales: np.ndarray | None = None,
                 rope_inv_freq: np.ndarray | None = None, rotation: np.ndarray | None = None,
                 codes_of: OakenKVStore | None = None, row_positions: bool = False):
        """codes_of: a store of the same geometry whose codes (dense, scales, counts, sparse) this one uses
        instead of its own, so that stores with other layers' calibrations share one block pool (the layered
        cache: a block holds one layer group's rows, each group its own store over the pool,
        cpu_attn/layered_worker.py). Tails and calibration stay each store's own. row_positions: keep each
        row's position per kv-head (row_pos) instead of taking row t of a sequence's blocks as position t, so
        that rows may sit anywhere (compact); shared with codes_of's."""
        if head_dim % oaken.SEGMENT:
            raise ValueError(f"Oaken KV needs head_dim a multiple of {oaken.SEGMENT}, not {head_dim}")
        if thresholds.shape != (num_layers, 2, 4):
            raise ValueError(f"thresholds must be [{num_layers}, 2, 4], not {list(thresholds.shape)}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.num_blocks = block_size, num_blocks
        # copies: arrays that came through Ray are read-only, and Numba compiles every kernel again for
        # read-only arguments (the sampled kernel takes 89 s to compile on a Zen 1)
        self.thresholds = np.array(thresholds, np.float32, order="C")
        c = num_kv_heads * head_dim
        for name, x in (("key_scales", key_scales), ("key_bias", key_bias), ("value_scales", value_scales)):
            if x is not None and x.shape != (num_layers, c):
                raise ValueError(f"{name} must be [{num_layers}, {c}], not {list(x.shape)}")
        shape = (num_layers, num_kv_heads, head_dim)
        self.key_scales, self.value_scales = (
            np.full(shape, 1, np.float32) if x is None else np.array(x, np.float32, order="C").reshape(shape)
            for x in (key_scales, value_scales))
        self.key_bias = None if key_bias is None else np.array(key_bias, np.float32, order="C").reshape(shape)
        if rotation is not None and rotation.shape != (head_dim, head_dim):
            raise ValueError(f"rotation must be [{head_dim}, {head_dim}], not {list(rotation.shape)}")
        # [D, D], or [0, 0] when not rotating (as the kernels take it); the transpose turns back
        self.rotation = np.zeros((0, 0), np.float32) if rotation is None else np.array(rotation, np.float32, order="C")
        self._unrotation = np.ascontiguousarray(self.rotation.T)
        self._rope_freq = np.zeros(head_dim // 2) if rope_inv_freq is None else np.asarray(rope_inv_freq, np.float64)
        # RoPE tables [P, D / 2] (empty without centering: the kernels then skip it) and, for the
        # kernels, the key center and rotate_half of it in store space: [L, Hkv, 2, D]
        self._cos = self._sin = np.zeros((0, head_dim // 2), np.float32)
        self._block_cos = self._block_sin = self._cos  # the kernels': at block starts (oaken.add_key_center)
        self._offset_table = np.zeros((block_size, head_dim), np.float32)  # [cos | sin] at a block's offsets
        self._offset_pairs = np.zeros((head_dim // 2, 2 * block_size), np.int16)  # the same for oaken.vnni_center_scores
        self.key_center = np.zeros((num_layers, num_kv_heads, 2, head_dim), np.float32)
        if self.key_bias is not None:
            self.key_center[:, :, 0] = self.key_bias / self.key_scales
            self.key_center[:, :, 1] = rotate_half(self.key_bias) / self.key_scales
            self._rope_tables(1)
        self.budget = self.sparse_budget(num_kv_heads, head_dim, block_size, sparse_fraction)
        # full blocks in int16 dot products (oaken.vnni_* or avx2_*)
        self.int_dots = oaken.INT16 and block_size == oaken.ROWS
        lead = (num_layers, 2, num_blocks, block_size)
        if codes_of is not None:
            if codes_of.dense.shape != lead + (c // 2,) or codes_of.budget != self.budget:
                raise ValueError("codes_of must be a store of the same geometry and sparse budget")
            self.dense, self.scales, self.counts, self.sparse = (codes_of.dense, codes_of.scales, codes_of.counts,
                                                                 codes_of.sparse)
            self.row_pos = codes_of.row_pos
        else:
            self.dense = zeros_aligned(lead + (c // 2,), np.uint8)
            self.scales = zeros_aligned(lead + (3,), np.uint16)
            self.counts = zeros_aligned(lead + (c // oaken.SEGMENT,), np.uint8)
            # oaken.avx2_* read entries eight bytes at a time: up to 7 bytes past a block's last
            self.sparse = zeros_aligned((num_layers, 2, num_blocks, self.budget), np.uint8, slack=64)
            # [L, num_blocks, Hkv, bs] int32: each row's position (the layers of a group keep their own rows)
            self.row_pos = np.zeros((num_layers, num_blocks, num_kv_heads, block_size) if row_positions
                                    else (0, 0, 0, 0), np.int32)
        self.tail = zeros_aligned((num_layers, 2, recent_blocks, block_size, c), np.float32)
        self.tail_of = np.full((num_layers, num_blocks), -1, np.int32)  # tail slot of each block, or -1
        self.tail_block = np.full((num_layers, recent_blocks), -1, np.int64)  # block of each slot, or -1
        self.tail_len = np.zeros((num_layers, recent_blocks), np.int64)
        self.tail_stamp = np.zeros((num_layers, recent_blocks), np.int64)
        self.held = np.zeros((num_layers, recent_blocks), bool)  # quantized tails kept for provisional rows
        self._writes = 0
        # each layer's K and V and its tails as the kernels take them (oaken.OakenParts and oaken.TailSlots as
        # plain tuples of views into the arrays above, which are never replaced), made once
        self._layer_parts = [[tuple(oaken.OakenParts(self.dense[i, kv], self.scales[i, kv], self.counts[i, kv],
                                                     self.sparse[i, kv], self.tail[i, kv], self.tail_of[i],
                                                     self.thresholds[i, kv]))
                              for kv in (0, 1)] for i in range(num_layers)]
        self._tail_slots = [tuple(oaken.TailSlots(self.tail[i], self.tail_of[i], self.tail_len[i], self.tail_stamp[i],
                                                  self.tail_block[i])) for i in range(num_layers)]
        # get_thread_id() in a kernel is below the pool's size, whatever thread count the calling thread
        # set (Numba's count is per calling thread: the store may be built in one thread, used in another)
        threads = numba.config.NUMBA_NUM_THREADS
        f32 = np.float32
        self._scratch = tuple(oaken.TokenScratch(np.empty((threads, c), f32), np.empty((threads, c), np.int8),
                                                 np.empty((threads, 3), f32), np.empty((threads, 3), f32)))
        self._sampled: dict[int, sampled.SampledScratch] = {}  # sampled attention's scratch per calling thread

    @staticmethod
    def sparse_budget(num_kv_heads: int, head_dim: int, block_size: int, sparse_fraction: float) -> int:
        return int(np.ceil(block_size * num_kv_heads * head_dim * sparse_fraction))

    @staticmethod
    def tail_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, recent_blocks: int) -> int:
        return 2 * num_layers * recent_blocks * block_size * num_kv_heads * head_dim * 4

    @classmethod
    def bytes_per_block(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        sparse_fraction: float = SPARSE_FRACTION) -> int:
        c = num_kv_heads * head_dim
        per_token = c // 2 + 3 * 2 + c // oaken.SEGMENT
        return 2 * num_layers * (block_size * per_token + cls.sparse_budget(num_kv_heads, head_dim, block_size,
                                                                              sparse_fraction))

    def _rope_tables(self, positions: int) -> None:
        """Grow the cos / sin tables of the key centers to cover `positions` (doubling)."""
        if len(self._cos) < positions:
            # at least a block: the kernels' offset tables are the first block_size rows
            angle = np.outer(np.arange(max(positions, 2 * len(self._cos), self.block_size), dtype=np.float64),
                             self._rope_freq)
            self._cos, self._sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
            self._offset_table = np.ascontiguousarray(np.hstack([self._cos[:self.block_size], self._sin[:self.block_size]]))
            pairs = self._offset_table.T.reshape(self.head_dim // 2, 2, self.block_size).transpose(0, 2, 1)
            self._offset_pairs = np.rint(pairs * oaken.CODE_MAX).astype(np.int16).reshape(self.head_dim // 2, -1)
            starts = angle[::self.block_size]
            self._block_cos, self._block_sin = np.cos(starts).astype(np.float32), np.sin(starts).astype(np.float32)

    def _centers(self, layer: int, positions: np.ndarray) -> np.ndarray:
        """[T] written positions (or [T, Hkv]: each kv-head's) -> the key centers at them in store space,
        R(p) key_bias / key_scales: [T, Hkv, D]."""
        if positions.ndim == 1:
            return turn(self.key_bias[layer][None], self._cos[positions], self._sin[positions]) / self.key_scales[layer]
        cos, sin = (np.tile(t[positions], 2) for t in (self._cos, self._sin))  # [T, Hkv, D]
        b = self.key_bias[layer][None]
        return ((b * cos + rotate_half(b) * sin) / self.key_scales[layer]).astype(np.float32)

    def _row_positions(self, layer: int, block_table, seq_len: int) -> np.ndarray:
        """The positions of a sequence's first seq_len rows: row_pos's [seq_len, Hkv], or the rows' own numbers
        [seq_len]."""
        rows = np.arange(seq_len)
        if not self.row_pos.size:
            return rows
        blocks = np.asarray(block_table, np.int64)[rows // self.block_size]
        return self.row_pos[layer, blocks, :, rows % self.block_size]

    def _key_center(self, layer: int) -> oaken.KeyCenter:
        """The kernels' key centers (oaken.add_key_center): cos and sin at the block starts and at the
        offsets in a block (the full tables' first block_size rows)."""
        bs = self.block_size
        return oaken.KeyCenter(self.key_center[layer], self._block_cos, self._block_sin, self._cos[:bs], self._sin[:bs])

    def _rotate(self, x: np.ndarray, matrix: np.ndarray | None = None) -> np.ndarray:
        """[..., Hkv * D] or [..., D] rows -> each head's D values times the rotation, or `matrix`
        (none: as they are). A Numba loop, not a BLAS matmul: OpenBLAS's threads spin on for a while
        after one, on the cores the next kernel needs (exact attention at head_dim 128 took 2.4x as
        long on 2 cores)."""
        matrix = self.rotation if matrix is None else matrix
        if not matrix.size:
            return x
        rows = np.array(x, np.float32).reshape(-1, self.head_dim)
        oaken.turn_heads(rows, matrix)
        return rows.reshape(x.shape)

    def _unrotate(self, x: np.ndarray) -> np.ndarray:
        return self._rotate(x, self._unrotation)

    def _parts(self, layer: int, kv: int) -> tuple[np.ndarray, ...]:
        """One layer's K (kv 0) or V (kv 1) as the kernels take it: oaken.OakenParts as a plain tuple."""
        return self._layer_parts[layer][kv]

    def _quantize(self, layer: int, slot_mapping: np.ndarray, rows: tuple[np.ndarray, np.ndarray]) -> None:
        if len(slot_mapping) == 0:
            return
        runs = _block_runs(slot_mapping, self.block_size)
        for kv, x in enumerate(rows):
            bad = oaken.write_tokens(x, slot_mapping, runs, self._parts(layer, kv), self._scratch)
            if bad:
                raise _not_finite('KV'[kv], layer, bad)

    def write(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray,
              positions: np.ndarray | None = None, provisional: np.ndarray | None = None) -> None:
        """slot_mapping: [T] int64 (a sequence's rows in position order); k, v: [T, Hkv, D] float32;
        positions: [T] of the rows in their sequences (needed when keys are centered or rows keep positions; with
        row_pos, [T, Hkv]: each kv-head's); provisional: [T] bool, rows a later write may replace (held, see the
        class)."""
        if len(slot_mapping) == 0:
            return
        if self.tail.shape[2]:
            self._release_held(layer, slot_mapping)
        if self.key_bias is not None or self.row_pos.size:
            if positions is None:
                raise ValueError("this store centers keys or keeps rows' positions: write needs the positions")
            positions = np.asarray(positions, np.int64)
            self._rope_tables(int(positions.max()) + 1)
        if self.row_pos.size:
            self.row_pos[layer, slot_mapping // self.block_size, :, slot_mapping % self.block_size] = \
                positions if positions.ndim == 2 else positions[:, None]
        rows = tuple(np.ascontiguousarray(x, np.float32).reshape(len(slot_mapping), -1) for x in (k, v))
        fast = self.tail.shape[2] and (positions is None or positions.ndim == 1) and (
            provisional is None or not provisional.any())
        if fast and self._write_decode_rows(layer, slot_mapping, rows, positions):
            return
        for kv, x in enumerate(rows):
            if not np.isfinite(x).all():
                raise _not_finite('KV'[kv], layer, int((~np.isfinite(x).all(axis=1)).sum()))
        keys = rows[0] / self.key_scales[layer].ravel()
        if self.key_bias is not None:
            keys -= self._centers(layer, positions).reshape(len(keys), -1)
        rows = (keys, rows[1] / self.value_scales[layer].ravel())
        if self.rotation.size:
            for x in rows:
                oaken.turn_heads(x, self.rotation)
        direct = self._route_to_tails(layer, slot_mapping, rows, provisional) if self.tail.shape[2] else slice(None)
        self._quantize(layer, slot_mapping[direct], (rows[0][direct], rows[1][direct]))

    def _write_decode_rows(self, layer: int, slot_mapping: np.ndarray, rows: tuple[np.ndarray, np.ndarray],
                           positions: np.ndarray | None) -> bool:
        """A decode step's rows (k, v [T, C], each in a block of its own) in one kernel call (oaken.write_decode_rows:
        the per-channel transforms, the rotation, the tails and the blocks they fill, as the NumPy path). False,
        with nothing written, when two rows share a block."""
        c = self.num_kv_heads * self.head_dim
        centered = self.key_bias is not None
        transform = oaken.RowTransform(
            self.key_scales[layer].reshape(1, c), self.value_scales[layer].reshape(1, c),
            self.key_bias[layer].reshape(1, c) if centered else np.zeros((0, c), np.float32), self.rotation,
            self._cos, self._sin)
        result, writes = oaken.write_decode_rows(
            *rows, positions if centered else np.zeros(len(slot_mapping), np.int64), np.asarray(slot_mapping, np.int64),
            self.block_size, tuple(transform), self._tail_slots[layer], self._writes, self._parts(layer, 0),
            self._parts(layer, 1), self._scratch)
        if result > 0:
            raise _not_finite("K or V", layer, result)
        if result < 0:
            return False
        self._writes = writes
        return True

    def _release_held(self, layer: int, slot_mapping: np.ndarray) -> None:
        """Before a write: reopen the layer's held tails of blocks this write goes on into; let the others go."""
        held = np.flatnonzero(self.held[layer])
        if len(held):
            self.held[layer, held] = False
            blocks = self.tail_block[layer, held]
            reopened = np.isin(blocks, slot_mapping // self.block_size)
            self.tail_of[layer, blocks[reopened]] = held[reopened]
            self.tail_block[layer, held[~reopened]] = -1

    def _tail_passes(self, layer: int, block_tables: np.ndarray,
                     seq_lens: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """Rows [B] (the last of each of seq_lens' contexts) grouped by how they read the layer's held tails:
        [(rows, the held slot they read their block from, or -1)]. A row inside a held block, before the row that
        filled it, reads the block's tail; the others read it quantized."""
        rows = np.arange(len(seq_lens))
        held = np.flatnonzero(self.held[layer])
        if not len(held):
            return [(rows, -1)]
        pos = np.asarray(seq_lens, np.int64) - 1
        own = block_tables[rows, pos // self.block_size]
        slot_of = dict(zip(self.tail_block[layer, held].tolist(), held.tolist()))
        inside = np.isin(own, list(slot_of)) & (pos % self.block_size != self.block_size - 1)
        return [(rows[~inside], -1)] + [(rows[inside & (own == b)], slot_of[b])
                                        for b in np.unique(own[inside]).tolist()]

    def _in_passes(self, layer: int, block_tables: np.ndarray, seq_lens: np.ndarray, attend, outputs: tuple) -> None:
        """attend(rows) -> outputs of those rows, run once per _tail_passes group with its held tail in view, into
        `outputs` (arrays [B, ...])."""
        for rows, slot in self._tail_passes(layer, block_tables, seq_lens):
            if not len(rows):
                continue
            block = self.tail_block[layer, slot] if slot >= 0 else -1
            if slot >= 0:
                self.tail_of[layer, block] = slot
            try:
                for into, got in zip(outputs, attend(rows)):
                    into[rows] = got
            finally:
                if slot >= 0:
                    self.tail_of[layer, block] = -1

    def _route_to_tails(self, layer: int, slot_mapping: np.ndarray, rows: tuple[np.ndarray, np.ndarray],
                        provisional: np.ndarray | None = None) -> np.ndarray:
        """Put the rows of still-filling blocks into their tails (quantizing a tail once its block is
        full, or holding it when its last row is provisional); returns the mask of the other rows, to
        quantize now."""
        bs, runs = self.block_size, _block_runs(slot_mapping, self.block_size)
        direct = np.ones(len(slot_mapping), bool)
        # a decode step's rows at once: one-row runs that go on filling a tail and leave it unfilled
        first_rows = runs[:-1][np.diff(runs) == 1]
        slots = self.tail_of[layer, slot_mapping[first_rows] // bs]
        offsets = slot_mapping[first_rows] % bs
        fast = (slots >= 0) & (offsets < bs - 1)
        rows_now, slots, offsets = first_rows[fast], slots[fast], offsets[fast]
        for kv in (0, 1):
            self.tail[layer, kv, slots, offsets] = rows[kv][rows_now]
        self.tail_len[layer, slots] = offsets + 1
        self.tail_stamp[layer, slots] = self._writes + 1 + np.arange(len(slots))
        self._writes += len(slots)
        direct[rows_now] = False
        for r in np.flatnonzero(direct[runs[:-1]]):  # the other runs, one by one
            a, b = runs[r], runs[r + 1]
            block, first, last = slot_mapping[a] // bs, slot_mapping[a] % bs, slot_mapping[b - 1] % bs
            hold = provisional is not None and bool(provisional[b - 1])
            slot = self.tail_of[layer, block]
            if slot < 0:
                if first != 0 or last == bs - 1 and not hold:  # a whole block at once, or one already quantized in part
                    continue
                slot = self._take_tail(layer, block)
            for kv in (0, 1):
                self.tail[layer, kv, slot, first:last + 1] = rows[kv][a:b]
            self._writes += 1
            self.tail_len[layer, slot], self.tail_stamp[layer, slot] = last + 1, self._writes
            direct[a:b] = False
            if last == bs - 1:
                self._flush_tail(layer, slot, hold)
        return direct

    def _take_tail(self, layer: int, block: int) -> int:
        free = np.flatnonzero(self.tail_block[layer] < 0)
        slot = int(free[0]) if len(free) else int(np.argmin(self.tail_stamp[layer]))
        if not len(free):
            self._flush_tail(layer, slot)
        self.tail_block[layer, slot], self.tail_of[layer, block] = block, slot
        return slot

    def _flush_tail(self, layer: int, slot: int, hold: bool = False) -> None:
        """Quantize a tail's rows into its block; the slot goes free, or with `hold` is held (see the class).
        A held slot is already quantized: it only goes free."""
        block, n = self.tail_block[layer, slot], self.tail_len[layer, slot]
        self.tail_of[layer, block] = -1
        if not self.held[layer, slot]:
            self._quantize(layer, block * self.block_size + np.arange(n), (self.tail[layer, 0, slot, :n],
                                                                           self.tail[layer, 1, slot, :n]))
        self.tail_block[layer, slot], self.held[layer, slot] = (block, True) if hold else (-1, False)

    def gather(self, layer: int, block_table, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's first `seq_len` positions, dequantized -> k, v: [seq_len, Hkv, D] float32."""
        blocks = np.asarray(block_table[: -(-seq_len // self.block_size)], dtype=np.int64)
        shape = (len(blocks), self.num_kv_heads, self.block_size, self.head_dim)
        out = []
        for kv in (0, 1):
            x = np.empty(shape, np.float32)
            oaken.dequantize_blocks(self._parts(layer, kv), blocks, seq_len, x)
            x = self._unrotate(x.transpose(0, 2, 1, 3).reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len])
            if kv == 0 and self.key_bias is not None:
                x = x + self._centers(layer, self._row_positions(layer, block_table, seq_len))
            out.append(x * (self.key_scales if kv == 0 else self.value_scales)[layer])
        return out[0], out[1]

    def compact(self, layer: int, block_table, held: int, keep: np.ndarray) -> None:
        """Keep keep.shape[1] of a sequence's first `held` rows, compacted to the front: row i becomes its old row
        keep[:, i] (keep [Hkv, K] ascending, the same rows for every kv-head: whole tokens, see rows_per_head;
        layered KV sparsity, cpu_attn/layered_worker.py). Rows move as their codes, with their positions (row_pos,
        so keys stay centered where they belong): a quantized row is not quantized again (oaken.move_tokens says
        when it is). Rows past K are left for the sequence's next writes to replace; the tails of blocks past them
        go free. Needs row_positions where keys are centered."""
        kept, bs = keep.shape[1], self.block_size
        rows = keep[0]
        assert (keep == rows).all(), "an Oaken store keeps whole tokens"
        blocks = np.asarray(block_table, np.int64)
        moved = np.flatnonzero(rows != np.arange(kept))
        if len(moved):
            assert self.row_pos.size or self.key_bias is None, "a store that centers keys compacts with row_positions"
            self._release_held(layer, blocks[:0])  # held tails' rows move: let them go
            new = np.arange(moved[0], kept)
            src = blocks[rows[new] // bs] * bs + rows[new] % bs
            dst = blocks[new // bs] * bs + new % bs
            if self.row_pos.size:
                self.row_pos[layer, dst // bs, :, dst % bs] = self.row_pos[layer, src // bs, :, src % bs]
            runs = _block_runs(dst, bs)
            for kv in (0, 1):
                oaken.move_tokens(self._parts(layer, kv), src, dst, runs, self._scratch)
        for b in blocks[-(-kept // bs):-(-held // bs)]:
            slot = self.tail_of[layer, b]
            if slot >= 0:
                self.tail_of[layer, b], self.tail_block[layer, slot] = -1, -1
        if kept % bs and self.tail_of[layer, blocks[kept // bs]] >= 0:
            self.tail_len[layer, self.tail_of[layer, blocks[kept // bs]]] = kept % bs

    def decode_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                         scale: float, splits: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """q: [B, Hq, D] float32 -> out [B, Hq, D], lse [B, Hq] (float32). splits: into how many parts each
        context is cut (default: kernels.split_parts of this batch; the parts' sums are joined in that order)."""
        return self._decode(layer, q, block_tables, seq_lens, scale, splits)

    def scored_decode_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                                scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """decode_attention that also returns every row's logit: raw [B, Hq, max(seq_lens)] float32, row t of
        sequence b scale * q[b, h] . k_t (t < seq_lens[b]), from the kernel's own scores."""
        return self._decode(layer, q, block_tables, seq_lens, scale, None, int(seq_lens.max()))

    def _decode(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray, scale: float,
                splits: int | None, raw_width: int = 0) -> tuple[np.ndarray, ...]:
        """decode_attention, with raw_width also the rows' logits (_decode_rows)."""
        # the kernel's tasks are parts of sequences (all kv-heads of a block in turn): split as many
        if splits is None:
            splits = split_parts(len(q), seq_lens, self.block_size)
        if not self.held[layer].any():
            return self._decode_rows(layer, q, block_tables, seq_lens, scale, splits, raw_width)
        outputs = (np.empty(q.shape, np.float32), np.empty(q.shape[:2], np.float32),
                   *((np.empty((*q.shape[:2], raw_width), np.float32),) if raw_width else ()))
        self._in_passes(layer, block_tables, seq_lens, lambda rows: self._decode_rows(
            layer, q[rows], block_tables[rows], seq_lens[rows], scale, splits, raw_width), outputs)
        return outputs

    def _decode_rows(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray, scale: float,
                     splits: int, raw_width: int = 0) -> tuple[np.ndarray, ...]:
        """raw_width: with it, also the rows' logits [B, Hq, raw_width] (scored_decode_attention)."""
        num_seqs, num_heads, head_dim = q.shape
        group, work = num_heads // self.num_kv_heads, num_seqs * self.num_kv_heads
        out = np.empty((num_seqs, num_heads, head_dim), dtype=np.float32)
        lse = np.empty((num_seqs, num_heads), dtype=np.float32)
        raw = np.zeros((num_seqs, num_heads, raw_width) if raw_width else (0, 0, 0), np.float32)
        scratch = attention_scratch(work, group, self.block_size, head_dim, splits)
        int_dots = self.int_dots and num_heads <= oaken.MAX_HEADS  # else no int16 scratch, empty query codes
        # the queries in store space, turned, their center terms and int16 codes, in one call
        centered = self.key_bias is not None
        # records go to the kernels as plain tuples: Numba types a NamedTuple by its names at every call
        queries = tuple(oaken.DecodeQueries(np.empty(q.shape, np.float32),
                                            np.empty(q.shape if centered else (0, 0, 0), np.float32),
                                            np.empty(q.shape if int_dots else (0, 0, 0), np.int16),
                                            np.empty(q.shape[:2] if int_dots else (0, 0), np.float32)))
        oaken.decode_queries(np.ascontiguousarray(q, np.float32), self.key_scales[layer], self.rotation,
                             self.key_center[layer], queries)
        center = tuple(oaken.ScoreCenter(self._block_cos, self._block_sin, self._offset_table, self._offset_pairs,
                                         self.row_pos[layer] if self.row_pos.size else np.zeros((0, 0, 0), np.int32),
                                         self._cos, self._sin))
        oaken.oaken_decode_attention(queries, self._parts(layer, 0), self._parts(layer, 1), center, block_tables,
                                     seq_lens, np.float32(scale), out, lse, raw,
                                     tuple(oaken.oaken_scratch(scratch, int_dots)))
        oaken.decode_outputs(out, self._unrotation, self.value_scales[layer])
        return (out, lse, raw) if raw_width else (out, lse)

    def verify_attention(self, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                         row_first: np.ndarray, row_count: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Consecutive positions per sequence, as kv_store.PagedKVStore.verify_attention takes them: each row is
        attended as the decode row of its own position (decode_attention over the rows, K and V read once a row),
        its context cut into the parts a decode step of these sequences at that row's offset would cut it into
        (kernels.split_parts), so that a row's sums are the decode's, to the last bit."""
        seq = np.repeat(np.arange(len(seq_lens)), row_count)
        offset = np.arange(len(seq)) - row_first[seq]
        lens = (seq_lens[seq] + offset).astype(np.int32)
        tables = np.ascontiguousarray(block_tables[seq])
        splits = np.array([split_parts(len(seq_lens), seq_lens + i, self.block_size) for i in range(row_count.max())])
        if (splits == splits[0]).all():
            return self.decode_attention(layer, q, tables, lens, scale, int(splits[0]))
        out, lse = np.empty(q.shape, np.float32), np.empty(q.shape[:2], np.float32)
        for parts in np.unique(splits):
            rows = np.flatnonzero(splits[offset] == parts)
            out[rows], lse[rows] = self.decode_attention(layer, q[rows], tables[rows], lens[rows], scale, int(parts))
        return out, lse

    def _store_queries(self, layer: int, q: np.ndarray) -> np.ndarray:
        """q [B, Hq, D] -> q * key_scales, so that q'.k' = q.k for keys in store space (k / key_scales)."""
        b, num_heads, head_dim = q.shape
        grouped = np.asarray(q, np.float32).reshape(b, self.num_kv_heads, -1, head_dim)
        return np.ascontiguousarray((grouped * self.key_scales[layer][:, None]).reshape(q.shape))

    def sampled_decode_attention(self, layer: int, q: np.ndarray, q_codes: np.ndarray, block_tables: np.ndarray,
                                 seq_lens: np.ndarray, scale: float, tables: tuple[np.ndarray, ...], mu: np.ndarray,
                                 log_u: np.ndarray, num_sinks: int, window: int, min_hits: int = 2
                                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """MagicPIG attention (cpu_attn/lsh.py, cpu_attn/sampled.py): q [B, Hq, D], q_codes int32 [B, Hq, L] (each head
        hashed) or [B, Hkv, L] (each GQA group's mean query hashed, cpu_attn.simhash); tables =
        (set_of [B, Hkv, 2] each item's range of sets, indexed [S], offsets [S, L, 2^K + 1],
        ids [S, L, cap], norms [S, cap] each key's |k - mu|, or typed Lists of the per-set arrays);
        mu [B, Hkv, D] the keys' centers; log_u from lsh.log_u_table (same min_hits); window >= 1 (the
        current token is always exact).
        -> out [B, Hq, D], lse [B, Hq], touched [B, Hq] (keys sampled per query head)."""
        if window < 1:
            raise ValueError("the exact local window must hold at least the current token")
        if not self.held[layer].any():
            return self._sampled_rows(layer, q, q_codes, block_tables, seq_lens, scale, tables, mu, log_u, num_sinks,
                                      window, min_hits)
        outputs = sampled.SampledOutputs(np.empty(q.shape, np.float32), np.empty(q.shape[:2], np.float32),
                                         np.empty(q.shape[:2], np.int64))
        self._in_passes(layer, block_tables, seq_lens, lambda rows: self._sampled_rows(
            layer, q[rows], q_codes[rows], block_tables[rows], seq_lens[rows], scale, (tables[0][rows], *tables[1:]),
            mu[rows], log_u, num_sinks, window, min_hits), outputs)
        return outputs

    def _sampled_rows(self, layer: int, q: np.ndarray, q_codes: np.ndarray, block_tables: np.ndarray,
                      seq_lens: np.ndarray, scale: float, tables: tuple, mu: np.ndarray, log_u: np.ndarray,
                      num_sinks: int, window: int, min_hits: int) -> sampled.SampledOutputs:
        num_seqs, num_heads, head_dim = q.shape
        group = num_heads // self.num_kv_heads
        set_of, indexed, offsets, ids, norms = tables
        ends = np.concatenate([[0], np.cumsum(indexed, dtype=np.int64)])
        capacity = max(int((ends[set_of[..., 1]] - ends[set_of[..., 0]]).max(initial=0)), 1)  # keys of one item
        key_scale = self.key_scales[layer]
        q_store = self._store_queries(layer, q)
        if q_codes.shape[1] == num_heads:
            r, r_store = q, q_store
        else:  # the hashed queries are the groups' means
            r = np.asarray(q, np.float32).reshape(num_seqs, self.num_kv_heads, group, head_dim).mean(2)
            r_store = np.ascontiguousarray(r * key_scale)
        per_kv_head = r_store.reshape(num_seqs, self.num_kv_heads, -1, head_dim)
        r_mu = np.einsum("bhrd,bhd->bhr", per_kv_head, mu / key_scale).reshape(num_seqs, -1).astype(np.float32)
        q_turned = self._rotate(q_store)
        r_turned = q_turned if r_store is q_store else self._rotate(r_store)
        queries = sampled.SampledQueries(q_store, q_turned, r_store, r_turned,
                                         np.linalg.norm(r, axis=-1).astype(np.float32), r_mu,
                                         np.ascontiguousarray(q_codes, np.int32))
        outputs = sampled.SampledOutputs(np.empty(q.shape, np.float32), np.empty((num_seqs, num_heads), np.float32),
                                         np.empty((num_seqs, num_heads), np.int64))
        sampling = sampled.Sampling(log_u, num_sinks, window, min_hits)
        sampled.sampled_decode_attention(  # records as plain tuples (see decode_attention)
            tuple(queries), self._parts(layer, 0), self._parts(layer, 1), tuple(self._key_center(layer)), block_tables,
            seq_lens, np.float32(scale), tuple(tables), tuple(sampling), tuple(outputs),
            self._sampled_scratch(num_seqs * self.num_kv_heads, group, capacity))
        oaken.decode_outputs(outputs.out, self._unrotation, self.value_scales[layer])
        return outputs

    def _sampled_scratch(self, work: int, group: int, capacity: int) -> tuple[np.ndarray, ...]:
        """sampled.sampled_scratch for `work` items, kept between calls (the kernel leaves its count and marks
        zeroed, as it needs them) and grown by a quarter past what a call needs. Fresh arrays on every
        call cost ~0.25 ms a sampled layer at 16 x 8k, and ~10 ms after the server's malloc_trim gave
        their pages back (one layer's captured arguments, replayed)."""
        have = self._sampled.get(threading.get_ident())
        items, cap = (0, 0) if have is None or have.s.shape[1] != group else (have.s.shape[0], have.count.shape[1])
        if items < work or cap < capacity:
            have = sampled.sampled_scratch(max(items, work), group, self.block_size, self.head_dim,
                                       max(cap, capacity + capacity // 4))
            self._sampled[threading.get_ident()] = have
        return tuple(a[:work] for a in have)  # a plain tuple, as the kernel takes it

    def group_counts(self, block_table, seq_len: int) -> dict[str, int]:
        """What one sequence's stored values are, over every layer, K and V: counts of values,
        sparse entries and outer entries (inner = sparse - outer), to report realized fractions."""
        blocks = np.asarray(block_table[: -(-seq_len // self.block_size)], dtype=np.int64)
        values = entries = outer = 0
        for j, b in enumerate(blocks):
            width = min(self.block_size, seq_len - j * self.block_size)
            quantized = self.tail_of[:, b] < 0  # [L]: blocks still in a full-precision tail do not count
            n = self.counts[:, :, b, :width].sum(axis=(-1, -2)).astype(np.int64) * quantized[:, None]  # [L, 2]
            entries += int(n.sum())
            for layer in range(self.num_layers):
                for kv in (0, 1):
                    outer += int(np.count_nonzero(self.sparse[layer, kv, b, : n[layer, kv]] & 64))
            values += 2 * int(quantized.sum()) * width * self.num_kv_heads * self.head_dim
        return {"values": values, "sparse": entries, "outer": outer}
