"""SimHash codes for MagicPIG's LSH (issue #4), computed next to the QKV projection.

One seeded Gaussian matrix W [head_dim, K * L] serves every layer and head. A vector's code in
table t is the K sign bits of x . W[:, t*K:(t+1)*K] packed into an integer (bit b = column
t*K + b positive), so two vectors land in the same bucket of a table with probability
(1 - angle / pi)^K.
"""
from __future__ import annotations

from collections.abc import Collection

import torch


def simhash_matrix(head_dim: int, k: int, l: int, seed: int = 0) -> torch.Tensor:
    """[head_dim, K * L] float32, the same for a given seed on every machine."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(head_dim, k * l, generator=gen, dtype=torch.float32)


def simhash(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., head_dim] -> codes [..., L] int32 (L = w.shape[1] // k)."""
    return pack_signs(x.to(w.dtype) @ w, k)


def pack_signs(proj: torch.Tensor, k: int) -> torch.Tensor:
    """Projections [..., K * L] -> codes [..., L] int32: bit b of table t set where column t*K + b > 0."""
    bits = (proj > 0).view(*proj.shape[:-1], -1, k).to(torch.int32)
    return (bits * (1 << torch.arange(k, device=proj.device, dtype=torch.int32))).sum(-1, dtype=torch.int32)


class LshCoder:
    """A step's query and key codes, computed where q and k are made (the accelerator) and shipped
    with them to the attention workers.

    Keys are centered per (sequence, layer, kv-head) on the mean key of the sequence's first
    prefill chunk. (k - mu) . W = k . W - mu . W, so what is kept per sequence and layer is the
    projected center mu . W [Hkv, K * L], on the device; `free` drops a finished sequence's.
    Only `layers` (default: all) get codes; the others (MagicPIG's dense layers) get None."""

    def __init__(self, head_dim: int, k: int, l: int, seed: int = 0, device: str | torch.device = "cpu",
                 layers: Collection[int] | None = None):
        self.k = k
        self.w = simhash_matrix(head_dim, k, l, seed).to(device)
        self.layers = None if layers is None else frozenset(layers)
        self.centers: dict[int, dict[int, torch.Tensor]] = {}

    def codes(self, layer: int, q: torch.Tensor, k: torch.Tensor,
              chunks: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """q [T, Hq, D], k [T, Hkv, D]; chunks [(seq_id, start_pos, num_tokens)] in row order ->
        (query codes [T, Hq, L], centered key codes [T, Hkv, L]), int32 on the CPU; None for a
        layer without codes."""
        if self.layers is not None and layer not in self.layers:
            return None
        proj = k.to(self.w.dtype) @ self.w
        row, rows = 0, []
        for seq_id, start, n in chunks:
            centers = self.centers.setdefault(seq_id, {})
            if start == 0 or layer not in centers:
                centers[layer] = proj[row:row + n].mean(0)
            rows.append(centers[layer].expand(n, *centers[layer].shape))
            row += n
        if rows:
            proj -= torch.cat(rows)
        return simhash(q, self.w, self.k).cpu(), pack_signs(proj, self.k).cpu()

    def free(self, seq_ids) -> None:
        for s in seq_ids:
            self.centers.pop(s, None)
