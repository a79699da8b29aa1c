"""A linear layer's weight in an MX format (gpu_model/mx.py) and its matmul on the CPU, with an
optional block Hadamard rotation of the input dimension.

With rotation "hadamard" the weight stored is W H (H: the orthonormal 32 x 32 Sylvester Hadamard
matrix, applied to every block of 32 input columns), and a matmul turns its activations once,
x H, so (x H)(W H)^T = x W^T: the rotation spreads a block's outliers over its 32 values, which
suits MXFP4's power-of-two scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numba
import torch

from gpu_model import mx
from gpu_model.mx_ir import scale_table
from gpu_model.mx_kernels import KIND_FORMATS, MATVEC_MAX_ROWS, TILE, mx_matmul, mx_matvec

ROTATIONS = ("none", "hadamard")
_KINDS = {fmt: kind for kind, fmt in enumerate(KIND_FORMATS)}
_scratch: dict[tuple[int, int], np.ndarray] = {}


def _table(fmt: str) -> np.ndarray:
    """The kernels' table of `fmt` (mx_kernels.decode_row)."""
    if fmt == "mxfp6_e3m2":
        values = mx.element_values(mx.get_format(fmt)).astype(np.float32)
        return np.concatenate([values, mx.scale_values(np.arange(256, dtype=np.uint8))])
    return scale_table(fmt)


_TABLES = {fmt: _table(fmt) for fmt in KIND_FORMATS}


def hadamard(size: int = mx.BLOCK) -> np.ndarray:
    """[size, size] float32 orthonormal Sylvester Hadamard matrix (size a power of two; symmetric)."""
    h = np.ones((1, 1))
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(size)).astype(np.float32)


def rotate(x: np.ndarray) -> np.ndarray:
    """x: [M, K] (K a multiple of 32) -> x H per block of 32 columns, float32."""
    m, k = x.shape
    return (x.reshape(m, k // mx.BLOCK, mx.BLOCK) @ hadamard()).reshape(m, k)


@dataclass(frozen=True)
class MXWeight:
    fmt: str
    """An mx.FORMATS name."""
    codes: np.ndarray
    """[N, K/32, block_bytes] uint8 (mx.py's packed layout)."""
    scales: np.ndarray
    """[N, K/32] uint8 E8M0."""
    in_features: int
    """K, the unpadded input size."""
    rotation: str = "none"
    """none, or hadamard: the codes hold W H (module docstring)."""

    def __post_init__(self) -> None:
        fmt = mx.get_format(self.fmt)
        n, num_blocks = self.scales.shape
        if self.codes.shape != (n, num_blocks, fmt.block_bytes) or self.codes.dtype != np.uint8:
            raise ValueError(f"{self.fmt} codes must be uint8 [{n}, {num_blocks}, {fmt.block_bytes}], "
                             f"not {self.codes.dtype} {list(self.codes.shape)}")
        if self.scales.dtype != np.uint8 or -(-self.in_features // mx.BLOCK) != num_blocks:
            raise ValueError(f"scales must be uint8 [N, ceil({self.in_features} / 32)], not "
                             f"{self.scales.dtype} {list(self.scales.shape)}")
        if self.rotation not in ROTATIONS or (self.rotation != "none" and self.in_features % mx.BLOCK):
            raise ValueError(f"rotation {self.rotation!r} needs one of {ROTATIONS} and K a multiple of 32")

    @classmethod
    def encode(cls, w: np.ndarray, fmt: str, rotation: str = "none") -> MXWeight:
        """w: [N, K] float32 -> its MX copy (W H with rotation hadamard)."""
        w = np.asarray(w, np.float32)
        if rotation == "hadamard":
            if w.shape[1] % mx.BLOCK:
                raise ValueError(f"rotation hadamard needs K a multiple of 32, not {w.shape[1]}")
            w = rotate(w)
        codes, scales = mx.encode(w, mx.get_format(fmt))
        return cls(fmt, codes, scales, w.shape[1], rotation)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    @property
    def bits_per_weight(self) -> float:
        return mx.get_format(self.fmt).bits_per_weight

    def decode(self) -> np.ndarray:
        """[N, K] float32: the values the codes hold (W H when rotated)."""
        return mx.decode(self.codes, self.scales, mx.get_format(self.fmt), self.in_features)

    def dense(self) -> np.ndarray:
        """[N, K] float32: the weight this stands for, W (rotated back when rotated)."""
        w = self.decode()
        return w if self.rotation == "none" else rotate(w)

    @staticmethod
    def concat(parts: list[MXWeight]) -> MXWeight:
        """Stack output rows (fused projections); every part shares format, K and rotation."""
        first = parts[0]
        if any((p.fmt, p.in_features, p.rotation) != (first.fmt, first.in_features, first.rotation) for p in parts):
            raise ValueError("fused MX weights must share format, input size and rotation")
        return MXWeight(first.fmt, np.concatenate([p.codes for p in parts]),
                        np.concatenate([p.scales for p in parts]), first.in_features, first.rotation)

    def matmul_numpy(self, x: np.ndarray) -> np.ndarray:
        """x: [M, K] float32 -> x @ W.T: [M, N] float32, with the Numba kernel (mx_kernels.py)."""
        if self.rotation == "hadamard":
            x = rotate(x)
        width = self.scales.shape[1] * mx.BLOCK
        if x.shape[1] != width:  # the kernels read whole blocks: zeros past K
            x = np.concatenate([x, np.zeros((x.shape[0], width - x.shape[1]), x.dtype)], axis=1)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.scales.shape[0]), np.float32)
        kind, table = _KINDS[self.fmt], _TABLES[self.fmt]
        if x.shape[0] <= MATVEC_MAX_ROWS and self.fmt != "mxfp6_e3m2":
            mx_matvec(x, kind, self.codes, self.scales, table, out)
            return out
        key = (numba.get_num_threads(), width)
        tiles = _scratch.get(key)
        if tiles is None:
            tiles = _scratch[key] = np.zeros((key[0], TILE, width), np.float32)
        mx_matmul(x, kind, self.codes, self.scales, table, out, tiles)
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float32 on the CPU -> x @ W.T: [M, N]."""
        return torch.from_numpy(self.matmul_numpy(x.detach().numpy()))
