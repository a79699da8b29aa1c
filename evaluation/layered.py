"""`hetserve eval --kv-policy layered`: a KV format's windows run with layered KV sparsity, beside the
same format with every token kept (evaluation/evaluate.py runs both in lockstep).

Each window is one sequence: group 0 (the full layers) uses the window's block table as any variant
does; every other group has its own blocks, and its rows follow the policy's rules (SeqRows), as the
server's block manager counts them. kv_kept_frac is the mean, over the decoded positions, of the KV
rows held in all layers over the rows a full cache holds there.
"""
from __future__ import annotations

from cpu_attn.calibrate import SPARSE_FRACTION, OakenThresholds
from cpu_attn.kv_store import layered_stores
from cpu_attn.layered_worker import LayeredAttentionWorker, LayeredChunkLayout
from hetcore.kv_policy import KVLayout, KVView, SeqRows

LAYERED_SUFFIX = "+layered"
LAYERED_FORMATS = ("fp16", "fp32", "oaken")
"""KV formats whose stores compact a sparse layer's rows (cpu_attn/kv_store.layered_stores)."""


def layered_names(kv_formats: list[str], has_sparse_attention: bool, cached_prefix_tokens: int) -> list[str]:
    """"<format>+layered" for each format; refuses the combinations layered sparsity does not run with."""
    bad = [f for f in kv_formats if f not in LAYERED_FORMATS]
    if bad:
        raise ValueError(f"--kv-policy layered runs over the fp16, fp32 and oaken KV formats, not {', '.join(bad)}")
    if has_sparse_attention:
        raise ValueError("--kv-policy layered runs with exact attention (not MagicPIG or TopK)")
    if cached_prefix_tokens:
        raise ValueError("--kv-policy layered takes no prefix-cache hits: pass --cached-prefix-tokens 0")
    return [f + LAYERED_SUFFIX for f in kv_formats]


class LayeredRun:
    """One layered variant over a batch of `num` windows of `blocks_per_window` blocks (oaken_cal, sparse_fraction,
    recent_blocks: as make_store takes them for an Oaken store)."""

    def __init__(self, kv_format: str, cfg, layout: KVLayout, num: int, blocks_per_window: int, block_size: int,
                 oaken_cal: OakenThresholds | None = None, sparse_fraction: float = SPARSE_FRACTION,
                 recent_blocks: int = 0):
        self.layout = layout
        groups = layout.num_groups
        stores = layered_stores(kv_format, layout.slots, groups, cfg.num_kv_heads, cfg.head_dim, block_size,
                                groups * num * blocks_per_window, oaken_cal, sparse_fraction, recent_blocks)
        self.store = stores[0].inner if kv_format == "oaken" else stores[0]
        """Group 0's store (the full layers): what the realized bits of an Oaken store are read from."""
        self.worker = LayeredAttentionWorker(stores, cfg.head_dim, layout)
        self.tables = [[tuple(range((g * num + i) * blocks_per_window, (g * num + i + 1) * blocks_per_window))
                        for g in range(groups)] for i in range(num)]
        self.rows = [SeqRows(layout) for _ in range(num)]
        self.kept_sum, self.kept_count = 0.0, 0

    def layouts(self, seq_ids: list[int], start: int, length: int, end: int) -> list[LayeredChunkLayout]:
        """The chunk layouts of one step over every window's tokens start .. start + length - 1, of a prefill
        (or decode) that runs to token `end`."""
        return [self.chunk(i, seq_id, start, length, end) for i, seq_id in enumerate(seq_ids)]

    def chunk(self, i: int, seq_id: int, start: int, length: int, end: int) -> LayeredChunkLayout:
        """Window i's chunk of `length` tokens from `start` (its rows move on as SeqRows says)."""
        before, after, observed = self.rows[i].advance(length, end)
        view = KVView(tuple(self.tables[i][1:]), before, after, observed)
        return LayeredChunkLayout(num_tokens=length, start_pos=start, block_table=self.tables[i][0], seq_id=seq_id,
                                  kv_view=view)

    def count_kept(self, seq_len: int) -> None:
        """Add each window's share of KV kept after a decode step at `seq_len` tokens."""
        full = self.layout.num_layers * seq_len
        for rows in self.rows:
            self.kept_sum += self.layout.slots * (seq_len + sum(rows.rows)) / full
            self.kept_count += 1

    @property
    def kept_frac(self) -> float:
        return self.kept_sum / max(self.kept_count, 1)
