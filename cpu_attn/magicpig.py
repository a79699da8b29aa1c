"""MagicPIG per-sequence state for the attention worker: key centers, hash tables per
(sequence, layer, kv-head), codes of keys not yet indexed, and the per-layer decision between
exact and sampled attention.

The codes come from the model worker (cpu_attn.simhash.LshCoder, made by `MagicPig.coder`), which
hashes q and k next to the projection, keys centered the same way as here.

Per sequence and layer:
    mu       [Hkv, D]          mean key of the first prefill chunk (for the angle in u), or of the
                               cached prefix the sequence started after; with `recenter`, of a
                               prompt of several chunks, from a decode step on (MagicPig.append)
    tables   per set c (lsh.MAX_KEYS keys each, the last one filling): offsets [Hkv][L, 2^K + 1],
             packed ids [Hkv][L, bytes], norms [Hkv, keys] (|k - mu| of each key as hashed, for
             its angle to the query); together keys 0..indexed-1
    pending  [P, Hkv, L] uint16 codes (and [P, Hkv] norms) of keys indexed .. indexed + P - 1
Keys stay pending (and are attended exactly, as the local window) until `merge_every` of them
lie before the window; then they are merged into the tables in one pass (lsh.merge_tables). A
decode step merges at most `merges_per_step` (sequence, layer) states: sequences that started
together come due together, and their merges (~5 ms a layer at 8k keys) would stall one step for
seconds; the others wait a step or more (exact meanwhile), at most until 2 * merge_every are due.
A recenter (all of a sequence's keys coded and merged again) takes one of those merges too.
Layers in `dense_layers`, and sequences shorter than `min_context`, are attended exactly.

`host_bytes` bounds what this state holds, and the serving backends count it in the KV cache's capacity
(server.hetero.kv_spec): at L 300 a key's codes or ids take ~7x its 5-bit Oaken K and V.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from numba.typed import List

from cpu_attn import lsh
from cpu_attn.simhash import LshCoder, simhash, simhash_matrix


RETRIEVALS = ("head", "group")


@dataclass(frozen=True)
class LshConfig:
    k: int = 10
    l: int = 300  # with "group" retrieval and min_collisions 3; the paper's per-head retrieval: 150 with 2
    sinks: int = 4
    window: int = 128  # MagicPIG: 64; 128 measured +2.67 % against +3.33 % at 8k (8 windows), ~1 % slower
    dense_layers: tuple[int, ...] | None = None  # None: layer 0 and the middle layer, as MagicPIG
    min_context: int = 1024
    merge_every: int = 256
    merges_per_step: int = 8
    seed: int = 0
    retrieval: str = "group"  # one retrieval per GQA group (its mean query); "head": each query head's own (MagicPIG)
    min_collisions: int = 3  # tables a key must share with the query to be retrieved (MagicPIG: 2)
    recenter: bool = True  # a prompt prefilled in several chunks: re-centered on all its keys at a decode step

    def __post_init__(self) -> None:
        if not (1 <= self.k <= 15 and self.l >= 2 and self.sinks >= 0 and self.window >= 1 and self.merge_every >= 1
                and self.merges_per_step >= 1):
            raise ValueError("LSH needs 1 <= k <= 15, l >= 2, sinks >= 0, window >= 1, merge_every >= 1, "
                             "merges_per_step >= 1")
        if not 1 <= self.min_collisions <= min(self.l, 255):
            raise ValueError(f"LSH min_collisions must be in 1 .. min(l, 255), not {self.min_collisions}")
        if self.retrieval not in RETRIEVALS:
            raise ValueError(f"LSH retrieval must be one of {', '.join(RETRIEVALS)}, not {self.retrieval!r}")


def sampled_layers(cfg: LshConfig, num_layers: int) -> list[bool]:
    dense = cfg.dense_layers if cfg.dense_layers is not None else (0, num_layers // 2)
    return [layer not in dense for layer in range(num_layers)]


def host_bytes(cfg: LshConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(per token, per sequence, per sequence with tables): a sequence of n tokens holds at most
    per_sequence + n * per_token bytes of MagicPIG state, plus per_sequence_with_tables once it has
    tables, which it gets only at min_context tokens (a merge's new copy of one table set aside, while
    it is made). Per token and (sampled layer, kv-head): its code in each of the L tables, pending
    (uint16) or as an id (at most 16 bits), its norm (float32), and the share of a later table set's
    fixed part. Per sequence: its key centers and 512 bytes of Python objects. With tables: the first
    set's fixed part (offsets [L, 2^K + 1] uint16, the id rows' padding of up to 16 bytes), 52 MB at
    SmolLM2's shape and L 300."""
    heads = sum(sampled_layers(cfg, num_layers)) * num_kv_heads
    fixed = cfg.l * (2 * (2**cfg.k + 1) + 16)
    return heads * (2 * cfg.l + 4 + -(-fixed // lsh.MAX_KEYS)), heads * (4 * head_dim + 512), heads * fixed


@dataclass
class _Layer:
    mu: np.ndarray
    offsets: list[list[np.ndarray]] = field(default_factory=list)  # per set, per kv-head [L, 2^K + 1]
    ids: list[list[np.ndarray]] = field(default_factory=list)  # per set, per kv-head [L, bytes] (lsh.table_set)
    norms: list[np.ndarray] = field(default_factory=list)  # per set [Hkv, keys]: |k - mu|
    indexed: int = 0
    pending: list[np.ndarray] = field(default_factory=list)  # code chunks [P, Hkv, L] uint16 (K <= 15 bits)
    pending_norms: list[np.ndarray] = field(default_factory=list)  # their norms [P, Hkv]
    version: int = 0  # bumped by every merge (the tables are new arrays)
    recenter_due: bool = False  # a prompt of several chunks, to be centered on all its keys (MagicPig.append)

    def set_keys(self, c: int) -> int:
        """Keys in table set c (every set but the last is full)."""
        return min(lsh.MAX_KEYS, self.indexed - c * lsh.MAX_KEYS)


class MagicPig:
    def __init__(self, cfg: LshConfig, num_layers: int, num_kv_heads: int, head_dim: int):
        self.cfg = cfg
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.sampled_layers = sampled_layers(cfg, num_layers)
        self.log_u = lsh.log_u_table(cfg.k, cfg.l, cfg.min_collisions)
        self.seqs: dict[int, list[_Layer | None]] = {}
        self._empty = (np.zeros((cfg.l, 2**cfg.k + 1), np.uint16), lsh.empty_ids(cfg.l, 0), np.zeros(0, np.float32))
        self._lists: dict[int, tuple] = {}  # per layer: the last batch's states, versions and typed Lists
        self._merges_left = cfg.merges_per_step
        self._w: torch.Tensor | None = None  # the coder's SimHash matrix, made when a cached prefix is first coded here
        self.new_centers: list[tuple[int, int, np.ndarray]] = []
        self.touched = 0
        """Keys sampled (summed over query heads) since the last take_stats."""
        self.eligible = 0
        """Keys that could have been sampled (outside sinks and window, summed over query heads)."""

    def coder(self, device: str | torch.device = "cpu") -> LshCoder:
        """The model worker's half: codes of this configuration, computed on `device`."""
        return LshCoder(self.head_dim, self.cfg.k, self.cfg.l, self.cfg.seed, device,
                        [layer for layer, sampled in enumerate(self.sampled_layers) if sampled],
                        shared=self.cfg.retrieval == "group")

    def begin_step(self) -> None:
        self._merges_left = self.cfg.merges_per_step

    def clone(self, src: int, dst: int) -> None:
        """Give sequence `dst` a copy of `src`'s state (the decode benchmarks' cloned sequences), its
        tables in buffers laid out as a merge makes them (lsh.table_arrays), not as np.copy would."""
        if src not in self.seqs:
            return
        layers = self.seqs[dst] = []
        for state in self.seqs[src]:
            if state is None:
                layers.append(None)
                continue
            twin = _Layer(mu=state.mu.copy(), norms=[n.copy() for n in state.norms], indexed=state.indexed,
                          pending=[p.copy() for p in state.pending],
                          pending_norms=[n.copy() for n in state.pending_norms],
                          recenter_due=state.recenter_due)
            for c, (offsets, ids) in enumerate(zip(state.offsets, state.ids)):
                arrays = lsh.table_arrays(len(offsets), self.cfg.l, 2**self.cfg.k, state.set_keys(c))
                for (o, i), old_o, old_i in zip(arrays, offsets, ids):
                    o[...], i[...] = old_o, old_i
                twin.offsets.append([o for o, _ in arrays])
                twin.ids.append([i for _, i in arrays])
            layers.append(twin)

    def free(self, seq_ids) -> None:
        freed = [s for s in seq_ids if self.seqs.pop(s, None) is not None]
        if freed:  # the engine frees every step, mostly nothing: keep the batch's typed Lists then
            self._lists.clear()  # they may hold a freed sequence's tables
            self.new_centers = [c for c in self.new_centers if c[0] not in freed]  # a failed step's

    def append(self, layer: int, seq_id: int, start_pos: int, k: torch.Tensor, k_codes: np.ndarray | None,
               earlier: Callable[[], torch.Tensor] | None = None, decode: bool | None = None) -> None:
        """k [n, Hkv, D] (CPU float32): the keys of positions start_pos .. start_pos + n - 1;
        k_codes [n, Hkv, L] int32: their centered codes (cpu_attn.simhash.LshCoder). `earlier()` gives
        the keys of positions 0 .. start_pos - 1 as stored, [start_pos, Hkv, D]. `decode`: the rows are a
        decoding sequence's (its token and draft tokens), not a prompt chunk's; default: one row is.

        Keys wait unindexed while they are among the last cfg.window, and a chunk rewrites its positions: keys
        pending from start_pos on (speculative drafts that were rejected) are dropped first, so they leave no
        trace; an indexed key is never rewritten (the window is longer than the most drafts a step sends), and
        when a decode merges depends on its token's position alone, not on its drafts.

        A sequence's keys are centered on the mean of its first chunk. Two cases choose a center here
        instead, code the sequence's keys so far on the CPU (_recenter), and hand the center on to the
        coder for its later keys (take_centers):
        - its first chunk starts past 0 (it took positions 0 .. start_pos - 1 from the prefix cache):
          the mean of those keys. (Centered on the 100 keys computed past the prefix instead: +44 %
          perplexity against +10 % cold, 1,600-token windows. On the prefix's first 512 keys: +7.1 %
          against exact attention, where its mean over 7,900 gives +3.0 %, 4 windows of 8,192 tokens.)
        - with cfg.recenter, a prompt of several chunks (longer than a step's token budget), at a decode
          step: the mean of all the prompt's keys (+6.6 % against exact attention on its first 512,
          +2.6 % on all, 4 windows of 8,192 tokens prefilled 512 a step). Its later chunks are neither
          coded nor merged (their codes would be thrown away). A recenter codes and merges all the
          sequence's keys (~0.25 s a layer at 7k keys, 2 Zen 3 cores), so it takes one of the step's
          merges_per_step; until one is left the layer keeps its first chunk's tables and attends the
          keys past them exactly."""
        if not self.sampled_layers[layer]:
            return
        if k_codes is None:
            raise ValueError("MagicPIG needs the key and query codes of the model worker's LshCoder")
        prompt = not (len(k) == 1 if decode is None else decode)
        layers = self.seqs.setdefault(seq_id, [None] * len(self.sampled_layers))
        state = layers[layer]
        if state is not None and start_pos:
            self._rewind(state, start_pos)
        recentered = False
        chunked = start_pos > 0 and state is not None and (state.recenter_due or self.cfg.recenter and prompt)
        if chunked and (prompt or self._merges_left <= 0):
            state.recenter_due = True  # a prompt's later chunk (not coded), or a decode step with no merge left
            return
        if start_pos and (state is None or chunked):  # after a cached prefix, or a chunked prompt's decode step
            if earlier is None:
                raise ValueError(f"sequence {seq_id} starts at {start_pos} without its earlier keys")
            state = layers[layer] = self._recenter(seq_id, layer, earlier(), k)  # a decode's: the merge below is
            # the one it takes from the step's budget
            recentered = True
        elif start_pos:
            self._pend(state, k, k_codes)
        else:
            state = layers[layer] = _Layer(mu=k.mean(0).numpy().astype(np.float32))
            self._pend(state, k, k_codes)
        n = start_pos + (len(k) if prompt else 1)  # a decode's draft rows may be rejected: they do not count
        due = n - self.cfg.window - state.indexed
        if n >= self.cfg.min_context and due >= self.cfg.merge_every and \
                (prompt or self._merges_left > 0 or due >= 2 * self.cfg.merge_every):
            self._merges_left -= not prompt  # prefill chunks index their keys at once, outside the budget
            # a decode indexes whole merge_every's of keys (the same keys at the same positions, however many tokens
            # the steps before it accepted); after a re-center, all but the window, as a prompt's end does
            whole = prompt or recentered
            self._merge(state, state.indexed + (due if whole else due - due % self.cfg.merge_every))

    @staticmethod
    def _rewind(state: _Layer, start_pos: int) -> None:
        """Drop the pending keys of positions start_pos and later (rejected drafts, about to be written again)."""
        keep = start_pos - state.indexed
        if keep < 0:
            raise ValueError(f"position {start_pos} is written again after keys up to {state.indexed} were indexed")
        pending = sum(len(p) for p in state.pending)
        if keep < pending:
            codes, norms = np.concatenate(state.pending)[:keep], np.concatenate(state.pending_norms)[:keep]
            state.pending, state.pending_norms = [codes.copy()], [norms.copy()]

    def _recenter(self, seq_id: int, layer: int, keys: torch.Tensor, k: torch.Tensor) -> _Layer:
        """A new state for `layer` of `seq_id`, centered on the mean of keys [start_pos, Hkv, D] (the
        sequence's earlier keys, as stored), with those keys and k coded here; the center goes to
        new_centers. An earlier state's tables are dropped (their codes used another center)."""
        state = _Layer(mu=keys.mean(0).numpy().astype(np.float32))
        self._code(state, torch.cat([keys, k]))
        self.new_centers.append((seq_id, layer, state.mu))
        return state

    def take_centers(self) -> list[tuple[int, int, np.ndarray]]:
        """(seq_id, layer, mu [Hkv, D]) of the key centers chosen here since the last call, for the
        coder's later key codes of those sequences (LshCoder.set_center)."""
        centers, self.new_centers = self.new_centers, []
        return centers

    def _code(self, state: _Layer, keys: torch.Tensor, rows: int = 512) -> None:
        """Pending codes and norms of keys [n, Hkv, D], centered on state.mu, as the coder makes them,
        in pieces of `rows` keys (a piece's projections take rows * Hkv * K * L * 4 bytes: 18 MB, which
        stay in cache for the sign packing; pieces of 2,048 keys took 2.4x as long, 7.2k keys on a Zen 3)."""
        if self._w is None:
            self._w = simhash_matrix(self.head_dim, self.cfg.k, self.cfg.l, self.cfg.seed)
        mu = torch.from_numpy(state.mu)
        for piece in keys.split(rows):
            self._pend(state, piece, simhash(piece - mu, self._w, self.cfg.k).numpy())

    @staticmethod
    def _pend(state: _Layer, keys: torch.Tensor, codes: np.ndarray) -> None:
        """keys [n, Hkv, D] and their centered codes [n, Hkv, L] wait for the next merge."""
        state.pending.append(np.asarray(codes, np.uint16))  # half of int32's bytes: most of a short one's state
        state.pending_norms.append(torch.linalg.vector_norm(keys - torch.from_numpy(state.mu), dim=-1).numpy())

    def _merge(self, state: _Layer, upto: int) -> None:
        """Index keys state.indexed .. upto - 1: into the last set while it has room, then new sets."""
        due = upto - state.indexed
        codes, norms = np.concatenate(state.pending), np.concatenate(state.pending_norms)
        state.pending, state.pending_norms = [codes[due:].copy()], [norms[due:].copy()]  # not views of all
        codes, norms = codes[:due], norms[:due]
        while len(codes):
            in_set = state.indexed % lsh.MAX_KEYS  # keys already in the last set (0: start a new one)
            room = lsh.MAX_KEYS - in_set
            (take, codes), (take_norms, norms) = (codes[:room], codes[room:]), (norms[:room], norms[room:])
            if in_set == 0:
                state.offsets.append([])
                state.ids.append([])
                state.norms.append(np.ascontiguousarray(take_norms.T))
            else:
                state.norms[-1] = np.concatenate([state.norms[-1], take_norms.T], axis=1)
            offsets, ids = state.offsets[-1], state.ids[-1]
            arrays = lsh.table_arrays(self.num_kv_heads, self.cfg.l, 2**self.cfg.k, in_set + len(take))
            for h, (o, i) in enumerate(arrays):
                new = np.ascontiguousarray(take[:, h], np.int32)
                if in_set == 0:
                    lsh.table_set(new, self.cfg.k, (o, i))
                    offsets.append(o)
                    ids.append(i)
                else:
                    lsh.merge_tables(offsets[h], ids[h], in_set, new, o, i)
                    offsets[h], ids[h] = o, i
            state.indexed += len(take)
        state.version += 1

    def decode_attention(self, store, layer: int, seq_ids: list[int], q: np.ndarray, q_codes: np.ndarray,
                         block_tables: np.ndarray, seq_lens: np.ndarray,
                         scale: float) -> tuple[np.ndarray, np.ndarray] | None:
        """Sampled attention for one decode step of `layer` (q [B, Hq, D], q_codes [B, Hq, L], or
        [B, Hkv, L] for group retrieval), or None where it should be exact."""
        if not self.sampled_layers[layer]:
            return None
        states = [self.seqs.get(s, [None] * (layer + 1))[layer] for s in seq_ids]
        if not any(s is not None and s.indexed for s in states):
            return None
        tables = self._tables(layer, states)
        mu = np.zeros((len(seq_ids), self.num_kv_heads, self.head_dim), np.float32)
        indexed = np.zeros((len(seq_ids), 1), np.int64)
        for b, state in enumerate(states):
            if state is not None:
                mu[b], indexed[b] = state.mu, state.indexed
        out, lse, touched = store.sampled_decode_attention(layer, q, q_codes, block_tables, seq_lens, scale, tables,
                                                           mu, self.log_u, self.cfg.sinks, self.cfg.window,
                                                           self.cfg.min_collisions)
        last_block = (seq_lens[:, None] - 1) // store.block_size * store.block_size
        tails = np.maximum(np.minimum(np.minimum(indexed, seq_lens[:, None] - self.cfg.window), last_block),
                           np.minimum(self.cfg.sinks, seq_lens)[:, None])
        self.touched += int(touched.sum())
        self.eligible += int(q.shape[1] * (tails - np.minimum(self.cfg.sinks, seq_lens)[:, None]).sum())
        return out, lse

    def _tables(self, layer: int, states: list[_Layer | None]) -> tuple[np.ndarray, np.ndarray, List, List, List]:
        """The batch's table sets as sampled.sampled_decode_attention takes them: (set_of [B, Hkv, 2],
        indexed [S], offsets, ids, norms as typed Lists), reused while the batch and its tables stay the
        same (filling a List from Python costs ~5 us per item: 30 ms per step at 16 sequences)."""
        versions = [None if s is None else s.version for s in states]
        cached = self._lists.get(layer)
        if cached is not None and len(cached[0]) == len(states) and cached[1] == versions and \
                all(a is b for a, b in zip(cached[0], states)):
            return cached[2:]
        offsets, ids, norms, indexed = List(), List(), List(), []
        set_of = np.zeros((len(states), self.num_kv_heads, 2), np.int32)
        for b, state in enumerate(states):
            for h in range(self.num_kv_heads):
                set_of[b, h, 0] = len(indexed)
                sets = range(len(state.offsets)) if state is not None else ()
                for c in sets:
                    offsets.append(state.offsets[c][h])
                    ids.append(state.ids[c][h])
                    norms.append(state.norms[c][h])
                    indexed.append(state.set_keys(c))
                if not sets:
                    offsets.append(self._empty[0])
                    ids.append(self._empty[1])
                    norms.append(self._empty[2])
                    indexed.append(0)
                set_of[b, h, 1] = len(indexed)
        tables = (set_of, np.array(indexed, np.int32), offsets, ids, norms)
        self._lists[layer] = (states, versions, *tables)
        return tables

    def take_stats(self) -> tuple[int, int]:
        stats = self.touched, self.eligible
        self.touched = self.eligible = 0
        return stats
