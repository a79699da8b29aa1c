"""Drafts the backend makes itself: the target model attending only to a small view of each sequence's KV
(its first `sinks` and last `window` tokens; self-sparse, as MagicDec and TriForce draft), or a copy of
the model with MXFP4 weights (self-mx, with the whole KV or the view), proposes the tokens one step at a
time; the step then verifies them with the target and the full KV.

A draft step of sequence c at position p is an ordinary one-token decode whose block table is the view:
the blocks of the sinks, then the blocks of the window,

    real table   [b0 b1 b2 b3 b4 b5 b6]     p in b6, sinks in b0, window in b5 b6
    view table   [b0 b5 b6]                 view position = p - 4 * block_size

so the decode kernel reads those blocks alone, and p's KV is written to its real slot (verification
overwrites it). Each draft token is sampled as its row will be (same parameters, same random stream of its
output index), which makes acceptance likely whenever the view's distribution is close to the full one's.
"""
from __future__ import annotations

import time
from dataclasses import replace

from cpu_attn.worker import AttentionWorker, ChunkLayout
from gpu_model.sampler import sample
from gpu_model.worker import ModelWorker
from hetcore.backend import SeqChunk, StepInput


def view_layout(c: SeqChunk, j: int, block_size: int) -> ChunkLayout:
    """The one-token layout of c's j-th draft step (position c.start_pos + j) over its KV view."""
    pos = c.start_pos + j
    num_blocks = pos // block_size + 1
    sinks, window = c.draft_view
    if window <= 0:  # the whole KV
        return ChunkLayout(1, pos, c.block_table[:num_blocks], c.seq_id)
    head = -(-sinks // block_size)
    tail = num_blocks - max(0, pos - window + 1) // block_size
    if head + tail >= num_blocks:
        return ChunkLayout(1, pos, c.block_table[:num_blocks], c.seq_id)
    skipped = num_blocks - tail - head
    return ChunkLayout(1, pos - skipped * block_size, c.block_table[:head] + c.block_table[num_blocks - tail:num_blocks],
                       c.seq_id)


def self_drafts(inp: StepInput, model: ModelWorker, attn: AttentionWorker, block_size: int) -> tuple[StepInput, float]:
    """inp with every chunk that has self_draft k turned into one with its k draft tokens (num_draft k); and the
    seconds the draft steps spent outside attention."""
    drafting = [c for c in inp.chunks if c.self_draft]
    drafts: dict[int, list[int]] = {c.seq_id: [] for c in drafting}
    busy_s = 0.0
    for j in range(max((c.self_draft for c in drafting), default=0)):
        active = [c for c in drafting if c.self_draft > j]
        layouts = [view_layout(c, j, block_size) for c in active]
        attn.begin_step(layouts)
        inputs = [drafts[c.seq_id][-1] if j else c.token_ids[-1] for c in active]  # the token before draft j + 1
        logits, took = model.run(attn, inputs, [c.start_pos + j for c in active], list(range(len(active))),
                                 [(c.seq_id, lay.start_pos, 1, 0) for c, lay in zip(active, layouts)])
        t0 = time.perf_counter()
        for c, token in zip(active, sample_drafts(logits, active, j, drafts)):
            drafts[c.seq_id].append(token)
        busy_s += took + time.perf_counter() - t0
    return with_drafts(inp, drafts), busy_s


def sample_drafts(logits, active: list[SeqChunk], j: int, drafts: dict[int, list[int]]) -> list[int]:
    """Each active chunk's draft j + 1 from logits [len(active), V], sampled as the target's row at c.start_pos + j will
    be: the same parameters, the random stream of its output index, its penalties' history with drafts[seq_id] (the
    drafts before it)."""
    histories = [c.output_token_ids + tuple(drafts[c.seq_id]) if c.sampling.has_penalties else () for c in active]
    return sample(logits, [c.sampling for c in active], [c.output_index + j for c in active], histories)


def with_drafts(inp: StepInput, drafts: dict[int, list[int]]) -> StepInput:
    """inp with every chunk that has self_draft k carrying drafts[seq_id] (k tokens) as its num_draft drafts."""
    return replace(inp, chunks=tuple(replace(c, token_ids=c.token_ids + tuple(drafts[c.seq_id]), num_draft=c.self_draft,
                                             self_draft=0) if c.self_draft else c for c in inp.chunks))
