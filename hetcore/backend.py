"""The contract between the engine and a backend: one dataclass per direction plus a base class.

Every step the scheduler sends a `StepInput` naming, per sequence, which tokens to run and
where their KV lives; the backend runs them and returns a `StepOutput` with one sampled token
for each sequence whose chunk reached the end of its known tokens, and a `StepTimings` of where
the time went. Every backend subclasses `Backend`, which names each capability the engine uses.
Nothing here imports torch, so the scheduler and its tests run without a model.
"""
from __future__ import annotations

import abc
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from hetcore.kv_policy import KVLayout, KVView


class KVCapacityError(ValueError):
    """The KV capacity is too small to serve (no block, or no min_context sequence with its MagicPIG
    tables): the CLI says so without a traceback."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept; 1 keeps everything."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps everything."""
    seed: int = 0
    """Seed of this request's random stream (drawn at arrival when the client gives none)."""
    logprobs: int | None = None
    """Also return each sampled token's log-probability and the `logprobs` most likely tokens' (None: off)."""
    prompt_logprobs: int | None = None
    """Also score the prompt: each prompt token's log-probability after the tokens before it, and that many
    most likely tokens' (None: off)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the request has sampled so far (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for each time the request has sampled it so far (OpenAI's)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias added to its logit) pairs (OpenAI's logit_bias)."""

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


class TokenMask:
    """The tokens a sequence may sample next (a grammar's mask), packed as llguidance and xgrammar pack it:

        words: int32 [ceil(vocab / 32)]     token t allowed  <=>  bit (t % 32) of words[t // 32] is set

    The engine fills it on a helper thread while the backend's step runs; `words()` waits until it is
    filled. It pickles as its filled words, so it crosses the Ray executor like any array. (This module
    imports neither NumPy nor torch: the words are whatever array the engine fills in.)"""

    def __init__(self, words: np.ndarray | None = None):
        self._words = words
        self._error: str | None = None
        self._ready = threading.Event()
        if words is not None:
            self._ready.set()

    def fill(self, words: np.ndarray) -> None:
        self._words = words
        self._ready.set()

    def fail(self, error: str) -> None:
        """The mask could not be computed: words() raises instead of waiting for ever."""
        self._error = error
        self._ready.set()

    def words(self) -> np.ndarray:
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"token mask not computed: {self._error}")
        assert self._words is not None
        return self._words

    def __reduce__(self):
        return TokenMask, (self.words(),)


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step."""

    seq_id: int
    """Engine-wide sequence id."""
    token_ids: tuple[int, ...]
    """Tokens whose KV is computed this step (a prefill chunk, or the last sampled token)."""
    start_pos: int
    """Position of token_ids[0]; tokens before it are already in the KV store."""
    block_table: tuple[int, ...]
    """Physical KV block ids covering positions [0, start_pos + len(token_ids))."""
    sampling: SamplingParams | None
    """Set when this chunk ends at the sequence's last token: sample the next one."""
    output_index: int = 0
    """Index among the request's outputs of the token to sample (keys its random stream)."""
    output_token_ids: tuple[int, ...] = ()
    """The request's tokens sampled so far, when its sampling has penalties (which count them)."""
    prompt_targets: tuple[int, ...] = ()
    """With prompt_logprobs: the prompt tokens that follow this chunk's first rows, to score there (row i
    predicts the token at start_pos + i + 1)."""
    prompt_top: int = 0
    """With prompt_targets: most likely tokens to list beside each (the request's prompt_logprobs)."""
    allowed_tokens: TokenMask | None = None
    """With sampling, for a request with a grammar (structured outputs): the tokens it may sample; the sampler
    masks the others out before penalties, temperature, top-k and top-p. None: any token."""
    kv_view: KVView | None = None
    """Layered KV sparsity: the chunk's rows in the layer groups past the first (None: one group, block_table)."""
    num_draft: int = 0
    """Speculative decoding: the last num_draft of token_ids are draft tokens, guesses of the tokens after the
    sequence's last one. The backend writes their KV, samples at each of the num_draft + 1 last rows (output
    indices output_index, output_index + 1, ...) and accepts drafts while each equals the token sampled before
    it (StepOutput.accepted). Only a decode chunk (one known token) carries drafts."""
    draft_masks: tuple[TokenMask, ...] = ()
    """With drafts and allowed_tokens: the tokens row 1, 2, ... may sample (a grammar's masks after the drafts
    before each row; allowed_tokens is row 0's)."""
    self_draft: int = 0
    """Speculative decoding with drafts the backend makes (a decode chunk, num_draft 0): first draft this many
    tokens one at a time with the model itself, attending only to the KV view `draft_view` names and sampling
    each as its row will be sampled, then treat them as the chunk's num_draft drafts."""
    draft_view: tuple[int, int] = (0, 0)
    """With self_draft: (sinks, window): a draft step attends to the sequence's first `sinks` and last `window`
    tokens only (whole KV blocks: the blocks that hold them); (0, 0): to all of them."""


@dataclass(frozen=True)
class StepInput:
    chunks: tuple[SeqChunk, ...]
    """Work of this step; decodes and prefill chunks mixed, at most the token budget in total."""
    freed_seq_ids: tuple[int, ...] = ()
    """Sequences finished or preempted since the last step: drop any per-sequence state."""
    moves: tuple[KVMove, ...] = ()
    """Sequences whose KV moves to other blocks before this step runs; only where kv_spec.promote_to is set."""

    @property
    def is_decode(self) -> bool:
        """Every chunk is a sequence's one next token (no prompt chunk, no drafts)."""
        return all(len(c.token_ids) == 1 for c in self.chunks)


@dataclass(frozen=True)
class KVMove:
    """A sequence's first num_tokens positions, KV written, copied from the blocks of src_table to those of
    dst_table (another shard's); its chunks of this step already name dst_table."""

    seq_id: int
    src_table: tuple[int, ...]
    dst_table: tuple[int, ...]
    num_tokens: int


TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]
"""A sampled token's log-probability, and the most likely tokens' (token id, log-probability), best first."""


@dataclass(frozen=True)
class StepTimings:
    """Where one step's wall time went, in seconds, as the backend measured it."""

    accelerator_s: float
    """The model worker: linears, LSH codes and sampling (on Ray, with the waits for attention it cannot overlap)."""
    cpu_attn_s: float
    """Attention and KV writes on the CPU attention workers, summed over the workers."""
    step_s: float
    """The whole step, end to end."""
    cpu_attn_dense_s: float | None = None
    """Of cpu_attn_s, the layers a sparse attention keeps exact (MagicPIG's dense layers); None without one."""
    cpu_attn_max_s: float | None = None
    """The busiest attention worker's cpu_attn_s (Ray executor); None in one process."""
    gpu_attn_s: float | None = None
    """Attention of the sequences whose KV is on the accelerator (--gpu-kv-cache-bytes); None without."""

    def parts(self) -> dict[str, float]:
        """Part name -> seconds of the parts measured, named as /metrics' step_time_seconds{part} labels them."""
        parts = {"accelerator": self.accelerator_s, "cpu_attn": self.cpu_attn_s, "cpu_attn_max": self.cpu_attn_max_s,
                 "cpu_attn_dense": self.cpu_attn_dense_s, "gpu_attn": self.gpu_attn_s, "step": self.step_s}
        return {part: seconds for part, seconds in parts.items() if seconds is not None}


@dataclass(frozen=True)
class StepOutput:
    sampled: dict[int, int]
    """seq_id -> next token, for every chunk that had `sampling` set (after its accepted drafts, if any)."""
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    """seq_id -> the sampled token's logprobs, for the chunks whose sampling asked for them."""
    accepted: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """seq_id -> the draft tokens accepted, which come before sampled[seq_id], for every chunk with drafts."""
    accepted_logprobs: dict[int, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    """seq_id -> each accepted draft token's logprobs, for the chunks with drafts whose sampling asked for them."""
    prompt_logprobs: dict[int, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)
    """seq_id -> (position, logprobs of the prompt token there) for each of its chunk's `prompt_targets`."""
    timings: StepTimings | None = None
    """Where the step's time went, for metrics; None from a backend that does not measure it."""
    virtual_clock_s: float | None = None
    """A simulated backend's virtual clock after this step (seconds since its last reset_clock); None in real time."""
    open_shards: frozenset[int] | None = None
    """The shards new sequences may be placed on after this step (Backend.open_shards), from a backend in another
    process that closes some; None: not said."""


@dataclass(frozen=True)
class KVSpec:
    """KV geometry a backend offers; the scheduler's block manager allocates within it."""

    block_size: int
    """Tokens per block."""
    num_blocks: int
    """Blocks in the store."""
    bytes_per_block: int
    """Bytes one block takes, K and V of every layer, including any scales."""
    shards: tuple[int, ...] = ()
    """Blocks of each CPU attention worker, in block-id order (empty: one store of num_blocks).
    A sequence's blocks all come from one shard."""
    reserve_blocks: int = 0
    """Blocks a sequence also holds, never written, once it has `reserve_from` tokens: the room of
    state its worker keeps beside the KV from then on (MagicPIG's first table set)."""
    reserve_from: int = 0
    own_share: float = 0.0
    """Of a block's bytes, the share that is its holder's own state, not the block's KV (MagicPIG's
    codes of its tokens): a sequence that takes n blocks from the prefix cache also holds
    ceil(n * own_share) blocks, never written, for its copy of that state."""
    first_fit: bool = False
    """A new sequence goes to the first shard, in id order, with room for the blocks it first asks for (the
    accelerator's KV pool before the host's), not to the one with the most room."""
    promote_to: int | None = None
    """A shard that decoding sequences of the others move to (StepInput.moves) once it has room for them and no
    sequence waits: partial offload's accelerator pool. None: a sequence keeps its shard."""
    kv_layout: KVLayout | None = None
    """Layered KV sparsity's layer groups: a block id holds one group's rows, each group past the first has
    its own table (None: a block id holds every layer's rows)."""

    def table_blocks(self, num_tokens: int) -> int:
        """Blocks of a sequence's block table at `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def reserve_for(self, num_tokens: int) -> int:
        return self.reserve_blocks if num_tokens >= self.reserve_from else 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds, its reserve included."""
        return self.table_blocks(num_tokens) + self.reserve_for(num_tokens)

    def own_blocks(self, num_shared: int) -> int:
        """Blocks a sequence holds beside `num_shared` blocks it took from the prefix cache."""
        return math.ceil(num_shared * self.own_share)

    def max_tokens(self, num_blocks: int) -> int:
        """The most tokens a sequence can have in `num_blocks` blocks."""
        tokens = num_blocks * self.block_size
        if self.reserve_blocks and tokens >= self.reserve_from:
            tokens = max(self.reserve_from - 1, (num_blocks - self.reserve_blocks) * self.block_size)
        return tokens


class WorkerLost(RuntimeError):
    """A worker died during a step. `shard` names the CPU attention worker; None means the
    accelerator worker. The step's results are lost; the workers are being restarted."""

    def __init__(self, message: str, shard: int | None = None):
        super().__init__(message)
        self.shard = shard


class Backend(abc.ABC):
    """What the engine asks of a backend. A subclass sets the three attributes in its __init__ and implements
    step() and close(); the optional capabilities below have the defaults of one healthy, real-time worker."""

    kv_spec: KVSpec
    """The KV geometry the scheduler's block manager allocates within."""
    max_model_len: int
    """Longest sequence, prompt plus output, in tokens."""
    model_cfg: Any
    """The served model's configuration (gpu_model.config.ModelConfig: the tokenizer takes its eos_token_ids)."""

    @abc.abstractmethod
    def step(self, inp: StepInput) -> StepOutput:
        """Run `inp`'s chunks and free its finished sequences; raises WorkerLost when a worker dies."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the workers; the backend is not stepped again."""

    def live_shards(self) -> set[int]:
        """The CPU attention shards able to take sequences now: by default every shard of kv_spec."""
        return set(range(len(self.kv_spec.shards) or 1))

    def open_shards(self) -> set[int]:
        """Of the live shards, those new sequences may be placed on now (a backend closes one whose work
        would slow the step down); by default all of them."""
        return self.live_shards()

    def health(self) -> str:
        """"ok", "degraded" (serving, with a CPU attention worker down) or "down" (not serving)."""
        return "ok"

    def reset_clock(self) -> None:
        """Restart a virtual clock from zero (simulated backends); real time has none to reset."""
