"""A simulated backend's clock as the engine sees it (`--backend sim`): the totals /metrics reports,
and each request's simulated timing (RequestEvent.sim, returned to clients as x_sim).

The engine feeds it StepOutput.virtual_clock_s after every step; a backend in real time reports
None, and the clock stays idle: no series in /metrics, no simulated timing in responses.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class _RequestTimes:
    arrival_s: float
    """The virtual clock when the request arrived."""
    first_token_s: float | None = None
    """The virtual clock after the step that sampled its first token."""
    last_token_s: float | None = None
    """The virtual clock after the step that sampled its latest token."""


class VirtualClock:
    def __init__(self) -> None:
        self.now_s = 0.0
        """Simulated seconds of the steps since the last reset."""
        self.num_steps = 0
        """Steps that reported a virtual clock since the last reset."""
        self.num_output_tokens = 0
        """Tokens those steps sampled."""
        self._requests: dict[int, _RequestTimes] = {}

    @property
    def is_running(self) -> bool:
        """Whether the backend reports a virtual clock (some step since the last reset did)."""
        return self.num_steps > 0

    def reset(self) -> None:
        """Start the totals from zero (after the warm-up requests, which are not traffic)."""
        self.now_s, self.num_steps, self.num_output_tokens = 0.0, 0, 0

    def on_arrival(self, seq_id: int) -> None:
        self._requests[seq_id] = _RequestTimes(self.now_s)

    def on_step(self, clock_s: float | None, sampled_seq_ids: Iterable[int]) -> None:
        """A step ended at virtual time `clock_s` (None: a real-time backend) with a token for each of
        `sampled_seq_ids`."""
        if clock_s is None:
            return
        self.now_s = clock_s
        self.num_steps += 1
        for seq_id in sampled_seq_ids:
            self.num_output_tokens += 1
            times = self._requests.get(seq_id)
            if times is not None:
                times.first_token_s = clock_s if times.first_token_s is None else times.first_token_s
                times.last_token_s = clock_s

    def request_timing(self, seq_id: int, num_output_tokens: int) -> dict | None:
        """{ttft_s, e2e_s, tpot_s} of a request on the virtual clock, once it has a token; else None."""
        times = self._requests.get(seq_id)
        if times is None or times.first_token_s is None or times.last_token_s is None:
            return None
        n = num_output_tokens
        return {"ttft_s": times.first_token_s - times.arrival_s, "e2e_s": times.last_token_s - times.arrival_s,
                "tpot_s": (times.last_token_s - times.first_token_s) / (n - 1) if n > 1 else None}

    def forget(self, seq_id: int) -> None:
        self._requests.pop(seq_id, None)
