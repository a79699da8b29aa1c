"""Speculative decoding in the scheduler: n-gram drafts and the policy that sizes them. Pure Python.

    drafts = NgramDrafter.propose(tokens, k)     the tokens that followed the latest earlier
                                                 occurrence of the sequence's last n tokens
    ks     = SpecPolicy.plan(candidates)         how many drafts each decoding sequence sends

A sequence's decode chunk then carries its drafts (SeqChunk.num_draft), or asks the backend to make
them (SeqChunk.self_draft, server/self_draft.py); the backend samples the target's token at each of
their rows and accepts drafts while each equals the token sampled before it. Every row is sampled as
without speculation (its logits, its output index's random stream), so each emitted token is the one
the model samples there without speculation; only the number of steps changes.

The policy estimates, per sequence, the probability `a` that a draft token is accepted (from the
drafts it sent, and for n-gram drafts also from the proposals it did not send, checked against the
token sampled instead), and from the measured decode step times per number of tokens the cost of
the extra rows; it sends the drafts that raise the expected tokens per second of the step, and none
when nothing does. A step size's cost is the median of its latest steps, but a first step over three
times what the other sizes estimate for it is a stall (a kernel loaded on first use, a busy
neighbour) and counts only from the size's third step on, so that one slow step does not keep a
size from ever being tried again. Per batch size it also compares the tokens per second that steps
with drafts and without have lately given, and drafts only one step in 16 where drafting has not paid.
Drafts the backend makes (self methods, a draft model) are learned only by sending them, so where their
rates alone hold them back, one step in 16 sends each sequence one (SpecPolicy.plan's probe).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

SPECULATIVE_METHODS = ("off", "ngram", "self-sparse", "self-mx", "self-mx-sparse", "draft-model")
DRAFT_WEIGHT_FORMAT = "mxfp4"
"""The weights of the self-mx methods' draft: an MXFP4 copy of the model's linears."""
MAX_SPECULATIVE_TOKENS = 16
TRUSTED_SAMPLES = 3
"""Measurements of a step size after which their median is its cost even where the first looked like a stall."""
STALL_FACTOR = 3.0
"""A step slower than this many times its estimated cost is a stall (a kernel loaded on first use, a busy
neighbour): not yet a size's cost, nor a measure of whether drafts pay."""


@dataclass(frozen=True)
class SpecConfig:
    method: str = "off"
    num_tokens: int = 4
    """Most draft tokens a sequence sends in one step (the policy may send fewer)."""
    ngram_min: int = 2
    """Shortest suffix of the sequence looked up for an earlier occurrence."""
    ngram_max: int = 4
    """Longest suffix looked up (the longest that occurs earlier wins)."""
    draft_sinks: int = 16
    """self-sparse: first tokens a draft step attends to."""
    draft_window: int = 256
    """self-sparse: latest tokens a draft step attends to."""
    draft_model: str | None = None
    """draft-model: the path of the model that drafts (a GGUF file or a Hugging Face directory), sharing the
    target's tokenizer."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, not {self.method!r}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, not {self.num_tokens}")
        if self.draft_sinks < 0 or self.draft_window < 1:
            raise ValueError(f"need speculative_sinks >= 0 and speculative_window >= 1, not {self.draft_sinks} and "
                             f"{self.draft_window}")
        if (self.method == "draft-model") != (self.draft_model is not None):
            raise ValueError("speculative_method draft-model and speculative_model go together: the model that drafts")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, not {self.ngram_min} and {self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def backend_drafts(self) -> bool:
        """The backend makes the drafts (self methods, draft-model), where the model and the KV run."""
        return self.method.startswith("self") or self.method == "draft-model"

    @property
    def draft_view(self) -> tuple[int, int]:
        """(sinks, window) of the KV the backend's draft steps attend to; (0, 0): all of it."""
        return (self.draft_sinks, self.draft_window) if self.method.endswith("sparse") else (0, 0)

    @property
    def draft_weight_format(self) -> str | None:
        """The weight format of a separate draft copy of the model (self-mx methods); None: the model drafts."""
        return DRAFT_WEIGHT_FORMAT if self.method.startswith("self-mx") else None


class NgramDrafter:
    """Prompt lookup: for n from ngram_max down to ngram_min, the latest earlier occurrence of the
    sequence's last n tokens; its continuation (up to k tokens) is the draft.

    Each sequence keeps an index of its n-grams -> latest start, extended by the tokens added since its
    last lookup, so a lookup costs O(new tokens), not O(length)."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._index: dict[int, tuple[int, dict[tuple[int, ...], int]]] = {}
        """seq_id -> (tokens indexed: n-grams ending before it, n-gram -> latest start)."""

    def propose(self, seq_id: int, tokens: list[int], k: int) -> tuple[int, ...]:
        end = len(tokens)
        done, index = self._index.get(seq_id, (0, {}))
        for stop in range(max(done, self.ngram_min), end):  # n-grams ending at stop - 1 < end - 1
            for n in range(self.ngram_min, min(self.ngram_max, stop) + 1):
                index[tuple(tokens[stop - n:stop])] = stop - n
        self._index[seq_id] = (max(done, end), index)
        for n in range(min(self.ngram_max, end - 1), self.ngram_min - 1, -1):
            start = index.get(tuple(tokens[end - n:]))
            if start is not None:
                return tuple(tokens[start + n:start + n + k])
        return ()

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


@dataclass
class _Acceptance:
    """Decayed counts of draft tokens accepted and of drafts rejected (the trial that ended a run)."""

    accepted: float = 1.0
    rejected: float = 1.0  # a prior of a = 0.5 worth two tokens

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, accepted: int, rejected: int, decay: float = 0.9) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + rejected


@dataclass
class SpecPolicy:
    """Draft lengths per step from each sequence's acceptance rate and the measured decode step cost."""

    max_tokens: int
    samples: dict[int, deque[float]] = field(default_factory=dict)
    """The latest decode-only steps' seconds by their number of tokens."""
    step_s: dict[int, float] = field(default_factory=dict)
    """The median of each size's samples (observe_step says which sizes have one)."""
    seqs: dict[int, _Acceptance] = field(default_factory=dict)
    outcomes: dict[tuple[int, bool], tuple[float, float, int]] = field(default_factory=dict)
    """(sequences, with drafts) -> decayed (tokens emitted, seconds) of decode-only steps, and how many steps: the
    check that the cost model's choices pay in the end."""
    min_outcomes: int = 8
    """Drafted steps of a batch size seen before the check may stop drafting at that size."""
    explore_every: int = 16
    """While drafting has not paid at a batch size, one step in this many may draft anyway (text changes)."""
    _blocked_steps: dict[int, int] = field(default_factory=dict)
    _declined_steps: dict[int, int] = field(default_factory=dict)
    """Per batch size, the steps whose plan sent no drafts (probe, in plan)."""
    probed: bool = False
    """Whether the last plan's drafts are a probe (plan): its step is left out of the outcomes (observe_outcome)."""
    free_drafts: bool = False
    """Every step size costs the same (assume_free_drafts)."""
    unmeasured_row_cost: float = 0.01
    """Extra cost of a row of a step size not measured yet, relative to the nearest smaller one measured: low,
    so that an unmeasured size is tried and measured. A row's true share falls with the batch and the context
    (~18 % of a one-sequence step at 256 tokens, ~2 % of a 16-sequence step at 8k, both on 2 Zen 4 cores): a
    prior above the latter kept 16 sequences at 8k from ever drafting, where drafts doubled the speed."""

    def rate(self, seq_id: int) -> float:
        return self.seqs.setdefault(seq_id, _Acceptance()).rate

    def observe_drafts(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A step verified `proposed` drafts of the sequence and accepted the first `accepted`."""
        if proposed:
            self.seqs.setdefault(seq_id, _Acceptance()).observe(accepted, int(accepted < proposed))

    def observe_outcome(self, num_seqs: int, num_tokens: int, emitted: int, seconds: float, decay: float = 0.9) -> None:
        """A decode-only step of num_seqs sequences and num_tokens tokens (drafts included) emitted `emitted` tokens in
        `seconds` (before observe_step has seen it). A stall (over STALL_FACTOR times the step's estimated cost: a
        kernel loaded on first use, a busy neighbour) is left out: it says nothing of whether drafts pay, and one
        could hold drafting back for hundreds of steps. So is a probe's step (one draft a sequence, sent to learn the
        rates, not because it pays): counted, such steps kept backend drafts from the steps they pay in."""
        drafted = num_tokens > num_seqs
        if seconds > STALL_FACTOR * self.cost(num_tokens) or (drafted and self.probed):
            return
        tokens, secs, count = self.outcomes.get((num_seqs, drafted), (0.0, 0.0, 0))
        self.outcomes[num_seqs, drafted] = (tokens * decay + emitted, secs * decay + seconds, count + 1)

    def drafting_pays(self, num_seqs: int) -> bool:
        """Steps of num_seqs sequences emitted at least as many tokens a second with drafts as without, lately (or
        fewer than min_outcomes drafted steps, or no step without drafts, have been seen)."""
        with_, without = self.outcomes.get((num_seqs, True)), self.outcomes.get((num_seqs, False))
        if not with_ or not without or with_[2] < self.min_outcomes:
            return True
        return with_[0] / with_[1] >= without[0] / without[1]

    def observe_step(self, num_tokens: int, seconds: float, keep: int = 9) -> None:
        """A decode-only step of num_tokens tokens took `seconds`. The size's cost becomes the median of its latest
        steps, except while that is a stall (over STALL_FACTOR times what the other sizes' costs estimate for it)
        measured fewer than TRUSTED_SAMPLES times."""
        kept = self.samples.setdefault(num_tokens, deque(maxlen=keep))
        kept.append(seconds)
        median = statistics.median(kept)
        if len(kept) >= TRUSTED_SAMPLES or num_tokens in self.step_s or median <= STALL_FACTOR * self.cost(num_tokens):
            self.step_s[num_tokens] = median

    def assume_free_drafts(self) -> None:
        """Price every step size the same until reset_costs, so that plan sends all the drafts it can (the warm-up:
        its drafted steps compile or load the verification kernels before a client's step does)."""
        self.free_drafts = True

    def reset_costs(self) -> None:
        """Forget the step times measured (the warm-up's include compiling kernels)."""
        self.free_drafts = False
        self.samples.clear()
        self.step_s.clear()
        self.outcomes.clear()

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def cost(self, num_tokens: int) -> float:
        """Seconds of a decode-only step of `num_tokens` tokens: measured, else interpolated between the
        nearest measured sizes, else the nearest smaller one's plus unmeasured_row_cost a row (plan measures
        the draft-free size first, so a smaller one is there); at most what any larger size measured (fewer
        tokens never cost more, so one slow step does not price a size above its neighbours for long)."""
        if self.free_drafts:
            return 1.0
        below, above, larger = None, None, float("inf")  # one pass: plan asks for a cost per draft it weighs
        for n, seconds in self.step_s.items():
            if n < num_tokens and (below is None or n > below):
                below = n
            elif n > num_tokens:
                larger = min(larger, seconds)
                above = n if above is None or n < above else above
        if num_tokens in self.step_s:
            estimate = self.step_s[num_tokens]
        elif below is None:
            estimate = self.step_s[above] if above is not None else 1.0
        elif above is None:
            estimate = self.step_s[below] * (1 + self.unmeasured_row_cost * (num_tokens - below))
        else:
            w = (num_tokens - below) / (above - below)
            estimate = self.step_s[below] * (1 - w) + self.step_s[above] * w
        return min(estimate, larger)

    def plan(self, base_tokens: int, base_outputs: int, candidates: list[tuple[float, int]], budget: int,
             probe: bool = False) -> list[int]:
        """candidates: (acceptance rate, drafts available) per sequence that could speculate; base_tokens and
        base_outputs: the step's tokens and sampled tokens without drafts; budget: most draft tokens in all ->
        drafts each candidate sends.

        Drafts go one at a time to the sequence whose next draft is likeliest to be accepted (the i-th
        draft of a sequence with rate a adds a**i expected tokens); of all totals, the one with the most
        expected tokens per second of step wins (zero drafts included). No drafts until a step of base_tokens
        tokens has been measured: an estimated baseline could make every draft look worth it. And while the steps
        of base_outputs sequences that drafted have lately emitted fewer tokens a second than those that did not
        (drafting_pays), drafts go out only one step in explore_every.

        With `probe` (drafts the backend makes, whose acceptance is learned only by sending them), where the rates
        make no draft worth it but drafts that were always accepted would be (would_pay), one step in
        explore_every sends each candidate one draft: otherwise a sequence whose first drafts failed (a rate
        fallen from its prior) would never draft again, however well it would draft later."""
        ks = [0] * len(candidates)
        self.probed = False
        if not candidates or budget <= 0 or base_tokens not in self.step_s:
            return ks  # a step of this size without drafts is measured first: the baseline drafts must beat
        if not self.drafting_pays(base_outputs):
            blocked = self._blocked_steps[base_outputs] = self._blocked_steps.get(base_outputs, 0) + 1
            if blocked % self.explore_every:
                return ks
        best_total, best_value = 0, base_outputs / self.cost(base_tokens)
        gained, order = 0.0, []
        heads = [(a, 0, i) for i, (a, avail) in enumerate(candidates) if avail > 0]
        while heads and len(order) < budget:
            j = max(range(len(heads)), key=lambda h: heads[h][0] ** (heads[h][1] + 1))
            a, k, i = heads[j]
            gained += a ** (k + 1)
            order.append(i)
            if k + 1 < min(candidates[i][1], self.max_tokens):
                heads[j] = (a, k + 1, i)
            else:
                heads.pop(j)
            value = (base_outputs + gained) / self.cost(base_tokens + len(order))
            if value > best_value:
                best_total, best_value = len(order), value
        for i in order[:best_total]:
            ks[i] += 1
        if probe and not best_total:
            declined = self._declined_steps[base_outputs] = self._declined_steps.get(base_outputs, 0) + 1
            if declined % self.explore_every == 0:
                drafting = [i for i, (_, avail) in enumerate(candidates) if avail > 0][:budget]
                if self.would_pay(base_tokens, base_outputs, len(drafting)):
                    self.probed = True
                    for i in drafting:
                        ks[i] = 1
        return ks

    def would_pay(self, base_tokens: int, base_outputs: int, num_drafting: int) -> bool:
        """Whether `num_drafting` sequences sending k drafts each, every one accepted, would emit more tokens a second
        than the step without drafts, for some k up to max_tokens."""
        base = base_outputs / self.cost(base_tokens)
        return any((base_outputs + num_drafting * k) / self.cost(base_tokens + num_drafting * k) > base
                   for k in range(1, self.max_tokens + 1))
