"""GGUF Q4_1 / Q8_0 weights kept in their blocks, for small-batch (decode) matmuls on the CPU.

A decode step at small batch is bound by reading weights: fp32 costs 4 bytes a weight, these
blocks about 0.75 (Q4_1) or 1.1 (Q8_0). Values are exactly the GGUF's (d * q + m in float32,
which is also what the dequantized fp32 copy holds); only the order of the sums differs from a
BLAS matmul. Large batches (prefill) keep using the dense fp32 copy.

    Q4_1 block (32 weights): d fp16 | m fp16 | 16 bytes, weight j = low nibble of byte j,
                             weight j + 16 = high nibble of byte j; value = d * q + m
    Q8_0 block (32 weights): d fp16 | 32 int8; value = d * q

Stored per weight (Hugging Face name, rows in HF order): `.scales` [N, K/32] f32, `.mins`
[N, K/32] f32 (Q4_1), `.qs` [N, K/32, 16] uint8 (Q4_1) or [N, K/32, 32] int8 (Q8_0).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from llvmlite import ir
from numba import get_num_threads, get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attn.llvm_ir import _FAST, c_array, prefetch_ir, splat

BLOCK = 32
GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


class BlockWeight(Protocol):
    """A linear's weights in a block format (GGUF blocks, their int8-dot layout, MX), multiplied in
    their own kernels where a step has few tokens."""

    @property
    def shape(self) -> tuple[int, int]: ...  # (out, in)

    @property
    def nbytes(self) -> int: ...  # what a multiplication reads: the packed weights and their scales

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...  # x: [M, in] on the weight's device -> x @ W.T: [M, out]


@dataclass(frozen=True)
class QuantWeight:
    kind: str  # "q4_1" or "q8_0"
    scales: np.ndarray  # [N, K/32] float32
    mins: np.ndarray | None  # [N, K/32] float32 (q4_1 only)
    qs: np.ndarray  # [N, K/32, 16] uint8 (q4_1) or [N, K/32, 32] int8 (q8_0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.scales.nbytes + self.qs.nbytes + (0 if self.mins is None else self.mins.nbytes)

    @staticmethod
    def concat(parts: list["QuantWeight"]) -> "QuantWeight | None":
        """Stack output rows (fused projections); None when the parts do not share a format."""
        if any(p is None or p.kind != parts[0].kind for p in parts):
            return None
        cat = lambda xs: np.ascontiguousarray(np.concatenate(xs))  # noqa: E731
        mins = cat([p.mins for p in parts]) if parts[0].kind == "q4_1" else None
        return QuantWeight(parts[0].kind, cat([p.scales for p in parts]), mins, cat([p.qs for p in parts]))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return quant_matmul(x, self)

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, for tests."""
        if self.kind == "q8_0":
            w = self.scales[:, :, None] * self.qs.astype(np.float32)
        else:
            q = np.concatenate([self.qs & 15, self.qs >> 4], axis=-1).astype(np.float32)
            w = self.scales[:, :, None] * q + self.mins[:, :, None]
        return w.reshape(self.shape)


def _half(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def from_gguf_rows(data: np.ndarray, kind: str) -> QuantWeight:
    """data: [N, K/32 * block_bytes] uint8 as gguf-py reads a tensor."""
    n = data.shape[0]
    if kind == "q4_1":
        blocks = data.reshape(n, -1, 20)
        return QuantWeight(kind, _half(blocks[..., 0:2]), _half(blocks[..., 2:4]), np.ascontiguousarray(blocks[..., 4:]))
    blocks = data.reshape(n, -1, 34)
    return QuantWeight(kind, _half(blocks[..., 0:2]), None, np.ascontiguousarray(blocks[..., 2:]).view(np.int8))


def hf_row_order(num_rows: int, num_heads: int) -> np.ndarray:
    """GGUF stores q/k rows permuted for interleaved RoPE; this index puts them back in HF order."""
    idx = np.arange(num_rows)
    return idx.reshape(num_heads, num_rows // num_heads // 2, 2).swapaxes(1, 2).reshape(-1)


def read_gguf_quant(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, QuantWeight]:
    """Q4_1/Q8_0 tensors of a Llama GGUF, under Hugging Face names; other formats are skipped."""
    from gguf import GGMLQuantizationType, GGUFReader

    kinds = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
    out = {}
    for t in GGUFReader(path).tensors:
        kind = kinds.get(t.tensor_type)
        parts = t.name.split(".")
        if kind is None:
            continue
        data = np.asarray(t.data)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in GGUF_TO_HF:
            name = f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}.weight"
            heads = {"attn_q": num_heads, "attn_k": num_kv_heads}.get(parts[2])
            if heads:
                data = data[hf_row_order(data.shape[0], heads)]
        else:
            continue
        out[name] = from_gguf_rows(data, kind)
    return out


def save_quant(weights: dict[str, QuantWeight], path: Path) -> None:
    from safetensors.numpy import save_file

    tensors, meta = {}, {}
    for name, w in weights.items():
        meta[name] = w.kind
        tensors[name + ".scales"], tensors[name + ".qs"] = w.scales, w.qs
        if w.mins is not None:
            tensors[name + ".mins"] = w.mins
    save_file(tensors, path, metadata=meta)


def load_quant(path: Path) -> dict[str, QuantWeight]:
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="numpy") as f:
        for name, kind in (f.metadata() or {}).items():
            mins = f.get_tensor(name + ".mins") if kind == "q4_1" else None
            out[name] = QuantWeight(kind, f.get_tensor(name + ".scales"), mins, f.get_tensor(name + ".qs"))
    return out


_F32, _I64 = ir.FloatType(), ir.IntType(64)
_VF, _VB = ir.VectorType(_F32, 16), ir.VectorType(ir.IntType(8), 16)
PREFETCH_BYTES = 4096
"""How far ahead of the weight bytes it reads a decode kernel asks for them (and for their scales, as far ahead in
that stream): the hardware prefetchers stop at every 4 KiB page and keep few lines in flight. On a 2-core Xeon VM
(300 MB L3), two threads, one row of x, a step's 30 layers in turn: the integer-dot kernels' o, gate_up and down
147-185 us a layer against 194-300 without (back-to-back runs); these float kernels' linears 12.1 ms a step against
14.2 (medians of six runs each); 2,048 and 8,192 bytes ahead were in between."""


def _load(builder, base, kind, i):
    """LLVM IR: the `kind` value at element i of the pointer base."""
    return builder.load(builder.bitcast(builder.gep(base, [i]), kind.as_pointer()), align=1 if kind is _VB else 4)


def lane_total(builder, v):
    """LLVM IR: the sum of the 16 lanes of v, a tree of adds."""
    for lanes in (8, 4, 2, 1):
        kind = ir.VectorType(ir.IntType(32), lanes)
        v = builder.fadd(builder.shuffle_vector(v, v, ir.Constant(kind, list(range(lanes)))),
                         builder.shuffle_vector(v, v, ir.Constant(kind, list(range(lanes, 2 * lanes)))))
    return builder.extract_element(v, ir.IntType(32)(0))


class _Blocks:
    """LLVM IR: weight row n's blocks (scales, mins, qs: the arrays' structs), decoded in registers."""

    def __init__(self, builder, scales, mins, qs, n, q4_1: bool):
        self.builder, self.scales, self.mins, self.q4_1 = builder, scales, mins, q4_1
        self.num_blocks = cgutils.unpack_tuple(builder, scales.shape, 2)[1]
        self.first = builder.mul(n, self.num_blocks)
        self.qs = builder.gep(qs.data, [builder.mul(self.first, _I64(16 if q4_1 else 32))])
        self.fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")

    def prefetch(self, b):
        """Ask for the bytes PREFETCH_BYTES past block b's weights (and its scale's and min's as far ahead)."""
        builder, size = self.builder, 16 if self.q4_1 else 32
        prefetch_ir(self.builder, self.qs, builder.add(builder.mul(b, _I64(size)), _I64(PREFETCH_BYTES)))
        at = builder.add(self.first, builder.add(b, _I64(PREFETCH_BYTES // size)))
        for array in (self.scales, self.mins) if self.q4_1 else (self.scales,):
            prefetch_ir(builder, builder.gep(array.data, [at]))

    def weights(self, b):
        """Block b's 32 weights as two <16 x float> (d * q + m: exact, d * q being exact in float32)."""
        builder = self.builder
        block = builder.add(self.first, b)
        d = splat(builder, builder.load(builder.gep(self.scales.data, [block])), 16)
        if not self.q4_1:
            return [builder.fmul(d, builder.sitofp(_load(builder, self.qs, _VB, builder.add(builder.mul(b, _I64(32)),
                                                                                          _I64(16 * k))), _VF))
                    for k in (0, 1)]
        q = _load(builder, self.qs, _VB, builder.mul(b, _I64(16)))
        m = splat(builder, builder.load(builder.gep(self.mins.data, [block])), 16)
        halves = (builder.and_(q, ir.Constant(_VB, [15] * 16)), builder.lshr(q, ir.Constant(_VB, [4] * 16)))
        return [builder.call(self.fma, [d, builder.uitofp(h, _VF), m]) for h in halves]


def _arrays(context, builder, signature, args, which):
    return [context.make_array(signature.args[i])(context, builder, args[i]) for i in which]


def _row_dot_codegen(q4_1: bool, num_w: int):
    """LLVM IR of out[i, n0 + r] = x[i] . W[n0 + r] for the one or two rows i of x and the num_w weight rows
    from n0: one pass over the rows' blocks, each block's 32 weights decoded in two vectors of 16 (_Blocks)
    and multiplied into two vector sums per (weight row, row of x) pair (a block's low and high half), held in
    registers. Several weight rows at once share each load of x and give the FMA units independent sums (one
    row's two sums alone wait on the FMA latency every block); a second row of x shares the decoding. Each
    sum runs the same operations whatever else is computed beside it."""
    def codegen(context, builder, signature, args):
        xa, sa, ma, qa, oa = _arrays(context, builder, signature, args, (0, 1, 2, 3, 5))
        n0 = args[4]
        num_x, width = cgutils.unpack_tuple(builder, xa.shape, 2)
        num_rows = cgutils.unpack_tuple(builder, sa.shape, 2)[0]
        blocks = [_Blocks(builder, sa, ma, qa, builder.add(n0, _I64(r)), q4_1) for r in range(num_w)]

        def rows(count):
            pairs = [(r, i) for r in range(num_w) for i in range(count)]
            sums = {(r, i, k): cgutils.alloca_once(builder, _VF) for r, i in pairs for k in (0, 1)}  # registers
            for acc in sums.values():
                builder.store(ir.Constant(_VF, [0.0] * 16), acc)
            with cgutils.for_range(builder, blocks[0].num_blocks) as b:
                at = builder.mul(b.index, _I64(BLOCK))
                xs = [[_load(builder, xa.data, _VF, builder.add(builder.mul(_I64(i), width), builder.add(at, _I64(16 * k))))
                       for k in (0, 1)] for i in range(count)]
                for r, rb in enumerate(blocks):
                    rb.prefetch(b.index)
                    w = rb.weights(b.index)
                    for i in range(count):
                        for k in (0, 1):
                            acc = sums[r, i, k]
                            builder.store(builder.call(rb.fma, [w[k], xs[i][k], builder.load(acc)]), acc)
            for r, i in pairs:
                v = builder.fadd(builder.load(sums[r, i, 0]), builder.load(sums[r, i, 1]))
                at = builder.add(builder.mul(_I64(i), num_rows), builder.add(n0, _I64(r)))
                builder.store(lane_total(builder, v), builder.gep(oa.data, [at]))

        with builder.if_else(builder.icmp_signed(">", num_x, _I64(1))) as (pair, single):
            with pair:
                rows(2)
            with single:
                rows(1)
        return context.get_dummy_value()
    return codegen


def _block_args(scales, mins, qs, n) -> bool | None:
    """Whether qs holds Q4_1 blocks (uint8) or Q8_0 (int8); None when the arguments do not fit."""
    if not (c_array(scales, 2, types.float32) and c_array(mins, 2, types.float32) and isinstance(n, types.Integer)):
        return None
    return True if c_array(qs, 3, types.uint8) else False if c_array(qs, 3, types.int8) else None


@intrinsic
def _decode_row(typingctx, scales, mins, qs, n, row):
    """row[:] = W[n] (row: [K] float32), decoded 32 weights at a time (_Blocks)."""
    q4_1 = _block_args(scales, mins, qs, n)
    if q4_1 is None or not c_array(row, 1, types.float32):
        return None

    def codegen(context, builder, signature, args):
        sa, ma, qa, ra = _arrays(context, builder, signature, args, (0, 1, 2, 4))
        blocks = _Blocks(builder, sa, ma, qa, args[3], q4_1)
        with cgutils.for_range(builder, blocks.num_blocks) as b:
            for k, w in enumerate(blocks.weights(b.index)):
                at = builder.add(builder.mul(b.index, _I64(BLOCK)), _I64(16 * k))
                builder.store(w, builder.bitcast(builder.gep(ra.data, [at]), _VF.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(scales, mins, qs, n, row), codegen


def _row_dot_typer(num_w: int):
    def typer(typingctx, x, scales, mins, qs, n0, out):
        q4_1 = _block_args(scales, mins, qs, n0)
        if q4_1 is None or not (c_array(x, 2, types.float32) and c_array(out, 2, types.float32)):
            return None
        return types.none(x, scales, mins, qs, n0, out), _row_dot_codegen(q4_1, num_w)
    return typer


ROWS = 4  # weight rows block_matvec dots at once
_row_dot = intrinsic(_row_dot_typer(1))
"""_row_dot(x, scales, mins, qs, n, out): out[i, n] = x[i] . W[n] for every row i of x (at most 2)."""
_row_dot_rows = intrinsic(_row_dot_typer(ROWS))
"""The same for the ROWS weight rows n .. n + ROWS - 1."""


@njit(cache=True, nogil=True, parallel=True)
def block_matvec(x, scales, mins, qs, out):
    """x: [M, K]; scales, mins, qs as in block_matmul -> out: [M, N]: one pass over the weights per pair of rows
    of x, decoded in registers, ROWS weight rows at a time (_row_dot_codegen)."""
    num_rows = scales.shape[0]
    for g in prange(num_rows // ROWS):
        for i in range(0, x.shape[0], 2):  # pairs of rows of x, the weight rows' blocks in L1 after the first
            _row_dot_rows(x[i:i + 2], scales, mins, qs, g * ROWS, out[i:i + 2])
    for n in range(num_rows - num_rows % ROWS, num_rows):
        for i in range(0, x.shape[0], 2):
            _row_dot(x[i:i + 2], scales, mins, qs, n, out[i:i + 2])


TILE = 4  # output rows decoded at a time by the matmul kernels
MATVEC_MAX_ROWS = 2
"""Up to this many rows of x block_matvec is faster: it decodes each weight once per pair of rows, in registers;
block_matmul once per step, into L1. The 210 layer matmuls of SmolLM2 on a Zen 1 (2 cores), ms, matvec / matmul:
2 rows 18.5 / 22.2, 3 30.1 / 29.6, 4 33.8 / 28.6, 8 63.8 / 41.7."""


@njit(cache=True, nogil=True, inline="always")
def _dot_tile(x, w, out, n0, width):
    """out[i, n0 + r] = x[i] . w[r] for every row i of x and r < width (<= TILE): two rows of x at a
    time against the tile's four weight rows, eight vector accumulators (6 loads per 8 FMAs). An odd
    last row is paired with itself: every row takes the same path, and the pair costs little more
    than one row (the loads bind)."""
    for i in range(0, x.shape[0], 2):
        i2 = min(i + 1, x.shape[0] - 1)
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for c in range(x.shape[1]):
            xv, yv = x[i, c], x[i2, c]
            w0, w1, w2, w3 = w[0, c], w[1, c], w[2, c], w[3, c]
            a0 += xv * w0
            a1 += xv * w1
            a2 += xv * w2
            a3 += xv * w3
            b0 += yv * w0
            b1 += yv * w1
            b2 += yv * w2
            b3 += yv * w3
        for r, (a, b) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3))):
            if r < width:
                out[i, n0 + r] = a
                out[i2, n0 + r] = b


# More rows of x: TILE output rows of weights are decoded into float32 scratch once (L1-sized: 4 x K; _decode_row,
# 32 weights at a time: decoded one by one they took ~40 % of a 16-token step) and dotted with every row of x: at
# M rows of x each weight is decoded once, not M / 2 times.
@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def block_matmul(x, scales, mins, qs, out, tiles):
    """x: [M, K]; scales: [N, K/32]; Q4_1: mins [N, K/32], qs [N, K/32, 16] uint8, or Q8_0: mins
    unused, qs [N, K/32, 32] int8 -> out: [M, N]. tiles: [num_threads, TILE, K] float32 scratch."""
    num_rows = scales.shape[0]
    for tile in prange((num_rows + TILE - 1) // TILE):
        w = tiles[get_thread_id()]
        n0 = tile * TILE
        width = min(TILE, num_rows - n0)
        for n in range(n0, n0 + width):
            _decode_row(scales, mins, qs, n, w[n - n0])
        _dot_tile(x, w, out, n0, width)


def quant_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x: [M, K] float32 on the CPU -> x @ W.T: [M, N]"""
    xn = np.ascontiguousarray(x.numpy())
    out = np.empty((xn.shape[0], w.shape[0]), dtype=np.float32)
    mins = w.scales if w.mins is None else w.mins  # Q8_0 has none: any [N, K/32] array
    if xn.shape[0] <= MATVEC_MAX_ROWS:
        block_matvec(xn, w.scales, mins, w.qs, out)
    else:
        block_matmul(xn, w.scales, mins, w.qs, out, np.zeros((get_num_threads(), TILE, w.shape[1]), dtype=np.float32))
    return torch.from_numpy(out)
