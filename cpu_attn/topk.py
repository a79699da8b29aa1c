"""The TopK baseline of the accuracy harness (issue #4): each query head attends to the sinks,
the local window and the `frac` share of the other keys with the highest exact scores. An
oracle (it scores every key, so it saves no work); MagicPIG is compared with it at an equal
number of keys. Plain torch over the dequantized context: it is a yardstick, not a kernel.
"""
from __future__ import annotations

import numpy as np
import torch


class TopK:
    """Drop-in for MagicPig in the attention worker: the same layers and sequences are sparse."""

    def __init__(self, frac: float, sinks: int, window: int, min_context: int, sampled_layers: list[bool]):
        self.frac, self.sinks, self.window, self.min_context = frac, sinks, window, min_context
        self.sampled_layers = sampled_layers
        self.touched = self.eligible = 0

    def free(self, seq_ids) -> None:
        pass

    def append(self, layer: int, seq_id: int, start_pos: int, k: torch.Tensor) -> None:
        pass

    def decode_attention(self, store, layer: int, seq_ids: list[int], q: np.ndarray, block_tables: np.ndarray,
                         seq_lens: np.ndarray, scale: float) -> tuple[np.ndarray, None] | None:
        if not self.sampled_layers[layer] or seq_lens.max() < self.min_context:
            return None
        fracs = np.where(seq_lens >= self.min_context, self.frac, 1.0)
        out = topk_decode_attention(store, layer, q, block_tables, seq_lens, scale, fracs, self.sinks, self.window)
        middle = np.maximum(seq_lens - self.window - np.minimum(self.sinks, seq_lens), 0) * q.shape[1]
        self.touched += int(np.round(fracs * middle).sum())
        self.eligible += int(middle.sum())
        return out, None

    def take_stats(self) -> tuple[int, int]:
        stats = self.touched, self.eligible
        self.touched = self.eligible = 0
        return stats


def topk_decode_attention(store, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                          scale: float, fracs: np.ndarray, sinks: int, window: int) -> np.ndarray:
    """q [B, Hq, D] -> out [B, Hq, D] float32; fracs [B] share of the middle keys each sequence keeps."""
    out = np.empty_like(q)
    for b, n in enumerate(seq_lens):
        k, v = (torch.from_numpy(x) for x in store.gather(layer, block_tables[b], int(n)))  # [n, Hkv, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, Hq, D]
        s = torch.einsum("nhd,hd->hn", k, torch.from_numpy(q[b])) * scale  # [Hq, n]
        lo, hi = min(sinks, int(n)), max(int(n) - window, min(sinks, int(n)))
        keep = torch.zeros_like(s, dtype=torch.bool)
        keep[:, :lo] = True
        keep[:, hi:] = True
        budget = int(round(fracs[b] * (hi - lo)))
        if budget:
            keep[:, lo:hi].scatter_(1, s[:, lo:hi].topk(budget, dim=1).indices, True)
        p = torch.softmax(s.masked_fill(~keep, -torch.inf), dim=1)
        out[b] = torch.einsum("hn,nhd->hd", p, v).numpy()
    return out
