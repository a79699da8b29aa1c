"""OCP Microscaling (MX v1.0) weights: blocks of 32 values along the input dimension sharing one
E8M0 scale, elements FP8 E4M3 (mxfp8), FP6 E2M3 (mxfp6; E3M2 as mxfp6_e3m2), FP4 E2M1 (mxfp4) or
INT8 (mxint8).

Encoding a block (the spec's conversion): shared exponent = floor(log2(amax)) - emax_elem, clamped
to E8M0's [-127, 127]; each value / 2^shared rounded to the element format, to nearest with ties to
even, saturating at the largest normal (INT8: two's complement with an implicit 2^-6, +-127). A
block of zeros gets scale 2^-127; a block holding NaN or +-inf gets the NaN scale (255), which
decodes every value of the block to NaN. E4M3's own NaN codes (S.1111.111) decode to NaN and are
never produced. A value is element x 2^(scale - 127), one float32 product.

Packed layout of a weight [N, K] (K padded with zeros to a multiple of 32; c_j = element j's code):

    scales [N, K/32]      uint8, E8M0 (bias 127, 255 = NaN)
    codes  [N, K/32, B]   uint8, per block of 32:
      mxfp8, mxint8  B = 32   byte j = c_j
      mxfp6          B = 24   bytes 0..15:  c_j & 15 | (c_{j+16} & 15) << 4        (j < 16)
                              bytes 16..23: one little-endian uint64 Q holding c_i >> 4 (two bits)
                              at bit FP6_HIGH_BITS[i] = 32 (l & 1) + 16 h + 2 (l >> 1), i = 16 h + l
                              (four 6-bit values in three bytes, as two planes: the low nibbles, and
                              the high bit pairs placed so that a kernel that broadcasts Q to sixteen
                              32-bit lanes finds lane l's pair in its own lane: fixed rotations)
      mxfp4          B = 16   byte j = c_j | c_{j+16} << 4                          (j < 16)

Bits per weight: 8 x B / 32 + 8 / 32 = 8.25, 6.25, 4.25, 8.25.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
SCALE_NAN = 255
FP6_HIGH_BITS = np.array([32 * (i % 16 & 1) + 16 * (i // 16) + 2 * (i % 16 >> 1) for i in range(BLOCK)], np.uint64)
"""Where element i's top two code bits sit in an FP6 block's uint64 (module docstring)."""


@dataclass(frozen=True)
class ElementFormat:
    """One MX element type: sign, `ebits` exponent bits (bias `bias`), `mbits` mantissa bits; or
    INT8 (ebits 0)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int
    """Exponent of the largest normal (the spec's emax_elem)."""
    max_normal: float
    block_bytes: int
    """Bytes a block of 32 codes packs into."""

    @property
    def code_bits(self) -> int:
        return 1 + self.ebits + self.mbits if self.ebits else 8

    @property
    def bits_per_weight(self) -> float:
        return (8 * self.block_bytes + 8) / BLOCK


FORMATS = {
    "mxfp8": ElementFormat("mxfp8", 4, 3, 7, 8, 448.0, 32),
    "mxfp6": ElementFormat("mxfp6", 2, 3, 1, 2, 7.5, 24),
    "mxfp6_e3m2": ElementFormat("mxfp6_e3m2", 3, 2, 3, 4, 28.0, 24),
    "mxfp4": ElementFormat("mxfp4", 2, 1, 1, 2, 6.0, 16),
    "mxint8": ElementFormat("mxint8", 0, 6, 0, 0, 127 / 64, 32),
}
"""MX formats by name; mxint8's `mbits` is its fraction bits (implicit scale 2^-6)."""


def get_format(name: str) -> ElementFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown MX format {name!r} (known: {', '.join(FORMATS)})") from None


def element_values(fmt: ElementFormat) -> np.ndarray:
    """[2^code_bits] float64: the value of every element code (NaN for E4M3's NaN codes)."""
    codes = np.arange(1 << fmt.code_bits)
    if not fmt.ebits:
        return codes.astype(np.int8).astype(np.float64) / 64
    mag_bits = fmt.ebits + fmt.mbits
    e, m = (codes >> fmt.mbits) & ((1 << fmt.ebits) - 1), codes & ((1 << fmt.mbits) - 1)
    frac = np.where(e == 0, m / 2**fmt.mbits, 1 + m / 2**fmt.mbits)
    values = np.ldexp(frac, np.maximum(e, 1) - fmt.bias) * np.where(codes >> mag_bits, -1.0, 1.0)
    if fmt.name == "mxfp8":
        values[(codes & 0x7F) == 0x7F] = np.nan
    return values


def scale_values(scales: np.ndarray) -> np.ndarray:
    """E8M0 codes -> float32 2^(code - 127) (exact, 2^-127 being a float32 subnormal); 255 -> NaN."""
    s = scales.astype(np.int64)
    return np.where(s == SCALE_NAN, np.nan, np.ldexp(1.0, s - 127)).astype(np.float32)


def _exponent(a: np.ndarray) -> np.ndarray:
    """floor(log2(a)) of positive finite float64 values, exactly (frexp, not log2)."""
    return np.frexp(a)[1] - 1


def shared_exponents(blocks: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """blocks: [..., 32] float64 -> E8M0 scale codes [...] uint8."""
    amax = np.abs(blocks).max(axis=-1)
    is_bad = ~np.isfinite(amax)
    safe = np.where(is_bad | (amax == 0), 1.0, amax)
    shared = np.where(amax == 0, -127, np.clip(_exponent(safe) - fmt.emax, -127, 127))
    return np.where(is_bad, SCALE_NAN, shared + 127).astype(np.uint8)


def quantize_elements(v: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """v: float64 values already divided by the block scale -> element codes (uint8): round to
    nearest, ties to even, saturating at the largest normal."""
    if not fmt.ebits:
        return np.clip(np.round(v * 64), -127, 127).astype(np.int8).view(np.uint8)
    a = np.abs(v)
    emin = 1 - fmt.bias
    exp = np.maximum(_exponent(np.where(a > 0, a, 1.0)), emin)
    quantum = np.ldexp(1.0, exp - fmt.mbits)
    r = np.minimum(np.round(a / quantum) * quantum, fmt.max_normal)  # np.round: half to even
    is_sub = r < 2.0**emin
    e = np.where(is_sub, 0, _exponent(np.where(is_sub, 1.0, r)) + fmt.bias)
    m = np.where(is_sub, r / 2.0 ** (emin - fmt.mbits), r / np.ldexp(1.0, e - fmt.bias - fmt.mbits) - 2**fmt.mbits)
    sign = np.signbit(v).astype(np.int64) << (fmt.ebits + fmt.mbits)
    return (sign | (e << fmt.mbits) | m.astype(np.int64)).astype(np.uint8)


def pack(codes: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """codes: [..., 32] uint8, one per element -> [..., block_bytes] (module docstring)."""
    c = codes.astype(np.uint8)
    if fmt.block_bytes == 32:
        return np.ascontiguousarray(c)
    low = (c[..., :16] & 15) | ((c[..., 16:] & 15) << 4)
    if fmt.code_bits == 4:
        return np.ascontiguousarray(low)
    pairs = ((c >> 4) & 3).astype(np.uint64) << FP6_HIGH_BITS
    high = np.bitwise_or.reduce(pairs, axis=-1).astype("<u8")
    return np.ascontiguousarray(np.concatenate([low, high[..., None].view(np.uint8)], axis=-1))


def unpack(packed: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """[..., block_bytes] -> codes [..., 32] uint8 (the inverse of pack)."""
    if fmt.block_bytes == 32:
        return packed.view(np.uint8)
    low = np.concatenate([packed[..., :16] & 15, packed[..., :16] >> 4], axis=-1)
    if fmt.code_bits == 4:
        return low
    words = np.ascontiguousarray(packed[..., 16:24]).view("<u8")  # [..., 1]
    high = ((words >> FP6_HIGH_BITS) & np.uint64(3)).astype(np.uint8)
    return low | (high << 4)


def encode(w: np.ndarray, fmt: ElementFormat) -> tuple[np.ndarray, np.ndarray]:
    """w: [N, K] float32 -> codes [N, ceil(K/32), block_bytes] uint8, scales [N, ceil(K/32)] uint8."""
    n, k = w.shape
    padded = np.zeros((n, -(-k // BLOCK) * BLOCK), np.float64)
    padded[:, :k] = w
    blocks = padded.reshape(n, -1, BLOCK)
    scales = shared_exponents(blocks, fmt)
    shared = np.where(scales == SCALE_NAN, 0, scales.astype(np.int64) - 127)
    with np.errstate(invalid="ignore"):
        v = np.ldexp(blocks, -shared[..., None])
        v = np.where(scales[..., None] == SCALE_NAN, 0.0, v)
    return pack(quantize_elements(v, fmt), fmt), scales


def decode(codes: np.ndarray, scales: np.ndarray, fmt: ElementFormat, k: int | None = None) -> np.ndarray:
    """codes, scales as encode returns -> [N, k] float32 (k: the unpadded input size)."""
    table = element_values(fmt).astype(np.float32)
    with np.errstate(over="ignore"):  # a huge scale times a large element is +-inf, as in float32
        w = table[unpack(codes, fmt)] * scale_values(scales)[..., None]
    w = w.reshape(w.shape[0], -1)
    return w if k is None else np.ascontiguousarray(w[:, :k])
