"""The named records the Oaken kernels take instead of long lists of arrays: each NamedTuple
names one group of arrays (a layer's K, the queries, the scratch) in order, and Python code
builds and reads them by name. Shapes: C = Hkv * D, bs = block_size, U = units of work.

A kernel call passes a record as a plain tuple (`tuple(record)`): Numba's dispatcher types a
NamedTuple argument by its class and field names at every call (~0.25 us a field, ~9 us for the
exact decode kernel's records), a plain tuple by a fast fingerprint. Records are flat (arrays and
numbers): Numba passes a tuple into a prange loop one level deep. In a kernel, a record that is
only read is unpacked into named locals; an array a parallel kernel writes is taken by index,
one statement each (`kb = scratch[1]`), before the loop: the parfor passes track aliases through
indexing an argument, not through tuple unpacking or a tuple built in the kernel, and drop a
loop or slice assignment whose array they do not know for an argument's (numba/numba#5872)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class OakenParts(NamedTuple):
    """One layer's K (or V) in the store (codec.py draws a row's layout), as every kernel reads it."""
    dense: np.ndarray  # [num_blocks, bs, C / 2] uint8: two 4-bit codes a byte
    scales: np.ndarray  # [num_blocks, bs, 3] uint16: float16 bits of the middle, inner and outer steps
    counts: np.ndarray  # [num_blocks, bs, C / 64] uint8: sparse entries of each 64-value segment
    sparse: np.ndarray  # [num_blocks, budget] uint8: the block's rows' entries one after another
    tail: np.ndarray  # [slots, bs, C] float32: blocks still filling, in full precision
    tail_of: np.ndarray  # [num_blocks] int32: each block's tail slot, or -1 (quantized)
    thr: np.ndarray  # [4] float32: the thresholds (s_lo, t_lo, t_hi, s_hi) its codes are relative to


class ScoreCenter(NamedTuple):
    """RoPE tables that turn the keys' centers to each position in the score domain (add_center_scores)."""
    block_cos: np.ndarray  # [> blocks of the longest context, D / 2] float32: cos at each block's start
    block_sin: np.ndarray  # the same, sin
    offsets: np.ndarray  # [bs, D] float32: [cos | sin] at the offsets in a block
    offset_pairs: np.ndarray  # [D / 2, 2 * bs] int16: the offsets' codes as vnni_center_scores takes them
    row_pos: np.ndarray  # [num_blocks, Hkv, bs] int32: each row's position ([0, 0, 0]: row t of block j is j * bs + t)
    pos_cos: np.ndarray  # with row_pos: [> every position, D / 2] float32: cos at each position
    pos_sin: np.ndarray  # the same, sin


class KeyCenter(NamedTuple):
    """The keys' centers as add_key_center adds them to decoded rows (empty tables: not centered)."""
    c: np.ndarray  # [Hkv, 2, D] float32: the center and rotate_half of it, in store space
    block_cos: np.ndarray  # [> blocks of the longest context, D / 2] float32: cos at each block's start
    block_sin: np.ndarray  # the same, sin
    offset_cos: np.ndarray  # [bs, D / 2] float32: cos at the offsets in a block
    offset_sin: np.ndarray  # the same, sin


class DecodeQueries(NamedTuple):
    """A decode step's queries as oaken_decode_attention takes them (decode_queries writes them)."""
    turned: np.ndarray  # [B, Hq, D] float32: q * key_scales (store space), turned by the rotation
    center: np.ndarray  # [B, Hq, D] float32: the center terms (center_terms); [0, 0, 0]: keys not centered
    codes: np.ndarray  # [B, Hq, D] int16: turned as int16 codes (query_codes); [0, 0, 0]: every block decoded
    code_scales: np.ndarray  # [B, Hq] float32: the codes' scales; [0, 0] with empty codes


class OakenScratch(NamedTuple):
    """oaken_decode_attention's scratch: AttentionScratch's six arrays, then the center's and the int16
    kernels' (U0 = U with int16 dot products, else 0)."""
    scores: np.ndarray  # [U, group, bs] float32
    kb: np.ndarray  # [U, bs, D] float32: a block's K rows decoded
    vb: np.ndarray  # [U, bs, D] float32: its V rows
    m: np.ndarray  # [U, group] float32: running max
    l: np.ndarray  # [U, group] float32: running sum
    parts: np.ndarray  # [U, group, D] float32: unnormalized outputs
    qcb: np.ndarray  # [U, group, D] float32: center terms turned to a block's start (add_center_scores)
    sc: np.ndarray  # [U, group, bs] float32: the centers' scores
    kacc: np.ndarray  # [U0, group, ROWS, 16] float32: vnni_block_scores's sums
    abq: np.ndarray  # [U0, group, D] int16: center terms as codes (center_codes)
    factor: np.ndarray  # [U0, group] float32: their scale in the score domain (center_scales)
    inv: np.ndarray  # [U0, group] float32: their inverse step


class TokenScratch(NamedTuple):
    """write_tokens's scratch, a row for each thread id of Numba's pool."""
    shifted: np.ndarray  # [threads, C] float32: magnitudes from each value's group edge
    group: np.ndarray  # [threads, C] int8: each value's group and sign
    peak: np.ndarray  # [threads, 3] float32: each group's largest magnitude
    scale32: np.ndarray  # [threads, 3] float32: the row's scales before they become float16 bits


class RowTransform(NamedTuple):
    """One layer's per-channel transforms, as write_decode_rows applies them to new rows."""
    key_scales: np.ndarray  # [1, C] float32: keys are divided by them
    value_scales: np.ndarray  # [1, C] float32: values are divided by them
    key_bias: np.ndarray  # [1, C] float32: the keys' pre-RoPE center; [0, C]: keys not centered
    rotation: np.ndarray  # [D, D] float32: each head turned by it; [0, 0]: not rotated
    cos: np.ndarray  # [> the largest position, D / 2] float32: RoPE's cos at each position
    sin: np.ndarray  # the same, sin


class TailSlots(NamedTuple):
    """One layer's full-precision tails of blocks still filling (OakenKVStore's recent_blocks)."""
    tail: np.ndarray  # [2, slots, bs, C] float32: K and V rows in store space
    tail_of: np.ndarray  # [num_blocks] int32: each block's slot, or -1
    tail_len: np.ndarray  # [slots] int64: rows written into each slot
    tail_stamp: np.ndarray  # [slots] int64: when each slot was last written (the oldest is flushed first)
    tail_block: np.ndarray  # [slots] int64: each slot's block, or -1 (free)
