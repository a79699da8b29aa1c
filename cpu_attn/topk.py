"""The TopK baselines of the accuracy harness: each query head attends to the sinks,
the local window and `frac` of the other keys, those with the highest scores.

    TopK     the oracle: exact scores of every key (it saves no work); exact top-k by inner
             product is what a flat faiss index would return too, so torch's topk stands in
    AnnTopK  keys found by an approximate inner-product search, in the spirit of
             RetrievalAttention: a faiss HNSW graph per (sequence, layer, kv-head) over the keys
             before the window, built at prefill and grown as keys leave the window

MagicPIG is compared with both at an equal number of keys. Plain torch over the dequantized
context: yardsticks, not kernels.
"""
from __future__ import annotations

import copy

import numpy as np
import torch


class TopK:
    """Drop-in for MagicPig in the attention worker: the same layers and sequences are sparse."""

    def __init__(self, frac: float, sinks: int, window: int, min_context: int, sampled_layers: list[bool]):
        self.frac, self.sinks, self.window, self.min_context = frac, sinks, window, min_context
        self.sampled_layers = sampled_layers
        self.touched = self.eligible = 0

    def begin_step(self) -> None:
        pass

    def free(self, seq_ids) -> None:
        pass

    def clone(self, src: int, dst: int) -> None:
        """As MagicPig.clone; exact top-k keeps no per-sequence state."""

    def append(self, layer: int, seq_id: int, start_pos: int, k: torch.Tensor, k_codes=None, earlier=None,
               decode=None) -> None:
        """As MagicPig.append; top-k reads its keys from the store."""

    def take_centers(self) -> list:
        """As MagicPig.take_centers; top-k uses no LSH codes."""
        return []

    def decode_attention(self, store, layer: int, seq_ids: list[int], q: np.ndarray, q_codes, block_tables: np.ndarray,
                         seq_lens: np.ndarray, scale: float) -> tuple[np.ndarray, None] | None:
        """As MagicPig.decode_attention; LSH codes, if any, are not used."""
        if not self.sampled_layers[layer] or seq_lens.max() < self.min_context:
            return None
        fracs = np.where(seq_lens >= self.min_context, self.frac, 1.0)
        out = topk_decode_attention(store, layer, q, block_tables, seq_lens, scale, fracs, self.sinks, self.window,
                                    self._chooser(layer, seq_ids, q))
        middle = np.maximum(seq_lens - self.window - np.minimum(self.sinks, seq_lens), 0) * q.shape[1]
        self.touched += int(np.round(fracs * middle).sum())
        self.eligible += int(middle.sum())
        return out, None

    def _chooser(self, layer: int, seq_ids: list[int], q: np.ndarray):
        return None  # exact top-k

    def take_stats(self) -> tuple[int, int]:
        stats = self.touched, self.eligible
        self.touched = self.eligible = 0
        return stats


class AnnTopK(TopK):
    def __init__(self, frac: float, sinks: int, window: int, min_context: int, sampled_layers: list[bool],
                 graph_degree: int = 16):
        import faiss

        super().__init__(frac, sinks, window, min_context, sampled_layers)
        self.faiss, self.graph_degree = faiss, graph_degree
        self.seqs: dict[int, dict[int, tuple[list, list[np.ndarray]]]] = {}  # seq -> layer -> (graphs, pending keys)

    def free(self, seq_ids) -> None:
        for s in seq_ids:
            self.seqs.pop(s, None)

    def clone(self, src: int, dst: int) -> None:
        if src in self.seqs:
            self.seqs[dst] = copy.deepcopy(self.seqs[src])

    def append(self, layer: int, seq_id: int, start_pos: int, k: torch.Tensor, k_codes=None, earlier=None,
               decode=None) -> None:
        """Keys enter their kv-head's graph once they leave the window (ids = positions); a first chunk
        past 0 takes the keys before it from `earlier()` (a cached prefix, as MagicPig.append). Positions are
        never written again here (these yardsticks run in `hetserve eval`, without speculation)."""
        if not self.sampled_layers[layer]:
            return
        layers = self.seqs.setdefault(seq_id, {})
        if start_pos == 0 or layer not in layers:
            metric = self.faiss.METRIC_INNER_PRODUCT
            layers[layer] = ([self.faiss.IndexHNSWFlat(k.shape[2], self.graph_degree, metric) for _ in range(k.shape[1])],
                             [earlier().numpy()] if start_pos else [])
        graphs, pending = layers[layer]
        pending.append(k.numpy())
        upto = start_pos + len(k) - self.window
        if upto > graphs[0].ntotal:
            keys = np.concatenate(pending)
            take = upto - graphs[0].ntotal
            for h, graph in enumerate(graphs):
                graph.add(np.ascontiguousarray(keys[:take, h]))
            pending[:] = [keys[take:]]

    def _chooser(self, layer: int, seq_ids: list[int], q: np.ndarray):
        def choose(b: int, s: torch.Tensor, lo: int, hi: int, budget: int) -> torch.Tensor:
            graphs = self.seqs[seq_ids[b]][layer][0]
            group = q.shape[1] // len(graphs)
            found = []
            for h, graph in enumerate(graphs):
                graph.hnsw.efSearch = max(64, budget)
                found.append(graph.search(np.ascontiguousarray(q[b, h * group:(h + 1) * group]), budget)[1])
            return torch.from_numpy(np.concatenate(found)).long()  # [Hq, budget], -1 where fewer were found
        return choose


def topk_decode_attention(store, layer: int, q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                          scale: float, fracs: np.ndarray, sinks: int, window: int, choose=None) -> np.ndarray:
    """q [B, Hq, D] -> out [B, Hq, D] float32; fracs [B] share of the middle keys each sequence keeps;
    choose(b, scores [Hq, n], lo, hi, budget) -> [Hq, budget] positions to keep, those outside
    [lo, hi) ignored (default: the highest scores)."""
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
        if budget and (choose is None or fracs[b] == 1):
            keep[:, lo:hi].scatter_(1, s[:, lo:hi].topk(budget, dim=1).indices, True)
        elif budget:
            ids = choose(b, s, lo, hi, budget)
            chosen = torch.zeros(s.shape[0], int(n) + 1, dtype=torch.bool)  # column n: ids outside [lo, hi)
            chosen.scatter_(1, torch.where((ids >= lo) & (ids < hi), ids, int(n)), True)
            keep |= chosen[:, :-1]
        p = torch.softmax(s.masked_fill(~keep, -torch.inf), dim=1)
        out[b] = torch.einsum("hn,nhd->hd", p, v).numpy()
    return out
