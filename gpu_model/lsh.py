"""SimHash codes for MagicPIG's LSH (issue #4), computed next to the QKV projection.

One seeded Gaussian matrix W [head_dim, K * L] serves every layer and head. A vector's code in
table t is the K sign bits of x . W[:, t*K:(t+1)*K] packed into an integer (bit b = column
t*K + b positive), so two vectors land in the same bucket of a table with probability
(1 - angle / pi)^K.
"""
from __future__ import annotations

import torch


def simhash_matrix(head_dim: int, k: int, l: int, seed: int = 0) -> torch.Tensor:
    """[head_dim, K * L] float32, the same for a given seed on every machine."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(head_dim, k * l, generator=gen, dtype=torch.float32)


def simhash(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., head_dim] -> codes [..., L] int32 (L = w.shape[1] // k)."""
    bits = (x.to(w.dtype) @ w > 0).view(*x.shape[:-1], -1, k).to(torch.int32)
    return (bits << torch.arange(k, device=x.device, dtype=torch.int32)).sum(-1, dtype=torch.int32)
