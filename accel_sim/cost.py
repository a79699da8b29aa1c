"""Per-step cost model: each operator takes max(bytes / (BW·η_mem), work / (peak·η)), operators
run one after another, plus a fixed per-step overhead.

A step of one model replica (a `System`) runs `StepWork`: decode tokens (one per running
sequence) and prefill chunks, mixed, as a continuous-batching engine schedules them.

    linears    weights read once per step (per micro-batch when pipelined), 2·active params
               flops per token on the matrix units; MoE reads only the experts some token uses
    attention  KV bytes from the format's effective bits; decode attention FMAs (one per KV
               value and query head of its group) plus dequantization instructions on the
               vector units (zero where the device dequantizes in its memory path); prefill
               attention (causal, 4·heads·head_dim flops per query-key pair) on the matrix units,
               and so is decode attention for GQA groups of >= 4 query heads
    pipeline   P stages, P micro-batches in flight: each device reads its 1/P of the weights once
               per micro-batch; period = P · stage time, plus one activation transfer per stage

Nothing here keeps state: the simulator calls `step_cost` once per step.
"""
from __future__ import annotations

from dataclasses import dataclass

from accel_sim.hardware import WEIGHT_BYTES_PER_PARAM, System

GQA_MATRIX_GROUP = 4
"""Query heads per KV head from which decode attention uses the matrix units."""


@dataclass(frozen=True)
class StepWork:
    num_decode: int = 0
    """Decode tokens, one per running sequence."""
    decode_kv_tokens: float = 0.0
    """Sum over decode sequences of the KV tokens each attends to (window-capped)."""
    prefill_tokens: int = 0
    """Prompt tokens computed this step (all prefill chunks)."""
    prefill_kv_read_tokens: float = 0.0
    """KV tokens of earlier chunks that this step's prefill chunks read back."""
    prefill_attn_pairs: float = 0.0
    """Causal (query, key) pairs of the prefill chunks."""
    num_sampled: int = 0
    """Rows through the LM head (decodes plus prefills that finish their prompt)."""


@dataclass(frozen=True)
class StepCost:
    time_s: float
    linear_s: float
    attention_s: float
    link_s: float
    overhead_s: float
    bytes_read: float
    flops: float

    def as_dict(self) -> dict[str, float]:
        return {"step_s": self.time_s, "linear_s": self.linear_s, "attention_s": self.attention_s,
                "link_s": self.link_s, "overhead_s": self.overhead_s}


class CostModel:
    """`step_cost` for one system, with every per-system constant computed once (the simulator
    calls `time_s` hundreds of thousands of times per trace)."""

    def __init__(self, sys: System):
        m, d, f = sys.model, sys.device, sys.fmt
        p = self.p = sys.num_devices
        self.model, self.overhead_s = m, d.step_overhead_s
        self.bw = d.mem_bw_bytes_s * d.eta_mem
        self.matrix = d.peak_tflops * 1e12 * d.eta_compute
        vector_fma = d.vector_tflops * 1e12 / 2 * d.eta_vector  # FMA (or int) instructions per second
        self.is_moe = m.num_experts > 1
        self.weight_bytes_per_param = sys.weight_bits / 8
        self.dense_weight_bytes = (m.layer_params + m.head_params) * self.weight_bytes_per_param / p
        self.head_bytes = m.head_params * self.weight_bytes_per_param
        self.lin_flops_per_token = 2.0 * m.active_layer_params / (p * p)
        self.head_flops = 2.0 * m.head_params / (p * p)
        self.kv_bytes_per_token = sys.kv_bytes_per_token / (p * p)
        self.seq_overhead_bytes = sys.per_seq_overhead_tokens * sys.kv_bytes_per_token / (p * p)
        values = m.kv_values_per_token / (p * p)
        group = m.num_heads / m.num_kv_heads
        dequant = 0.0 if d.kv_dequant_hidden else f.dequant_instr_per_value
        # q·K and p·V: one FMA per KV value per query head of its group; groups of >= 4 heads run as
        # small matrix products on the matrix units (FlashInfer/QServe GQA decode), smaller ones on vector
        fma_on_vector = group if group < GQA_MATRIX_GROUP else 0.0
        self.decode_vector_s_per_token = values * (fma_on_vector + dequant) / vector_fma
        self.decode_matrix_flops_per_token = 0.0 if fma_on_vector else 2.0 * values * group
        self.prefill_flops_per_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim / (p * p)
        self.link_s_per_token = m.hidden_size * WEIGHT_BYTES_PER_PARAM / d.link_bw_bytes_s / p
        self.link_latency_s = d.link_latency_s if p > 1 else 0.0

    def parts(self, num_decode: int, decode_kv: float, prefill_tokens: int, prefill_kv_read: float,
              pairs: float, num_sampled: int) -> tuple[float, float, float, float, float]:
        """(linear_s, attention_s, link_s, bytes, flops) of one stage and one micro-batch."""
        tokens = num_decode + prefill_tokens
        if self.is_moe:
            weight_bytes = (self.model.layer_params_touched(tokens / self.p) * self.weight_bytes_per_param
                            + self.head_bytes) / self.p
        else:
            weight_bytes = self.dense_weight_bytes
        lin_flops = self.lin_flops_per_token * tokens + self.head_flops * num_sampled
        linear_s = max(weight_bytes / self.bw, lin_flops / self.matrix)
        kv_bytes = (decode_kv + prefill_kv_read + tokens) * self.kv_bytes_per_token + \
            num_decode * self.seq_overhead_bytes  # reads + this step's writes
        matrix_flops = self.prefill_flops_per_pair * pairs + self.decode_matrix_flops_per_token * decode_kv
        attention_s = max(kv_bytes / self.bw,
                          self.decode_vector_s_per_token * decode_kv + matrix_flops / self.matrix)
        link_s = self.link_s_per_token * tokens + self.link_latency_s if self.p > 1 else 0.0
        return linear_s, attention_s, link_s, weight_bytes + kv_bytes, lin_flops + matrix_flops

    def time_s(self, *work) -> float:
        """Step time for StepWork's fields given positionally."""
        linear_s, attention_s, link_s, _, _ = self.parts(*work)
        return self.p * (linear_s + attention_s + link_s) + self.overhead_s


def step_cost(sys: System, w: StepWork) -> StepCost:
    c = CostModel(sys)
    p = c.p
    linear_s, attention_s, link_s, nbytes, flops = c.parts(
        w.num_decode, w.decode_kv_tokens, w.prefill_tokens, w.prefill_kv_read_tokens, w.prefill_attn_pairs,
        w.num_sampled)
    return StepCost(p * (linear_s + attention_s + link_s) + c.overhead_s, p * linear_s, p * attention_s, p * link_s,
                    c.overhead_s, p * p * nbytes, p * p * flops)
