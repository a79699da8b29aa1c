"""Layered KV sparsity: which layers keep every token, how many the others keep, and how the rows of
a sequence's sparse layers are counted. Pure Python: the block manager and the attention worker
both run these rules, so they agree on every table's length without asking each other.

Layers are split into groups of `slots` layers each (vLLM's hybrid allocator): layers with the same
budget share a group, and one block id holds `block_size` rows of every layer of the group that
owns it. Group 0 is the first `full_layers` layers' (their table is the sequence's block_table);
the other groups are the sparse layers', deepest last, each with its own table (KVView).

    30 layers, full_layers 3  ->  slots 3 (gcd(3, 27)), groups 0..9
    group 0: layers 0-2   full       table grows with the sequence
    group 1: layers 3-5   budget B1  table holds at most budget + evict_slack rows
    ...
    group 9: layers 27-29 budget B9

A sparse group's rows are the tokens its layers still hold, kept in position order: row r of a
layer and kv-head is the r-th kept token, not position r. Rules (SeqRows):
  - a chunk's tokens are appended after the rows already held (the table grows to hold them);
  - a chunk that ends at the sequence's last known token (a prompt's last chunk, every decode)
    evicts down to the budget when more than budget + evict_slack rows are held: sinks, the
    recent window and the highest-scoring rest are kept. Before a prompt's last chunk nothing is
    evicted, so the prompt's own attention is exact (chunked prefill included), unless
    prefill_evict: then every chunk may evict, and later chunks attend to the rows kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

KV_POLICIES = ("full", "layered")
WINDOW_RATIO = 0.364
"""The default recent window, as a share of a sparse layer's budget (docs/kv-policy.md: measured at 8k)."""
BUDGET_RATIO = 0.25
"""The default budget of a sparse layer, as a share of the sequence's prompt."""
BUDGET_SCHEDULES = ("flat", "pyramid")
PYRAMID_SPREAD = 0.5
"""pyramid: the shallowest sparse group keeps (1 + spread) x the budget, the deepest (1 - spread) x, linear between
(PyramidKV's shape; the mean over groups is the flat budget)."""


class KVPolicyError(ValueError):
    """Settings of the KV policy that cannot work with this model (one line, for the CLI)."""


@dataclass(frozen=True)
class KVPolicy:
    """How many tokens each layer's KV keeps."""

    kind: str = "full"
    """full (every layer keeps every token) or layered (full_layers keep all, the rest a budget)."""
    full_layers: int | None = 3
    """layered: the first layers that keep every token; None: chosen from the model's attention profile
    (cpu_attn/attention_profile.py) by whoever loads the model, with `with_full_layers`, before `layout`."""
    budget_tokens: int | None = None
    """layered: rows a sparse layer keeps per sequence (None: budget_ratio)."""
    budget_ratio: float | None = None
    """layered: rows a sparse layer keeps, as a share of the sequence's prompt (None with budget_tokens; BUDGET_RATIO
    when neither is given)."""
    schedule: str = "flat"
    """flat (one budget for all sparse layers) or pyramid (falling with depth, same mean)."""
    window: int | None = None
    """layered: the latest tokens always kept (None: window_ratio of the budget)."""
    sinks: int = 4
    """layered: the first tokens always kept."""
    observe: int = 1024
    """layered: the prompt's last queries whose attention scores the tokens (SnapKV's observation window), over as
    many prompt chunks as they span (without prefill_evict)."""
    chunk_observe: int = 64
    """layered, with prefill_evict: each prompt chunk's last queries whose attention scores the rows (each chunk's
    eviction needs scores of its own). These are attended explicitly, about 1.7x a flash kernel's time per
    query: 64 of each 512-token chunk measured +1.05 % perplexity at 8k against +0.96 % with all of them
    (docs/kv-policy.md)."""
    evict_slack: int = 64
    """layered: rows over the budget a sparse layer may hold before it evicts (eviction runs once per this many
    decode steps, not every step: each one moves most of a sequence's rows, docs/kv-policy.md)."""
    prefill_evict: bool = False
    """layered, with budget_tokens: evict after every prompt chunk too, so a long prompt's sparse layers never
    hold more than budget + slack + a chunk's rows; later chunks then attend only to the rows kept (an
    approximation of the prompt's own attention). Off: a prompt's attention is exact, and it holds every row in
    every layer until its last chunk."""
    score_pool: int = 31
    """layered: an eviction at a prompt's end (or after a prompt chunk) ranks each row by the larger of its own
    score and the mean score of this many rows around it (odd; SnapKV's pooling, kept from hiding a row's own
    peak), and the kept rows carry that on; evictions while decoding rank the scores as they are (H2O). A token
    beside ones the prompt's last queries looked at stays with them: the rest of a number, a name, a key.
    1: each row by its own score."""
    focus: int = 32
    """layered: the prompt's last queries (of its last chunk's observing ones) that rank its tokens a second time,
    at the prompt's end (0: off). With
    it, the `observe` queries' scores rank each row by its own score, the `focus` queries' scores pooled
    (score_pool), and a row ranks by the larger of the two, the focus scores scaled to the same total: the last
    queries (a question) name what a retrieval needs, the wider window what a continuation looks back at."""
    window_ratio: float | None = None
    """layered: the latest tokens always kept, as a share of each sparse layer's budget (rounded down, at least
    one; None with window; WINDOW_RATIO when neither is given): a window that grows with the budget, and the
    budget with the prompt."""
    score_decay: float = 1.0
    """layered: each decode step multiplies the scores so far by this before adding its own (1: H2O's plain sum;
    below 1 the recent queries' attention counts more)."""

    def __post_init__(self) -> None:
        checks = [
            (self.kind in KV_POLICIES, f"kv_policy must be one of {', '.join(KV_POLICIES)}, not {self.kind!r}"),
            (self.schedule in BUDGET_SCHEDULES,
             f"kv_budget_schedule must be one of {', '.join(BUDGET_SCHEDULES)}, not {self.schedule!r}"),
            (self.budget_tokens is None or self.budget_ratio is None,
             "give kv_budget_tokens or kv_budget_ratio, not both"),
            (self.budget_tokens is None or self.budget_tokens > 0, "kv_budget_tokens must be positive"),
            (self.budget_ratio is None or 0 < self.budget_ratio <= 1, "kv_budget_ratio must be in (0, 1]"),
            (self.window is None or self.window_ratio is None, "give kv_window or kv_window_ratio, not both"),
            ((self.window is None or self.window >= 1) and self.sinks >= 0, "kv_window must be >= 1 and kv_sinks >= 0"),
            (self.window_ratio is None or 0 < self.window_ratio < 1, "kv_window_ratio must be in (0, 1)"),
            (min(self.observe, self.chunk_observe, self.evict_slack) >= 1,
             "kv observe windows and evict slack must be >= 1"),
            (0 < self.score_decay <= 1, "kv score decay must be in (0, 1]"),
            (self.focus >= 0, "kv focus must be >= 0"),
            (self.score_pool >= 1 and self.score_pool % 2 == 1, "kv score pool must be an odd count of rows"),
        ]
        for ok, message in checks:
            if not ok:
                raise KVPolicyError(message)

    @property
    def is_layered(self) -> bool:
        return self.kind == "layered"

    @property
    def evicts_in_prompt(self) -> bool:
        """prefill_evict in effect: a budget in tokens is known before a prompt's end (a ratio needs its length)."""
        return self.prefill_evict and self.budget_tokens is not None

    def window_rows(self, budget: int) -> int:
        """The recent window of a sparse layer that keeps `budget` rows."""
        if self.window is not None:
            return self.window
        return max(1, int((self.window_ratio or WINDOW_RATIO) * budget))

    @property
    def least_budget(self) -> int:
        """The fewest rows a sparse layer keeps: room for the sinks and the window (window_rows of it)."""
        if self.window is not None:
            return self.sinks + self.window
        return max(self.sinks + 1, math.ceil(self.sinks / (1 - (self.window_ratio or WINDOW_RATIO))))

    def with_full_layers(self, count: int) -> KVPolicy:
        return replace(self, full_layers=count)

    def layout(self, num_layers: int, max_model_len: int) -> KVLayout:
        """The groups of a model of `num_layers` layers; refuses settings that cannot hold (one line each)."""
        if not self.is_layered:
            return KVLayout(num_layers, num_layers, (None,), self)
        n = self.full_layers
        if n is None:
            raise KVPolicyError("kv_full_layers is not chosen yet (with_full_layers, from the attention profile)")
        if not 1 <= n <= num_layers:
            raise KVPolicyError(f"kv_full_layers {n} is outside 1..{num_layers} (the model has {num_layers} layers)")
        if self.budget_tokens is not None and self.budget_tokens > max_model_len:
            raise KVPolicyError(f"kv_budget_tokens {self.budget_tokens} is larger than the context "
                                f"({max_model_len} tokens)")
        slots = math.gcd(n, num_layers - n) if n < num_layers else num_layers
        num_sparse = (num_layers - n) // slots
        factors = tuple(self._factor(g, num_sparse) for g in range(num_sparse))
        layout = KVLayout(num_layers, slots, (None,) * (n // slots) + factors, self)
        if self.budget_tokens is not None and num_sparse:
            least = min(math.ceil(f * self.budget_tokens) for f in factors)
            if self.sinks + self.window_rows(least) > least:
                raise KVPolicyError(f"kv_window {self.window_rows(least)} plus kv_sinks {self.sinks} is larger than "
                                    f"the smallest layer budget ({least} tokens)")
        return layout

    def _factor(self, g: int, num_sparse: int) -> float:
        if self.schedule == "flat" or num_sparse == 1:
            return 1.0
        return 1 + PYRAMID_SPREAD * (1 - 2 * g / (num_sparse - 1))


@dataclass(frozen=True)
class KVLayout:
    """The layer groups of one model under one policy. `factors[g]` is None for a full group, else the
    group's share of the policy's budget (1 with the flat schedule)."""

    num_layers: int
    slots: int
    """Layers per group: a block id holds one block of rows for each."""
    factors: tuple[float | None, ...]
    policy: KVPolicy

    @property
    def num_groups(self) -> int:
        return len(self.factors)

    @property
    def is_layered(self) -> bool:
        return self.num_groups > 1

    def group_of(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a layer."""
        return layer // self.slots, layer % self.slots

    def is_sparse(self, group: int) -> bool:
        return self.factors[group] is not None

    def evicting_prompt(self) -> int:
        """A prompt length whose end evicts in every sparse group under a budget in tokens (a server's warm-up
        request of it meets the eviction kernels); 0 without sparse groups or with a budget ratio (a short prompt
        evicts)."""
        p = self.policy
        if not self.is_layered or p.budget_tokens is None:
            return 0
        return max(self.budget(g, 0) for g in range(self.num_groups) if self.is_sparse(g)) + p.evict_slack + 1

    def budget(self, group: int, prompt_tokens: int) -> int:
        """Rows a sparse group keeps for a sequence whose prompt (its first prefill) had `prompt_tokens`."""
        p = self.policy
        base = p.budget_tokens if p.budget_tokens is not None else (p.budget_ratio or BUDGET_RATIO) * prompt_tokens
        return max(p.least_budget, math.ceil(self.factors[group] * base))


@dataclass(frozen=True)
class KVView:
    """A chunk's rows in the groups past the first (SeqChunk.kv_view), one entry per group 1, 2, ...:
    where its layers' KV lives and how many rows they hold before and after the step."""

    tables: tuple[tuple[int, ...], ...]
    """Each group's block ids, covering rows [0, rows_before + the chunk's tokens)."""
    rows_before: tuple[int, ...]
    """Rows held before this chunk (its tokens are written at rows_before, rows_before + 1, ...)."""
    keep_after: tuple[int, ...]
    """Rows kept after the step: rows_before + the chunk's tokens, or fewer when the step evicts."""
    observed: int = 0
    """Of a prompt chunk's tokens, the last ones whose queries score the rows (KVPolicy.observe)."""


class SeqRows:
    """One sequence's row counts in every group past the first, advanced chunk by chunk (the rules in
    the module docstring)."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.rows = [0] * (layout.num_groups - 1)
        self.prompt_tokens = 0
        """Tokens of its first prefill (set at its first chunk that ends at its last token)."""
        self.num_tokens = 0

    def caps(self) -> list[int]:
        """Rows each group keeps room for once it may evict: budget + slack + 1 for a sparse group (the most it
        holds: it evicts on passing budget + slack; its table never shrinks below that, so a decoding sequence
        does not give back and take again a block every evict_slack steps), 0 for a full one or while a ratio
        budget's prompt length is unknown."""
        p, out = self.layout.policy, []
        known = self.prompt_tokens or (p.budget_tokens is not None)
        for i in range(len(self.rows)):
            sparse = self.layout.is_sparse(i + 1) and known
            out.append(self.layout.budget(i + 1, self.prompt_tokens) + p.evict_slack + 1 if sparse else 0)
        return out

    def peak(self, num_tokens: int, chunk: int) -> list[int]:
        """The most rows each group holds while a prompt of `num_tokens` is prefilled `chunk` tokens a step
        (from no rows)."""
        p = self.layout.policy
        return [min(num_tokens, self.layout.budget(i + 1, num_tokens) + p.evict_slack + chunk)
                if p.evicts_in_prompt and self.layout.is_sparse(i + 1) else num_tokens for i in range(len(self.rows))]

    def needed(self, num_new: int) -> list[int]:
        """Rows each group must have room for to take `num_new` more tokens."""
        return [r + num_new for r in self.rows]

    def advance(self, num_new: int, end: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Take a chunk of `num_new` tokens of a prefill (or decode) that runs to token `end` (the chunk is the
        last when it reaches it) -> (rows_before, keep_after, observed: of the chunk's tokens, the last ones
        whose queries score the rows); the counts move to keep_after."""
        before = tuple(self.rows)
        after = [r + num_new for r in before]
        first = self.num_tokens
        self.num_tokens += num_new
        is_last = self.num_tokens == end
        p = self.layout.policy
        if p.evicts_in_prompt:  # each chunk's eviction needs scores of its own
            observed = min(p.chunk_observe, num_new)
        else:  # the prompt's last `observe` tokens, in whichever chunks they fall
            observed = max(0, min(num_new, self.num_tokens - max(first, end - p.observe)))
        if is_last and not self.prompt_tokens:
            self.prompt_tokens = self.num_tokens
        if is_last or p.evicts_in_prompt:
            for i, rows in enumerate(after):
                if self.layout.is_sparse(i + 1):
                    budget = self.layout.budget(i + 1, self.prompt_tokens)
                    if rows > budget + p.evict_slack:
                        after[i] = budget
        self.rows = after
        return before, tuple(after), observed


def add_kv_policy_arguments(p) -> None:
    """The --kv-* flags of layered KV sparsity on an argparse parser (eval and benchmarks; serve has
    ServeConfig's fields of the same names)."""
    d = KVPolicy()
    p.add_argument("--kv-policy", choices=KV_POLICIES, default=d.kind,
                   help="full: every layer keeps every token; layered: the first --kv-full-layers keep all, the others "
                        "a budget of sinks, a recent window and the highest-scoring tokens (default: full)")
    p.add_argument("--kv-full-layers", type=int,
                   help="layered: the first layers that keep every token (default: the leading layers of broad "
                        "attention in the model's attention profile, `hetserve calibrate --attention-profile`, "
                        "measured on first use)")
    p.add_argument("--kv-budget-tokens", type=int, help="layered: tokens a sparse layer keeps per sequence")
    p.add_argument("--kv-budget-ratio", type=float,
                   help=f"layered: tokens a sparse layer keeps, as a share of the prompt (default: {BUDGET_RATIO} "
                        "when --kv-budget-tokens is not given)")
    p.add_argument("--kv-budget-schedule", choices=BUDGET_SCHEDULES, default=d.schedule,
                   help="layered: flat, or pyramid (budgets falling with depth, the same mean) (default: flat)")
    p.add_argument("--kv-window", type=int,
                   help=f"layered: latest tokens always kept (default: --kv-window-ratio {WINDOW_RATIO})")
    p.add_argument("--kv-window-ratio", type=float,
                   help="layered: latest tokens always kept, as a share of each layer's budget, instead of "
                        f"--kv-window (default: {WINDOW_RATIO} unless --kv-window is given)")
    p.add_argument("--kv-sinks", type=int, default=d.sinks,
                   help=f"layered: first tokens always kept (default: {d.sinks})")
    p.add_argument("--kv-score-pool", type=int, default=d.score_pool,
                   help=f"layered: at a prompt's end rank each token by the larger of its score and the mean score of "
                        f"this many tokens around it (with --kv-focus, the focus queries' scores) (odd; 1: its own) "
                        f"(default: {d.score_pool})")
    p.add_argument("--kv-observe", type=int, default=d.observe,
                   help=f"layered: the prompt's last queries whose attention scores its tokens (SnapKV's observation "
                        f"window) (default: {d.observe})")
    p.add_argument("--kv-chunk-observe", type=int, default=d.chunk_observe,
                   help="layered with --kv-prefill-evict on: each prompt chunk's last queries whose attention scores "
                        f"the rows before its eviction (default: {d.chunk_observe})")
    p.add_argument("--kv-focus", type=int, default=d.focus,
                   help="layered: the prompt's last queries that rank its tokens a second time (pooled; a token ranks "
                        "by the larger of both, the --kv-observe window's then by own scores) (0: off) "
                        f"(default: {d.focus})")
    p.add_argument("--kv-evict-slack", type=int, default=d.evict_slack,
                   help="layered: tokens over the budget a sparse layer may hold before it evicts (evictions run once "
                        f"per this many decode steps) (default: {d.evict_slack})")
    p.add_argument("--kv-prefill-evict", choices=("on", "off"), default="off",
                   help="layered with --kv-budget-tokens: evict after every prompt chunk too (a long prompt holds "
                        "budget + a chunk in the sparse layers; later chunks attend to the kept rows) (default: off)")


def kv_policy_from_args(args) -> KVPolicy:
    return KVPolicy(args.kv_policy, args.kv_full_layers, args.kv_budget_tokens, args.kv_budget_ratio,
                    args.kv_budget_schedule, args.kv_window, args.kv_sinks, prefill_evict=args.kv_prefill_evict == "on",
                    observe=args.kv_observe, chunk_observe=args.kv_chunk_observe, score_pool=args.kv_score_pool,
                    focus=args.kv_focus, window_ratio=args.kv_window_ratio, evict_slack=args.kv_evict_slack)
