"""The engine loop: one thread owns the backend and steps it; HTTP handlers only submit
requests and receive events.

    step(): schedule -> run (backend.step) -> postprocess (detokenize, check stops, emit events)

Metrics (server.metrics) and a simulated backend's clock (server.virtual_clock) are fed from the
step's typed output; the engine does not interpret them.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Callable

from hetcore.backend import Backend, StepInput, StepOutput, StepTimings, TokenLogprobs, WorkerLost
from server.block_manager import BlockManager
from server.detokenizer import IncrementalDetokenizer
from server.grammar import GrammarMasks
from server.memory import Trimmer
from server.metrics import ServingMetrics
from server.request import EngineRequest, RequestEvent
from server.scheduler import Scheduler, SchedulerConfig, Sequence
from server.virtual_clock import VirtualClock

log = logging.getLogger(__name__)


@dataclass
class _Live:
    req: EngineRequest
    seq: Sequence
    detok: IncrementalDetokenizer
    scheduled_s: float | None = None
    first_token_s: float | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Of prompt positions 1, 2, ... as the prefill chunks score them (a recomputed chunk's again: dropped)."""
    prompt_logprobs_sent: bool = False
    emitted: int = 0
    """Output tokens applied to the request so far (the sequence may hold more of the step in hand)."""
    pending: list[tuple[str, int, tuple[TokenLogprobs, ...]]] = field(default_factory=list)
    """This step's applied tokens not yet sent (text, token, logprobs): a step's tokens go out as one event."""


class Engine:
    def __init__(self, backend: Backend, tokenizer, sched_cfg: SchedulerConfig):
        self.backend = backend
        self.tokenizer = tokenizer
        self.blocks = BlockManager(backend.kv_spec)
        self.scheduler = Scheduler(sched_cfg, self.blocks)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._by_request_id: dict[str, int] = {}
        self._seq_ids = count()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        """The thread running the loop (run())."""
        self.last_step_timings: StepTimings | None = None
        """Where the latest step's time went (None before the first, or from a backend that does not say)."""
        self.clock = VirtualClock()
        """A simulated backend's clock (idle for real-time backends)."""
        self.metrics = ServingMetrics()
        self.grammars = GrammarMasks(on_mask=lambda s: self.metrics.on_grammar_mask(s))
        """Constrained sequences' matchers; their token masks are filled while the backend steps."""
        self._num_unread_adds = 0
        """Submitted requests still in the inbox: they count as waiting (admission control reads it)."""
        self._adds_lock = threading.Lock()
        self._backend_closed, self._close_lock = False, threading.Lock()

    # ---- called from any thread
    def run(self, on_started: Callable[[], None] = lambda: None) -> None:
        """Run the loop on the calling thread until stop(): the thread that built the backend
        (server.launch.start_engine). on_started() is called once this thread is the engine's.

        The backend is closed on this thread when the loop ends: processes a backend started may die
        with the thread that started them (Ray's local cluster is spawned with PR_SET_PDEATHSIG), and
        must still be there while the backend shuts them down."""
        self._thread = threading.current_thread()
        on_started()
        try:
            self._loop()
        finally:
            self._close_backend()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, req: EngineRequest) -> None:
        with self._adds_lock:
            self._num_unread_adds += 1
        self._inbox.put(("add", req))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def reset_stats(self) -> None:
        """Start /metrics (and a simulated backend's clock) from zero at the next step boundary, after
        requests submitted before it (server.launch.warm_up: its requests are not traffic)."""
        self._inbox.put(("reset_stats", None))

    def abort_all(self, error: str) -> None:
        """End every request (finish_reason abort, with `error`) at the next step boundary."""
        self._inbox.put(("abort_all", error))

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.grammars.close()
        self._close_backend()  # when run() never ran, or its thread is stuck in a step

    def _close_backend(self) -> None:
        with self._close_lock:
            closed, self._backend_closed = self._backend_closed, True
        if not closed:
            self.backend.close()

    def health(self) -> str:
        """ok; degraded (serving, with a CPU attention worker down); down (not serving)."""
        if not self.is_alive():
            return "down"
        return self.backend.health()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self._num_unread_adds

    # ---- engine thread
    def _loop(self) -> None:
        trimmer = Trimmer()
        while not self._stopping.is_set():
            self._drain(block=not self.scheduler.has_work())
            self._expire()
            self._sync_workers()  # also when idle, so /health sees restarted workers come back
            if self.scheduler.has_work():
                trimmer.worked()
                try:
                    self.step()
                except Exception as exc:  # a failed step must not take the server down
                    log.exception("engine step failed")
                    for live in list(self._live.values()):
                        self._finish(live, "error", error=f"engine step failed: {exc}")
            trimmer.maybe_release()  # server/memory.py: freed step arrays would stay resident
        for live in list(self._live.values()):
            self._finish(live, "abort", error="server shutting down")

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                with self._adds_lock:
                    self._num_unread_adds -= 1
                self._add(payload)
            elif kind == "abort_all":
                for live in list(self._live.values()):
                    self._finish(live, "abort", error=payload)
            elif kind == "abort" and payload in self._by_request_id:
                self._finish(self._live[self._by_request_id[payload]], "abort")
            elif kind == "reset_stats":
                self.metrics = ServingMetrics()
                self.blocks.queried_tokens = self.blocks.hit_tokens = 0
                self.scheduler.reset_counters()
                self.clock.reset()
                self.backend.reset_clock()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: EngineRequest) -> None:
        seq = Sequence(next(self._seq_ids), list(req.prompt_token_ids), req.sampling, max_tokens=req.max_tokens,
                       speculate=req.grammar is None or self.scheduler.cfg.speculative.method == "ngram")
        detok = IncrementalDetokenizer(self.tokenizer.decode, req.stop)
        self._live[seq.seq_id] = _Live(req, seq, detok)
        self.clock.on_arrival(seq.seq_id)
        self._by_request_id[req.request_id] = seq.seq_id
        if req.grammar is not None:
            self.grammars.add(seq.seq_id, req.grammar)
        self.scheduler.add(seq)
        self.metrics.on_arrival(len(req.prompt_token_ids))

    def _expire(self) -> None:
        """End requests past their deadline, whether waiting or running; their KV blocks are freed."""
        now = time.monotonic()
        for live in [lv for lv in self._live.values() if lv.req.deadline_s is not None and lv.req.deadline_s <= now]:
            waited = now - live.req.arrival_s
            self._finish(live, "timeout", error=f"request timed out after {waited:.1f} s (the server's "
                                                 "request_timeout_s); it was cancelled and its KV cache freed")

    def _sync_workers(self) -> None:
        self.blocks.set_live(self.backend.live_shards())
        self.blocks.open = self.backend.open_shards()

    def step(self) -> None:
        inp = self._schedule()
        if not inp.chunks:
            self._idle(inp)
            return
        out = self._run(self.grammars.attach(inp))
        if out is not None:
            self._postprocess(out)

    def _schedule(self) -> StepInput:
        """The scheduler's next step; requests too long for the cache end, the newly scheduled get a queue time."""
        inp = self.scheduler.schedule()
        for seq in self.scheduler.too_long:
            self._finish(self._live[seq.seq_id], "length")
        self.scheduler.too_long.clear()
        now = time.monotonic()
        for chunk in inp.chunks:
            live = self._live[chunk.seq_id]
            if live.scheduled_s is None:
                live.scheduled_s = now
                self.metrics.on_scheduled(now - live.req.arrival_s)
        return inp

    def _idle(self, inp: StepInput) -> None:
        """Nothing to run: tell the backend which sequences ended; with every worker down, fail the waiting."""
        if inp.freed_seq_ids:
            self._free_finished(inp)
        if self.scheduler.waiting and not self.blocks.live:  # every CPU attention worker is down
            for seq in list(self.scheduler.waiting):
                self._finish(self._live[seq.seq_id], "error",
                             error="no worker can serve it: the backend is down (see /health); retry later")

    def _run(self, inp: StepInput) -> StepOutput | None:
        """backend.step; None when a CPU attention worker died (its sequences are recomputed on the others)."""
        try:
            return self.backend.step(inp)
        except WorkerLost as exc:
            if exc.shard is None:
                raise  # the accelerator worker: every running request fails (see _loop)
            log.error("%s; recomputing the running sequences on the other workers", exc)
            self.blocks.set_live(self.blocks.live - {exc.shard})
            self.scheduler.preempt_all()
            return None

    def _postprocess(self, out: StepOutput) -> None:
        """Record the step, keep scored prompt positions, apply each sampled token to its request."""
        self.last_step_timings = out.timings
        self.metrics.on_step(out.timings, len(out.sampled) + sum(map(len, out.accepted.values())))
        self.clock.on_step(out.virtual_clock_s, out.sampled)
        for seq_id, scored in out.prompt_logprobs.items():
            live = self._live.get(seq_id)
            for pos, lp in scored if live else ():
                if pos == len(live.prompt_logprobs) + 1:
                    live.prompt_logprobs.append(lp)
        now = time.monotonic()
        nth: dict[int, int] = {}
        for seq, token in self.scheduler.update(out):
            live = self._live.get(seq.seq_id)
            if live is None:  # ended at an earlier token of this step (a stop among accepted drafts)
                continue
            i = nth[seq.seq_id] = nth.get(seq.seq_id, -1) + 1
            accepted = out.accepted_logprobs.get(seq.seq_id, ())
            lp = accepted[i] if i < len(out.accepted.get(seq.seq_id, ())) and accepted else out.logprobs.get(seq.seq_id)
            if live.first_token_s is None:
                live.first_token_s = now
                self.metrics.on_first_token(now - live.req.arrival_s)
            self._on_token(live, token, lp)
        for seq_id in nth:  # one event per request a step, however many of its drafts were accepted
            live = self._live.get(seq_id)
            if live is not None and live.pending:
                text, ids, lps = self._take_pending(live)
                live.req.on_event(self._event(live, text, ids, logprobs=lps))

    def _free_finished(self, inp: StepInput) -> None:
        """A step with nothing to run still tells the backend which sequences ended (it drops their
        LSH centers and MagicPIG tables); one that cannot be reached now keeps them for later."""
        try:
            self.backend.step(inp)
        except WorkerLost as exc:
            log.warning("finished sequences not freed in the backend yet: %s", exc)

    def _on_token(self, live: _Live, token: int, logprobs: TokenLogprobs | None) -> None:
        """Apply the request's next output token. The sequence already holds all of this step's (a step with
        accepted drafts brings several), so the checks below count the tokens applied, not the sequence's."""
        req, seq = live.req, live.seq
        if req.max_tokens == 0:  # echo's prompt scoring alone: the prompt's logprobs came with this token, dropped
            self._finish(live, "length")
            return
        n = live.emitted = live.emitted + 1
        reason, lps = None, () if logprobs is None else (logprobs,)
        grammar = self.grammars.consume(seq.seq_id, token)  # None, "stop" (complete) or why it broke
        if grammar not in (None, "stop"):
            self._finish(live, "error", error=grammar)
            return
        if not req.ignore_eos and token in self.tokenizer.eos_token_ids:
            reason, text, lps = "stop", "", ()
        else:
            text = live.detok.add(token)
            if live.detok.is_stopped:
                reason = "stop"
        if reason is None and grammar == "stop":
            reason = "stop"
        if reason is None and (n >= req.max_tokens or len(seq.prompt_token_ids) + n >= self.backend.max_model_len):
            reason = "length"
        if reason is None:
            live.pending.append((text, token, lps))
        else:
            self._finish(live, reason, text=text, token_ids=(token,), logprobs=lps)

    @staticmethod
    def _take_pending(live: _Live) -> tuple[str, tuple[int, ...], tuple[TokenLogprobs, ...]]:
        """The step's unsent tokens' text, ids and logprobs, joined; clears them."""
        text = "".join(t for t, _, _ in live.pending)
        ids = tuple(tok for _, tok, _ in live.pending)
        lps = tuple(x for _, _, lp in live.pending for x in lp)
        live.pending.clear()
        return text, ids, lps

    def _event(self, live: _Live, text: str, token_ids: tuple[int, ...], reason: str | None = None,
               error: str | None = None, logprobs: tuple[TokenLogprobs, ...] = ()) -> RequestEvent:
        sim = self.clock.request_timing(live.seq.seq_id, len(live.seq.output_token_ids))
        prompt = ()
        if error is None and live.req.sampling.prompt_logprobs is not None and not live.prompt_logprobs_sent:
            prompt, live.prompt_logprobs_sent = tuple(live.prompt_logprobs), True
        return RequestEvent(live.req.request_id, text, token_ids, len(live.seq.prompt_token_ids),
                            live.emitted, reason, error, sim, logprobs,
                            prompt, live.seq.num_cached_tokens)

    def _finish(self, live: _Live, reason: str, text: str = "", token_ids: tuple[int, ...] = (),
                error: str | None = None, logprobs: tuple[TokenLogprobs, ...] = ()) -> None:
        self.scheduler.finish(live.seq)
        del self._live[live.seq.seq_id]
        del self._by_request_id[live.req.request_id]
        stop_reason = None
        if reason == "length" and self.grammars.is_incomplete(live.seq.seq_id):
            stop_reason = (f"max_tokens ({live.req.max_tokens}) reached before the grammar was complete: the output "
                           "does not match the requested format; raise max_tokens")
        self.grammars.remove(live.seq.seq_id)
        if live.pending:  # this step's earlier tokens go out with the last
            before, ids, lps = self._take_pending(live)
            text, token_ids, logprobs = before + text, ids + token_ids, lps + logprobs
        if reason != "error":
            text += live.detok.flush()
        now, n = time.monotonic(), live.emitted
        first = live.first_token_s
        self.metrics.on_finish(reason, now - live.req.arrival_s, (now - first) / (n - 1) if first and n > 1 else None)
        live.req.on_event(replace(self._event(live, text, token_ids, reason, error, logprobs), stop_reason=stop_reason))
        self.clock.forget(live.seq.seq_id)
