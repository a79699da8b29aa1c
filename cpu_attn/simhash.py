"""SimHash codes for MagicPIG's LSH, computed next to the QKV projection.

One seeded Gaussian matrix W [head_dim, K * L] serves every layer and head. A vector's code in
table t is the K sign bits of x . W[:, t*K:(t+1)*K] packed into an integer (bit b = column
t*K + b positive), so two vectors land in the same bucket of a table with probability
(1 - angle / pi)^K.
"""
from __future__ import annotations

import itertools
from collections.abc import Collection

import numpy as np
import torch
from numba import njit, prange


def simhash_matrix(head_dim: int, k: int, l: int, seed: int = 0) -> torch.Tensor:
    """[head_dim, K * L] float32, the same for a given seed on every machine."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(head_dim, k * l, generator=gen, dtype=torch.float32)


def simhash(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., head_dim] -> codes [..., L] int32 (L = w.shape[1] // k)."""
    return pack_signs(x.to(w.dtype) @ w, k)


def pack_signs(proj: torch.Tensor, k: int) -> torch.Tensor:
    """Projections [..., K * L] -> codes [..., L] int32: bit b of table t set where column t*K + b > 0."""
    if proj.device.type == "cpu":  # one Numba pass: torch's five elementwise passes took ~25x longer (16 x 9 queries)
        rows = np.ascontiguousarray(proj.reshape(-1, proj.shape[-1]).numpy(), dtype=np.float32)
        codes = np.empty((rows.shape[0], rows.shape[1] // k), np.int32)
        _pack_signs(rows, k, codes)
        return torch.from_numpy(codes).view(*proj.shape[:-1], codes.shape[1])
    return pack_signs_torch(proj, k)


def pack_signs_torch(proj: torch.Tensor, k: int) -> torch.Tensor:
    """pack_signs in torch operations, for tensors on the accelerator. The table count is spelled out
    (not -1): a prefill-only step has no decode rows, and torch cannot infer -1 for 0 elements."""
    bits = (proj > 0).view(*proj.shape[:-1], proj.shape[-1] // k, k).to(torch.int32)
    return (bits * (1 << torch.arange(k, device=proj.device, dtype=torch.int32))).sum(-1, dtype=torch.int32)


@njit(cache=True, nogil=True, parallel=True)
def _pack_signs(proj, k, codes):
    """proj [R, K * L] float32 -> codes [R, L] int32."""
    for r in prange(proj.shape[0]):
        for t in range(codes.shape[1]):
            code = 0
            for b in range(k):
                code |= np.int32(proj[r, t * k + b] > 0) << b
            codes[r, t] = code


class LshCoder:
    """A step's query and key codes, computed where q and k are made (the accelerator) and shipped
    with them to the attention workers.

    Keys are centered per (sequence, layer, kv-head) on the mean key of the sequence's first
    prefill chunk, or on the center an attention worker chose for a sequence that started after a
    cached prefix (set_center). (k - mu) . W = k . W - mu . W, so what is kept per sequence and
    layer is the projected center mu . W [Hkv, K * L], on the device; `free` drops a finished
    sequence's.
    Only `layers` (default: all) get codes; the others (MagicPIG's dense layers) get None.
    With `shared`, a GQA group's heads share one retrieval: the query codes are those of the
    group's mean query, [T, Hkv, L]."""

    def __init__(self, head_dim: int, k: int, l: int, seed: int = 0, device: str | torch.device = "cpu",
                 layers: Collection[int] | None = None, shared: bool = False):
        self.k, self.shared = k, shared
        self.w = simhash_matrix(head_dim, k, l, seed).to(device)
        self.layers = None if layers is None else frozenset(layers)
        self.centers: dict[int, dict[int, torch.Tensor]] = {}
        self._rows: dict[int, tuple[tuple, torch.Tensor]] = {}  # per layer: (a decode batch's seq ids, their centers)

    def codes(self, layer: int, q: torch.Tensor, k: torch.Tensor,
              chunks: list[tuple[int, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """q [T, Hq, D], k [T, Hkv, D]; chunks [(seq_id, start_pos, num_tokens, num_draft)] in row order ->
        (query codes of the decode rows [D, Hq, L] or, shared, [D, Hkv, L], centered key codes
        [T, Hkv, L]), int32 on the CPU; None for a layer without codes. Decode rows are the rows of
        one-token chunks and of chunks with draft tokens (the others are prefill, whose attention is
        exact: hashing their queries too cost as much as the rest of a long prompt's prefill on SmolLM2)."""
        if self.layers is not None and layer not in self.layers:
            return None
        proj = k.to(self.w.dtype) @ self.w
        self._subtract_centers(layer, proj, chunks)
        if any(n != 1 and not drafts for _, _, n, drafts in chunks):
            starts = itertools.accumulate((n for _, _, n, _ in chunks), initial=0)
            q = q[[row + i for row, (_, _, n, drafts) in zip(starts, chunks) if n == 1 or drafts for i in range(n)]]
        if self.shared:
            q = q.unflatten(1, (k.shape[1], -1)).mean(2)
        return simhash(q, self.w, self.k).cpu(), pack_signs(proj, self.k).cpu()

    def _subtract_centers(self, layer: int, proj: torch.Tensor, chunks: list[tuple[int, int, int, int]]) -> None:
        """proj [T, Hkv, K * L] -= each row's projected center, set from its sequence's first chunk.
        A decode step's centers are stacked once per layer and batch and reused while the batch
        stays the same (16 small subtractions a layer cost ~0.2 ms)."""
        seq_ids = tuple(seq_id for seq_id, *_ in chunks)
        if all(n == 1 and start > 0 and layer in self.centers.get(s, ()) for s, start, n, _ in chunks):
            kept = self._rows.get(layer)
            if kept is None or kept[0] != seq_ids:
                kept = self._rows[layer] = (seq_ids, torch.stack([self.centers[s][layer] for s in seq_ids]))
            proj -= kept[1]
            return
        row = 0
        for seq_id, start, n, _ in chunks:
            centers = self.centers.setdefault(seq_id, {})
            if start == 0 or layer not in centers:
                centers[layer] = proj[row:row + n].mean(0)
                self._rows.pop(layer, None)
            proj[row:row + n] -= centers[layer]
            row += n

    def set_center(self, seq_id: int, layer: int, mu: np.ndarray) -> None:
        """Center `seq_id`'s later keys of `layer` on mu [Hkv, D], chosen by the attention worker (a
        sequence that started after a cached prefix: MagicPig.take_centers)."""
        self.centers.setdefault(seq_id, {})[layer] = torch.from_numpy(mu).to(self.w) @ self.w
        self._rows.pop(layer, None)

    def free(self, seq_ids) -> None:
        for s in seq_ids:
            if self.centers.pop(s, None) is not None:
                self._rows.clear()
