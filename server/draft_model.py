"""Drafts from a separate model that shares the target's tokenizer (`--speculative-method draft-model
--speculative-model PATH`): a small sibling of a large target proposes the tokens one step at a time,
and the step verifies them with the target, as the self-drafts of server/self_draft.py are.

The draft model has its own KV store, over the target's block ids: a block id holds the draft's rows
of the same 16 positions as the target's, so a chunk's block table serves both, and the block
manager's bytes per block count both. The store follows each sequence lazily:

    _Sync(synced, base, tokens)   the store holds the sequence's draft KV below `synced`; tokens[i]
                                  is the token at position base + i, as the target's chunks named it

Every chunk of a step is recorded (a chunk rewrites its positions, so drafts the target rejected are
dropped, and `synced` falls back to the chunk's start). Prompt chunks are run through the draft model
at once, so that blocks the prefix cache hands to another sequence hold draft KV too. A decode chunk
that drafts first runs the tokens the store is missing (decodes of steps that did not draft, the last
draft when all were accepted) together with its own token, whose logits give the first draft; then one
draft step a token. Decodes that do not draft cost the draft model nothing.

A draft only decides how many steps the text takes, never the text: the target samples every row
(server/speculative.py). A sequence whose cached prefix came from blocks without draft KV (positions
of another request's decodes that never drafted) drafts from wrong rows there: fewer drafts accepted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from cpu_attn.kv_store import PagedKVStore
from cpu_attn.worker import AttentionWorker, ChunkLayout
from gpu_model.model import LlamaModel
from gpu_model.worker import ModelWorker
from hetcore.backend import SeqChunk, StepInput
from server.backend_config import BackendConfig
from server.self_draft import sample_drafts, with_drafts


@dataclass
class _Sync:
    synced: int
    """The draft store holds the sequence's KV below this position."""
    base: int
    tokens: list[int] = field(default_factory=list)
    """The tokens at positions base, base + 1, ... (base <= synced), as the target's chunks named them."""

    def record(self, c: SeqChunk) -> None:
        """c's tokens replace what the positions from c.start_pos held."""
        if c.start_pos > self.base + len(self.tokens):  # positions never seen: a cached prefix, with its draft KV
            self.synced = self.base = c.start_pos
            self.tokens = []
        del self.tokens[max(0, c.start_pos - self.base):]
        self.tokens += c.token_ids
        self.synced = min(self.synced, c.start_pos)

    def missing(self, end: int) -> list[int]:
        """The tokens at positions synced .. end - 1."""
        return self.tokens[self.synced - self.base:end - self.base]

    def advance(self, synced: int) -> None:
        self.tokens = self.tokens[synced - self.base:]
        self.synced = self.base = synced


def load_draft(path: str, target_dir: Path, target_cfg, config: BackendConfig, device, dtype) -> LlamaModel:
    """The draft model at `path` (a GGUF file or a Hugging Face directory; `config`: the BackendConfig whose
    weight settings it loads with), on the target's device and dtype. Raises ModelLoadError, in one line, where
    its vocabulary is not the target's."""
    from gpu_model.loader import ModelLoadError, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer

    draft_dir = resolve_model_dir(path, Path(config.model_cache_dir).expanduser())
    draft = config.load_model(draft_dir, device, dtype)
    same = draft.cfg.vocab_size == target_cfg.vocab_size and (
        Tokenizer(draft_dir, ()).hf.get_vocab() == Tokenizer(target_dir, ()).hf.get_vocab())
    if not same:
        raise ModelLoadError(f"speculative model {path}: its tokenizer or vocabulary ({draft.cfg.vocab_size} tokens) "
                             f"is not the model's ({target_cfg.vocab_size}); a draft model must share the tokenizer")
    return draft


class DraftModel:
    """A draft model (`model`, with the target's vocabulary) and its KV store of `num_blocks` blocks."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: str):
        cfg = model.cfg
        self.worker = ModelWorker(model)
        self.attn = AttentionWorker(PagedKVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                                                 num_blocks, kv_dtype), cfg.head_dim)
        self.block_size = block_size
        self._seqs: dict[int, _Sync] = {}

    @staticmethod
    def bytes_per_block(model_cfg, block_size: int, kv_dtype: str) -> int:
        return PagedKVStore.bytes_per_block(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                                            block_size, kv_dtype)

    def _run(self, runs: list[tuple[SeqChunk, int, list[int]]], last_rows: bool):
        """Forward runs of (chunk, first position, tokens) over the draft store in one batch -> (the logits of each
        run's last row, when last_rows; else None) and the seconds outside attention."""
        token_ids, positions, rows, layouts, chunks = [], [], [], [], []
        for c, start, tokens in runs:
            end = start + len(tokens)
            token_ids += tokens
            positions += range(start, end)
            rows.append(len(token_ids) - 1)
            layouts.append(ChunkLayout(len(tokens), start, c.block_table[:-(-end // self.block_size)], c.seq_id))
            chunks.append((c.seq_id, start, len(tokens), 0))
        self.attn.begin_step(layouts)
        logits, busy_s = self.worker.run(self.attn, token_ids, positions, rows if last_rows else [], chunks)
        return (logits if last_rows else None), busy_s

    def draft(self, inp: StepInput) -> tuple[StepInput, float]:
        """inp with every chunk that has self_draft k turned into one with its k draft tokens (num_draft k), the draft
        model having run the prompt chunks and what the drafting sequences' rows need; and the seconds it spent
        outside attention."""
        for seq_id in inp.freed_seq_ids:
            self._seqs.pop(seq_id, None)
        for c in inp.chunks:
            self._seqs.setdefault(c.seq_id, _Sync(c.start_pos, c.start_pos)).record(c)
        drafting = [c for c in inp.chunks if c.self_draft]
        prompts = [c for c in inp.chunks if len(c.token_ids) > 1 and not c.num_draft]
        busy_s = 0.0
        if prompts:  # the prompt chunks' rows, so that cached prefixes hold draft KV
            runs = [(c, self._seqs[c.seq_id].synced, self._seqs[c.seq_id].missing(c.start_pos + len(c.token_ids)))
                    for c in prompts]
            busy_s += self._run(runs, last_rows=False)[1]
            for c in prompts:
                self._seqs[c.seq_id].advance(c.start_pos + len(c.token_ids))
        if not drafting:
            return inp, busy_s
        runs = [(c, self._seqs[c.seq_id].synced, self._seqs[c.seq_id].missing(c.start_pos + 1)) for c in drafting]
        drafts: dict[int, list[int]] = {c.seq_id: [] for c in drafting}
        for j in range(max(c.self_draft for c in drafting)):
            active = [c for c, _, _ in runs]
            logits, took = self._run(runs, last_rows=True)
            t0 = time.perf_counter()
            tokens = sample_drafts(logits, active, j, drafts)
            busy_s += took + time.perf_counter() - t0
            for c, token in zip(active, tokens):
                drafts[c.seq_id].append(token)
                self._seqs[c.seq_id].tokens.append(token)  # at c.start_pos + j + 1
            runs = [(c, c.start_pos + j + 1, [drafts[c.seq_id][-1]]) for c in active if c.self_draft > j + 1]
        for c in drafting:  # rows written: c.start_pos .. c.start_pos + self_draft - 1 (the last draft's is not)
            self._seqs[c.seq_id].synced = c.start_pos + c.self_draft
        return with_drafts(inp, drafts), busy_s
