"""`--backend sim`: real tokens, simulated timing.

The numbers come from the real model (the hetero backend, with the KV format the simulated
system stores: Oaken for the Oaken devices); each step's duration comes from the cost model
for the chosen system and a timing model shape (default: the served SmolLM2 itself, or any
shape from `accel_sim.models`, e.g. llama2-13b to ask what that model would cost). A virtual
clock advances by the simulated step time; each StepOutput carries it (`virtual_clock_s`), from
which the server derives each request's simulated timing and the /metrics series of the clock.
"""
from __future__ import annotations

from dataclasses import replace

from accel_sim.cost import StepWork, step_cost
from accel_sim.hardware import SYSTEMS, System, make_system
from accel_sim.models import get_model
from hetcore.backend import Backend, SeqChunk, StepInput, StepOutput
from hetcore.kv_policy import KVLayout

# simulated KV format -> the CPU store format computing the same numerics
NUMERICS_KV_FORMAT = {"oaken": "oaken", "fp16": "fp16", "kivi4": "kivi", "qserve_kv4": "int4"}


def numerics_kv_format(system_name: str) -> str:
    """The `--kv-format` whose numerics match what `system_name` stores."""
    if system_name not in SYSTEMS:
        raise ValueError(f"unknown sim device {system_name!r}; known: {', '.join(SYSTEMS)}")
    return NUMERICS_KV_FORMAT[SYSTEMS[system_name][1]]


def held_share(layout: KVLayout | None, chunk: SeqChunk) -> float:
    """The KV rows the chunk's earlier tokens hold in all layers, over a full cache's (chunk.start_pos in every
    layer): 1 without layered KV; with it, the full group holds start_pos rows and each later group its
    kv_view.rows_before (what its sparse layers kept)."""
    view, s = chunk.kv_view, chunk.start_pos
    if layout is None or view is None or s == 0:
        return 1.0
    return layout.slots * (s + sum(view.rows_before)) / (layout.num_layers * s)  # every group has `slots` layers


def step_work(inp: StepInput, sliding_window: int | None = None, layout: KVLayout | None = None) -> StepWork:
    """What a scheduler step asks of the model, as the cost model's aggregates (`layout`: the served model's KV
    layout; under layered KV a chunk's sparse layers read only the rows they kept: held_share)."""
    num_decode, dec_kv, pre_tok, pre_kv, pairs, sampled = 0, 0.0, 0, 0.0, 0.0, 0
    cap = (lambda n: min(n, sliding_window)) if sliding_window else (lambda n: n)
    for c in inp.chunks:
        n, s = len(c.token_ids), c.start_pos
        sampled += c.sampling is not None
        share = held_share(layout, c)
        if n == 1 and s > 0:
            num_decode += 1
            dec_kv += cap(s + 1) * share
        else:
            pre_tok += n
            pre_kv += cap(s) * share
            pairs += n * s * share + n * (n + 1) / 2
    return StepWork(num_decode, dec_kv, pre_tok, pre_kv, pairs, sampled)


class SimBackend(Backend):
    """Wraps a real backend (for tokens) and a simulated `System` (for time)."""

    def __init__(self, inner: Backend, system: System):
        self.inner = inner
        self.system = system
        self.kv_spec = inner.kv_spec
        self.max_model_len = inner.max_model_len
        self.model_cfg = inner.model_cfg
        self.clock_s = 0.0

    @classmethod
    def build(cls, inner, system_name: str, timing_model: str, num_devices: int | None = None,
              weight_format: str = "auto") -> "SimBackend":
        return cls(inner, make_system(system_name, get_model(timing_model), num_devices, weight_format))

    def step(self, inp: StepInput) -> StepOutput:
        out = self.inner.step(inp)
        if not inp.chunks:
            return out
        work = step_work(inp, self.system.model.sliding_window, self.kv_spec.kv_layout)
        self.clock_s += step_cost(self.system, work).time_s
        return replace(out, virtual_clock_s=self.clock_s)

    def reset_clock(self) -> None:
        self.clock_s = 0.0

    def close(self) -> None:
        self.inner.close()

    def live_shards(self) -> set[int]:
        return self.inner.live_shards()

    def health(self) -> str:
        return self.inner.health()
