"""Discrete-event simulation of a pool of model replicas on a virtual clock (no sleeping).

    arrivals ──> router ──> replica queues ──> token-level continuous batching ──> step done
                 (policy)   (FIFO waiting)     (decodes + prefill chunks ≤ token budget)

Each replica (`Replica`: one `System`, i.e. 1..P pipelined devices) admits waiting requests while
its KV memory allows (prompt + one block of slack per sequence), runs one step at a time whose
length comes from `cost.step_cost`, and on memory pressure preempts its newest sequence, which is
recomputed later (vLLM's recompute policy). With layered KV (`System.layered`) a decoding sequence
holds its length in the full layers and min(length, budget) in the others (`Replica.kept_tokens`).
Per step the work is O(1) aggregates plus heap operations for the sequences that finish (and, with
layered KV, reach their budgets), so a 19k-request trace takes seconds.

Deterministic: events are ordered by (time, sequence number); the only randomness is the
`random` routing policy, seeded.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from accel_sim.cost import CostModel
from accel_sim.hardware import System


@dataclass
class Request:
    req_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    replica: int = -1
    first_token_s: float = math.nan
    finish_s: float = math.nan
    num_preemptions: int = 0
    rejected: bool = False
    """Could never fit in the replica's KV memory on its own."""


@dataclass(eq=False)
class _Seq:
    req: Request
    prompt: int
    """Tokens to (re)compute before decoding: the prompt, plus earlier output after a preemption."""
    remaining: int
    """Output tokens still to generate."""
    prefilled: int = 0
    base: int = 0
    """While decoding: current length = base + replica iteration."""
    finish_iter: int = -1
    is_alive: bool = True
    budget: int = 0
    """Layered KV: the tokens its sparse layers keep while decoding."""
    cross_iter: int = -1
    """Layered KV: the replica iteration at which its length reaches the budget."""
    capped: bool = False
    """Layered KV: its sparse layers hold the budget (else its whole length)."""


WATERMARK = 0.01
"""Share of KV memory admission leaves free (vLLM's default watermark, 1 %)."""


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    """Token budget of one step (vLLM chunked-prefill style)."""
    block_size: int = 16


class Replica:
    def __init__(self, index: int, system: System, limits: SchedulerLimits):
        self.index, self.system, self.limits = index, system, limits
        self.capacity_tokens = system.kv_capacity_tokens
        self.cost = CostModel(system)
        self.slack = limits.block_size + system.per_seq_overhead_tokens  # per sequence
        self.waiting: deque[_Seq] = deque()
        self.prefilling: list[_Seq] = []
        self.admitted: list[_Seq] = []  # admission order, newest last; lazily pruned
        self.heap: list[tuple[int, int, _Seq]] = []
        self.num_decode = 0
        self.sum_len = 0  # sum over decoding sequences of (base), add num_decode * iter for lengths
        # layered KV: the decoding sequences' sparse layers hold min(length, budget) tokens: the budgets of those
        # that reached theirs, plus the lengths of the others (their bases, and the iteration each)
        self.full_share = system.full_layer_share
        self.sum_capped = 0
        self.sum_open_base = 0
        self.num_open = 0
        self.crossings: list[tuple[int, int, _Seq]] = []  # (iteration a sequence reaches its budget, order, seq)
        self.used_prefill = 0  # tokens reserved by prefilling sequences (whole prompt + 1)
        self.iter = 0
        self.is_busy = False
        self.busy_s = 0.0
        self.max_concurrency = 0
        self.num_generated = 0
        """Tokens sampled (each request's output is generated exactly once, across preemptions)."""
        self._pending: tuple | None = None
        self._order = 0

    # ---- accounting
    @property
    def num_running(self) -> int:
        return self.num_decode + len(self.prefilling)

    def decode_tokens(self) -> int:
        return self.sum_len + self.num_decode * self.iter

    def kept_tokens(self) -> float:
        """KV tokens the decoding sequences hold, in whole-model tokens (layered KV: the full layers' share of
        their lengths plus the others' share of min(length, budget))."""
        if self.system.layered is None:
            return self.decode_tokens()
        sparse = self.sum_capped + self.sum_open_base + self.num_open * self.iter
        return self.full_share * self.decode_tokens() + (1.0 - self.full_share) * sparse

    def used_tokens(self) -> float:
        return self.kept_tokens() + self.used_prefill + self.slack * self.num_running

    def _start_decode(self, s: _Seq) -> None:
        """Layered KV: a sequence whose prompt was just computed keeps its budget in the sparse layers."""
        if self.system.layered is None:
            return
        s.budget = self.system.layered.budget(s.prompt)
        s.cross_iter = s.budget - s.base
        s.capped = s.cross_iter <= self.iter
        if s.capped:
            self.sum_capped += s.budget
            return
        self.sum_open_base += s.base
        self.num_open += 1
        self._order += 1
        heapq.heappush(self.crossings, (s.cross_iter, self._order, s))

    def _stop_decode(self, s: _Seq) -> None:
        """Layered KV: a decoding sequence finished or was preempted."""
        if self.system.layered is None:
            return
        if s.capped:
            self.sum_capped -= s.budget
        else:
            self.sum_open_base -= s.base
            self.num_open -= 1

    def _cross(self) -> None:
        """Layered KV: the decoding sequences whose length reached their budget at this iteration."""
        while self.crossings and self.crossings[0][0] <= self.iter:
            cross_iter, _, s = heapq.heappop(self.crossings)
            if not s.is_alive or s.finish_iter < 0 or s.capped or s.cross_iter != cross_iter:  # stale
                continue
            s.capped = True
            self.sum_open_base -= s.base
            self.num_open -= 1
            self.sum_capped += s.budget

    def load(self) -> int:
        return len(self.waiting) + self.num_running

    # ---- scheduling
    def add(self, req: Request, rejected: list[Request]) -> None:
        if req.prompt_tokens + req.output_tokens + self.slack > self.capacity_tokens:
            req.rejected = True
            rejected.append(req)
            return
        self.waiting.append(_Seq(req, req.prompt_tokens, req.output_tokens))

    def _admit(self) -> None:
        lim = self.limits
        while self.waiting and self.num_running < lim.max_num_seqs:
            s = self.waiting[0]
            # vLLM-style watermark: keep 1 % free plus one step of growth, so an admission is not
            # preempted again by the very next decode step
            room = self.capacity_tokens * (1 - WATERMARK) - self.num_decode - self.num_running
            if self.used_tokens() + s.prompt + 1 + self.slack > room and self.num_running:
                break
            if self.used_tokens() + s.prompt + 1 + self.slack > self.capacity_tokens:
                break
            self.waiting.popleft()
            s.prefilled, s.is_alive = 0, True
            self.prefilling.append(s)
            self.admitted.append(s)
            self.used_prefill += s.prompt + 1

    def _preempt_newest(self) -> None:
        while True:
            s = self.admitted.pop()
            if s.is_alive:
                break
        s.is_alive = False
        s.req.num_preemptions += 1
        if s.finish_iter >= 0:  # decoding: recompute prompt + output so far
            length = s.base + self.iter
            self.num_decode -= 1
            self.sum_len -= s.base
            self._stop_decode(s)
            s.prompt, s.remaining, s.finish_iter = length, s.finish_iter - self.iter, -1
        else:
            self.prefilling.remove(s)
            self.used_prefill -= s.prompt + 1
        self.waiting.appendleft(s)

    def start_step(self, now: float) -> float | None:
        """Schedule and cost one step; returns its duration, or None when idle."""
        self._admit()
        while self.num_running and self.used_tokens() + self.num_decode > self.capacity_tokens:
            self._preempt_newest()
        if not self.num_running:
            return None
        self.max_concurrency = max(self.max_concurrency, self.num_running)
        budget = self.limits.max_num_batched_tokens - self.num_decode
        chunks, pre_tok, kv_read, pairs = [], 0, 0.0, 0.0
        for s in self.prefilling:
            if budget <= 0:
                break
            n = min(s.prompt - s.prefilled, budget)
            start = s.prefilled
            chunks.append((s, n))
            pre_tok += n
            kv_read += self.system.model.kv_tokens(start)
            pairs += n * start + n * (n + 1) / 2
            budget -= n
        window = self.system.model.sliding_window
        dec_kv = self.kept_tokens() if not window else min(self.kept_tokens(), self.num_decode * window)
        num_sampled = self.num_decode + sum(1 for s, n in chunks if s.prefilled + n == s.prompt)
        dt = self.cost.time_s(self.num_decode, dec_kv, pre_tok, kv_read, pairs, num_sampled)
        self._pending = (chunks, self.num_decode)
        self.is_busy = True
        self.busy_s += dt
        return dt

    def finish_step(self, now: float, finished: list[Request]) -> None:
        chunks, num_decode = self._pending
        self.is_busy = False
        # decodes: every decoding sequence grew by one token
        self.iter += 1
        self.num_generated += num_decode
        self._cross()
        while self.heap and self.heap[0][0] <= self.iter:
            finish_iter, _, s = heapq.heappop(self.heap)
            if not s.is_alive or s.finish_iter != finish_iter:  # stale: preempted since
                continue
            s.is_alive = False
            self.num_decode -= 1
            self.sum_len -= s.base
            self._stop_decode(s)
            s.req.finish_s = now
            finished.append(s.req)
        for s, n in chunks:
            s.prefilled += n
            if s.prefilled < s.prompt:
                continue
            self.prefilling.remove(s)
            self.used_prefill -= s.prompt + 1
            if math.isnan(s.req.first_token_s):
                s.req.first_token_s = now
            s.remaining -= 1
            self.num_generated += 1
            if s.remaining <= 0:
                s.is_alive = False
                s.req.finish_s = now
                finished.append(s.req)
                continue
            s.base = s.prompt + 1 - self.iter
            s.finish_iter = self.iter + s.remaining
            self.num_decode += 1
            self.sum_len += s.base
            self._start_decode(s)
            self._order += 1
            heapq.heappush(self.heap, (s.finish_iter, self._order, s))
        if len(self.admitted) > 4 * (self.num_running + 16):
            self.admitted = [s for s in self.admitted if s.is_alive]


ROUTING = ("least-loaded", "round-robin", "random")


@dataclass
class SimResult:
    requests: list[Request]
    makespan_s: float
    replicas: list[Replica] = field(repr=False)

    def summary(self) -> dict:
        done = [r for r in self.requests if not math.isnan(r.finish_s)]
        gen = sum(r.output_tokens for r in done)
        prompt = sum(r.prompt_tokens for r in done)
        ttft = sorted(r.first_token_s - r.arrival_s for r in done)
        e2e = sorted(r.finish_s - r.arrival_s for r in done)
        tpot = [(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
        span = self.makespan_s or math.nan
        energy = 0.0
        for rep in self.replicas:
            d, n = rep.system.device, rep.system.num_devices
            energy += n * (rep.busy_s * d.active_power_w + max(span - rep.busy_s, 0.0) * d.idle_power_w)
        pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.nan  # noqa: E731
        return {
            "num_requests": len(self.requests), "num_finished": len(done),
            "num_rejected": sum(r.rejected for r in self.requests),
            "num_preemptions": sum(r.num_preemptions for r in self.requests),
            "makespan_s": span, "gen_tok_s": gen / span, "total_tok_s": (gen + prompt) / span,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "e2e_p50_s": pct(e2e, 0.5), "e2e_p99_s": pct(e2e, 0.99),
            "tpot_mean_s": sum(tpot) / len(tpot) if tpot else math.nan,
            "max_concurrency": max(rep.max_concurrency for rep in self.replicas),
            "utilization": sum(rep.busy_s for rep in self.replicas) / (len(self.replicas) * span),
            "energy_j": energy, "j_per_gen_token": energy / gen if gen else math.nan,
        }


def simulate(replica_systems: list[System], requests: list[Request], limits: SchedulerLimits = SchedulerLimits(),
             routing: str = "least-loaded", seed: int = 0) -> SimResult:
    """Run `requests` (any order; sorted by arrival here) through a pool of replicas."""
    if routing not in ROUTING:
        raise ValueError(f"routing must be one of {', '.join(ROUTING)}")
    rng = random.Random(seed)
    replicas = [Replica(i, s, limits) for i, s in enumerate(replica_systems)]
    events: list[tuple[float, int, int, object]] = []  # (time, order, kind, payload); kind 0 = arrival, 1 = step done
    order = 0
    for r in sorted(requests, key=lambda r: (r.arrival_s, r.req_id)):
        events.append((r.arrival_s, order, 0, r))
        order += 1
    heapq.heapify(events)
    finished: list[Request] = []
    rejected: list[Request] = []
    rr = 0
    now = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == 0:
            if routing == "round-robin":
                rep, rr = replicas[rr % len(replicas)], rr + 1
            elif routing == "random":
                rep = replicas[rng.randrange(len(replicas))]
            else:
                rep = min(replicas, key=lambda x: (x.load(), x.index))
            payload.replica = rep.index
            rep.add(payload, rejected)
        else:
            rep = payload
            rep.finish_step(now, finished)
        if not rep.is_busy:
            dt = rep.start_step(now)
            if dt is not None:
                heapq.heappush(events, (now + dt, order, 1, rep))
                order += 1
    return SimResult(requests, now, replicas)
