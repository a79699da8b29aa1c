"""Continuous batching: who runs each step, with how many tokens. Pure Python.

Every step: running sequences first (a decode takes one token, an unfinished prefill the
next chunk), then waiting sequences are admitted while the token budget, the running limit
and KV blocks allow. When a running sequence needs a block and none is free, the most
recently arrived running sequence (of the same KV shard) is preempted: its blocks are freed and it goes back to the
front of the queue, to be recomputed from its prompt plus what it has generated so far.

With speculative decoding (server/speculative.py), a decoding sequence's chunk may also carry draft
tokens after its last one; they take KV blocks and token budget for the step (never a preemption),
and only the ones the backend accepts are added to the sequence, so blocks are registered in the
prefix cache only once filled with accepted tokens.

With prefix caching, a sequence admitted with nothing computed first takes the cached blocks of
its longest cached run of full blocks (server/block_manager.py), and starts its prefill after
them; every block a step fills is registered for later sequences as it is scheduled.
"""
from __future__ import annotations

import enum
import hashlib
from array import array
from collections import deque
from dataclasses import dataclass, field

from hetcore.backend import KVMove, SamplingParams, SeqChunk, StepInput, StepOutput
from server.block_manager import BlockManager
from server.speculative import NgramDrafter, SpecConfig, SpecPolicy

SELF_DRAFT = -1
"""A draft token the backend makes itself (speculative method self-sparse), in the scheduler's own bookkeeping."""


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose KV is in the store."""
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when it was first admitted."""
    num_registered: int = 0
    """Blocks of its table that are in the prefix cache (shared, or registered by it)."""
    max_tokens: int = 2**31
    """Most output tokens it may have (its request's max_tokens): no draft goes past it."""
    speculate: bool = True
    """May send draft tokens (off for a request whose grammar masks each token)."""
    _keys: list[bytes] = field(default_factory=list, repr=False)

    def block_keys(self, num_blocks: int, block_size: int) -> list[bytes]:
        """Keys of its first `num_blocks` full blocks: each a hash of the key before it and the block's
        tokens, so it names every token from the first to the block's last (BLAKE2b: a client cannot
        make two different prefixes share a key)."""
        while len(self._keys) < num_blocks:
            i = len(self._keys)
            tokens = array("q", self.token_slice(i * block_size, (i + 1) * block_size)).tobytes()
            self._keys.append(hashlib.blake2b((self._keys[-1] if i else b"") + tokens, digest_size=16).digest())
        return self._keys[:num_blocks]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are asked for and not all computed yet (until its first token)."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return tuple(self.prompt_token_ids[start:stop])
        return tuple((self.prompt_token_ids + self.output_token_ids)[start:stop])


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most sequences in the running batch."""
    max_num_batched_tokens: int = 512
    """Token budget of one step: decodes plus prefill chunks."""
    prefix_caching: bool = False
    """Reuse the KV blocks of earlier sequences' identical prefixes."""
    speculative: SpecConfig = SpecConfig()
    """Speculative decoding: how decoding sequences draft tokens (off by default)."""


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager):
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_moves = 0
        """Sequences moved to the KVSpec.promote_to shard (StepInput.moves)."""
        self._freed: list[int] = []
        self._scheduled: list[tuple[Sequence, int, tuple[int, ...]]] = []
        """(sequence, tokens of its own scheduled, draft tokens after them) of the step in flight."""
        self.too_long: list[Sequence] = []
        """Sequences that cannot fit the whole KV store even alone; the engine ends them."""
        spec = cfg.speculative
        self.drafter = NgramDrafter(spec.ngram_min, spec.ngram_max) if spec.method == "ngram" else None
        self.policy = SpecPolicy(spec.num_tokens)
        self._unsent: dict[int, int] = {}
        """seq_id -> the first token of a proposal the policy did not send this step (checked against the
        token sampled instead: an acceptance trial at no cost)."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        """Totals: steps with drafts of a sequence, draft tokens sent, draft tokens accepted (/metrics)."""

    def reset_counters(self) -> None:
        """Start the speculation counters and the measured step costs from zero."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.policy.reset_costs()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Sequences to run, or released ones the backend has not been told of yet (the next step
        does, so their per-sequence state, e.g. ~200 MB of MagicPIG tables at 8k, goes too)."""
        return bool(self.waiting or self.running or self._freed)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence for good (done, aborted or failed) and release its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)
        self.policy.forget(seq.seq_id)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        self._freed.append(seq.seq_id)
        seq.num_computed = seq.num_registered = 0

    def _share_prefix(self, seq: Sequence) -> None:
        """Start a sequence that holds no blocks after its cached prefix. At least its last token is
        computed (its logits give the next token); a prompt to be scored is computed whole."""
        if not self.cfg.prefix_caching or seq.num_computed or seq.scores_prompt:
            return
        bs = self.blocks.spec.block_size
        hit = self.blocks.share_prefix(seq.seq_id, seq.block_keys((seq.num_tokens - 1) // bs, bs))
        seq.num_computed, seq.num_registered = hit * bs, hit

    def _unshare(self, seq: Sequence) -> None:
        """Undo _share_prefix for a sequence that is not admitted after all."""
        if seq.num_computed:
            self.blocks.free(seq.seq_id)
            seq.num_computed = seq.num_registered = 0

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.status = SeqStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def preempt_all(self) -> None:
        """Send every running sequence back to the queue (a worker died mid-step)."""
        while self.running:
            self._preempt(self.running[-1])
        self._scheduled = []

    def _promote(self) -> tuple[KVMove, ...]:
        """With a shard that sequences move to once it has room (KVSpec.promote_to: partial offload's accelerator
        pool) and no sequence waiting for room: move there the decoding sequence of another shard with the most
        KV that fits with a block to spare for each sequence already there. One a step: the copy is part of it."""
        target = self.blocks.spec.promote_to
        if target is None or self.waiting:
            return ()
        there = sum(self.blocks.shard_of(s.seq_id) == target for s in self.running)
        decoding = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        for seq in sorted(decoding, key=lambda s: -s.num_computed):
            if self.blocks.can_move(seq.seq_id, target, spare=there + 1):
                src, dst = self.blocks.move(seq.seq_id, target)
                self.num_moves += 1
                return (KVMove(seq.seq_id, src, dst, seq.num_computed),)
        return ()

    def _drafts(self, budget: int) -> dict[int, tuple[int, ...]]:
        """seq_id -> the draft tokens it sends this step, for the running sequences in decode that the
        policy lets speculate within `budget` tokens and that have room for them without a preemption. With a
        method whose drafts the backend makes (self-sparse), the tokens are SELF_DRAFT placeholders (_chunk
        turns them into SeqChunk.self_draft)."""
        self._unsent = {}
        if not self.cfg.speculative.enabled:
            return {}
        spec, base_tokens, decoding = self.cfg.speculative, 0, []
        for seq in self.running:
            left = seq.num_tokens - seq.num_computed
            base_tokens += left
            if left == 1 and seq.num_computed and seq.speculate:
                k = min(spec.num_tokens, seq.max_tokens - len(seq.output_token_ids) - 1)
                if k <= 0:
                    continue
                if self.drafter is None:
                    proposal = (SELF_DRAFT,) * k
                else:
                    proposal = self.drafter.propose(seq.seq_id, seq.prompt_token_ids + seq.output_token_ids, k)
                if proposal:
                    decoding.append((seq, proposal))
        if not decoding:
            return {}
        outputs = sum(seq.num_tokens - seq.num_computed == 1 for seq in self.running)
        ks = self.policy.plan(base_tokens, outputs, [(self.policy.rate(s.seq_id), len(p)) for s, p in decoding],
                              budget - base_tokens, probe=self.drafter is None)
        drafts = {}
        for (seq, proposal), k in zip(decoding, ks):
            if k and self.blocks.can_hold(seq.seq_id, seq.num_computed + 1 + k):
                drafts[seq.seq_id] = proposal[:k]
            elif self.drafter is not None:
                self._unsent[seq.seq_id] = proposal[0]
        return drafts

    def _chunk(self, seq: Sequence, n: int, drafts: tuple[int, ...] = ()) -> SeqChunk:
        stop = seq.num_computed + n
        table = self.blocks.allocate(seq.seq_id, stop + len(drafts))
        self._scheduled.append((seq, n, drafts))
        bs = self.blocks.spec.block_size
        if self.cfg.prefix_caching and stop // bs > seq.num_registered:
            self.blocks.register(seq.seq_id, seq.block_keys(stop // bs, bs), seq.num_registered)
            seq.num_registered = stop // bs
        is_last = stop == seq.num_tokens
        penalized = is_last and seq.sampling.has_penalties
        self_draft = len(drafts) if drafts and drafts[0] == SELF_DRAFT else 0
        spec = self.cfg.speculative
        start, num_prompt = seq.num_computed, len(seq.prompt_token_ids)
        scored = seq.scores_prompt
        return SeqChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_slice(seq.num_computed, stop) + (() if self_draft else drafts),
            start_pos=seq.num_computed,
            block_table=table,
            sampling=seq.sampling if is_last else None,
            output_index=len(seq.output_token_ids),
            output_token_ids=tuple(seq.output_token_ids) if penalized else (),
            prompt_targets=tuple(seq.prompt_token_ids[start + 1 : min(stop, num_prompt - 1) + 1]) if scored else (),
            prompt_top=seq.sampling.prompt_logprobs if scored else 0,
            kv_view=self.blocks.advance(seq.seq_id, stop, seq.num_tokens),
            num_draft=0 if self_draft else len(drafts),
            self_draft=self_draft,
            draft_view=spec.draft_view if self_draft else (0, 0),
        )

    def schedule(self) -> StepInput:
        # blocks registered for a step that never came back to update() (it failed) may lack their KV
        self.blocks.forget_uncommitted()
        budget = self.cfg.max_num_batched_tokens
        chunks: list[SeqChunk] = []
        self._scheduled = []
        moves = self._promote()
        drafts = self._drafts(budget)
        is_preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.blocks.can_hold(seq.seq_id, seq.num_computed + n):
                is_preempted = True
                shard = self.blocks.shard_of(seq.seq_id)
                same = [s for s in self.running if self.blocks.shard_of(s.seq_id) == shard]
                if same == [seq]:
                    # alone in its shard and still too big: it can never fit
                    self.running.remove(seq)
                    self._release(seq)
                    seq.status = SeqStatus.FINISHED
                    self.too_long.append(seq)
                    break
                self._preempt(same[-1])  # the latest arrival sharing its KV memory
                if same[-1] is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            draft = drafts.get(seq.seq_id, ())
            if draft and not self.blocks.can_hold(seq.seq_id, seq.num_computed + n + len(draft)):
                draft = ()  # a preemption above took the room it had
            chunks.append(self._chunk(seq, n, draft))
            budget -= n + len(draft)
            i += 1
        while self.waiting and budget > 0 and not is_preempted and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            self._share_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            reserve = self.blocks.admission_reserve(seq.seq_id, seq.num_tokens, n, len(self.running))
            if not self.blocks.can_hold(seq.seq_id, seq.num_computed + n, reserve, place_tokens=seq.num_tokens):
                self._unshare(seq)
                n = min(seq.num_tokens, budget)
                if self.blocks.num_missing(seq.seq_id, seq.num_computed + n) > self.blocks.max_seq_blocks:
                    self.waiting.popleft()
                    seq.status = SeqStatus.FINISHED
                    self.too_long.append(seq)
                    continue
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if self.cfg.prefix_caching:
                self.blocks.queried_tokens += seq.num_tokens
                self.blocks.hit_tokens += seq.num_computed
                if not seq.num_preemptions:
                    seq.num_cached_tokens = seq.num_computed
            chunks.append(self._chunk(seq, n))
            budget -= n
        freed, self._freed = tuple(self._freed), []
        return StepInput(chunks=tuple(chunks), freed_seq_ids=freed, moves=moves)

    def update(self, out: StepOutput) -> list[tuple[Sequence, int]]:
        """Apply a step's results; returns (sequence, new token) for every new token, a sequence's in order
        (its accepted drafts, then the token sampled after them)."""
        self.blocks.commit()
        new_tokens = []
        for seq, n, drafts in self._scheduled:
            seq.num_computed += n
            token = out.sampled.get(seq.seq_id)
            if token is None:
                continue
            accepted = out.accepted.get(seq.seq_id, ()) if drafts else ()
            seq.num_computed += len(accepted)  # their KV was written by this step; the rejected drafts' is ignored
            seq.output_token_ids.extend(accepted)
            seq.output_token_ids.append(token)
            new_tokens.extend((seq, t) for t in (*accepted, token))
            if drafts:
                self.policy.observe_drafts(seq.seq_id, len(drafts), len(accepted))
                self.num_drafts += 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(accepted)
            elif seq.seq_id in self._unsent:
                self.policy.observe_drafts(seq.seq_id, 1, int(self._unsent[seq.seq_id] == token))
        if out.timings is not None and self._scheduled and all(n == 1 for _, n, _ in self._scheduled):
            num_tokens = sum(1 + len(d) for _, _, d in self._scheduled)
            self.policy.observe_outcome(len(self._scheduled), num_tokens, len(new_tokens), out.timings.step_s)
            self.policy.observe_step(num_tokens, out.timings.step_s)
        self._scheduled = []
        return new_tokens
