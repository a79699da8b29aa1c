"""MX weights kept packed on an accelerator (or any torch device) and multiplied by decoding them to the
activations' dtype for each call, one linear at a time.

A GPU without MX tensor cores (Hopper and older) has no kernel that reads MX codes, so the weights stay in
the packed layout of gpu_model/mx.py (scales [N, K/32] E8M0, codes [N, K/32, B]) in device memory and
each matmul rebuilds its weight, [N, K] in bf16 or float32, with a few elementwise torch operations:

    codes -> element codes c [N, K/32, 32] (the nibbles; mxfp6 also its high bit pairs from the block's
             uint64; mxfp8 / mxint8 the bytes)
    value  = table[c] * 2^(scale - 127)     (a table of 16, 64 or 256 element values; the product of an
                                             element and a power of two is exact in bf16 and float32
                                             while it stays a normal number)

then one dense matmul. Memory holds 4.25-8.25 bits a weight instead of 16, so the format's savings
reach the device (room for KV); a step reads the codes and writes, then reads, one decoded linear at a
time, which costs time beside a bf16 weight's single read. A rotated weight (hadamard) holds W H: the
activations are turned (x H per block of 32) and multiplied with it as stored.
"""
from __future__ import annotations

import torch

from gpu_model import mx
from gpu_model.mx_weight import MXWeight, hadamard


class DeviceMXWeight:
    """An MXWeight's packed codes and scales on `device`; matmul decodes them to x's dtype and multiplies."""

    def __init__(self, w: MXWeight, device: torch.device | str):
        self.fmt, self.in_features, self.rotation = w.fmt, w.in_features, w.rotation
        fmt = mx.get_format(w.fmt)
        self._format = fmt
        self.codes = torch.from_numpy(w.codes).to(device)
        self.scales = torch.from_numpy(w.scales).to(device)
        table = torch.from_numpy(mx.element_values(fmt).astype("float32")).to(device)
        self.tables = {torch.float32: table, torch.bfloat16: table.to(torch.bfloat16)}
        """The element values in each dtype decode() forms products in (exact in bf16: at most 8 significant bits)."""
        self.high_bits = torch.from_numpy(mx.FP6_HIGH_BITS.astype("int64")).to(device) if fmt.block_bytes == 24 else None
        self.hadamard = torch.from_numpy(hadamard()).to(device) if w.rotation == "hadamard" else None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()

    @property
    def bits_per_weight(self) -> float:
        return self._format.bits_per_weight

    def element_codes(self) -> torch.Tensor:
        """[N, K/32, 32] int32: each element's code (mx.unpack on the device)."""
        c = self.codes
        if self._format.block_bytes == 32:
            return c.int()
        low = torch.cat([c[..., :16] & 15, c[..., :16] >> 4], dim=-1).int()
        if self._format.code_bits == 4:
            return low
        words = c[..., 16:24].contiguous().view(torch.int64)  # [N, K/32, 1], little-endian like the layout
        return low | (((words >> self.high_bits) & 3) << 4).int()  # an arithmetic shift: bits 0-1 are kept

    def decode(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: the values the codes hold (W H when rotated), as mx.decode computes them. The
        product is formed in bf16 for bf16 (its exponent range is float32's, and no element has more than
        8 significant bits, so it is exact there too), else in float32."""
        work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        s = self.scales.int()  # E8M0 s -> the float32 2^(s - 127): s in the exponent field, 0 the subnormal 2^-127
        scale = torch.where(s == 0, 1 << 22, s << 23).view(torch.float32)
        scale = torch.where(s == mx.SCALE_NAN, torch.nan, scale).to(work)
        codes = self.element_codes()
        values = torch.index_select(self.tables[work], 0, codes.flatten()).view(codes.shape)
        return (values * scale[..., None]).flatten(1)[:, :self.in_features].to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] on the weight's device -> x @ W.T: [M, N] in x's dtype."""
        if self.hadamard is not None:
            m, k = x.shape
            x = (x.float().view(m, k // mx.BLOCK, mx.BLOCK) @ self.hadamard).view(m, k).to(x.dtype)
        return torch.nn.functional.linear(x, self.decode(x.dtype))
