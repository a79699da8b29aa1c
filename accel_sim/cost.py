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


def step_cost(sys: System, w: StepWork) -> StepCost:
    m, d, f = sys.model, sys.device, sys.fmt
    p = sys.num_devices
    bw = d.mem_bw_bytes_s * d.eta_mem
    matrix = d.peak_tflops * 1e12 * d.eta_compute
    vector_fma = d.vector_tflops * 1e12 / 2 * d.eta_vector  # FMA (or int) instructions per second
    tokens = w.num_decode + w.prefill_tokens
    tok_mb = tokens / p  # tokens of one micro-batch

    # linears, one stage, one micro-batch
    weight_bytes = (m.layer_params_touched(tok_mb) + m.head_params) * WEIGHT_BYTES_PER_PARAM / p
    lin_flops = 2.0 * (m.active_layer_params * tokens + m.head_params * w.num_sampled) / (p * p)
    linear_s = max(weight_bytes / bw, lin_flops / matrix)

    # attention, one stage, one micro-batch
    kv_tokens = w.decode_kv_tokens + w.prefill_kv_read_tokens + tokens  # reads + this step's writes
    kv_bytes = kv_tokens * sys.kv_bytes_per_token + w.num_decode * sys.per_seq_overhead_tokens * \
        sys.kv_bytes_per_token
    kv_bytes /= p * p
    group = m.num_heads / m.num_kv_heads
    dequant = 0.0 if d.kv_dequant_hidden else f.dequant_instr_per_value
    decode_values = w.decode_kv_tokens * m.kv_values_per_token / (p * p)
    # q·K and p·V: one FMA per KV value per query head of its group; groups of >= 4 heads run as
    # small matrix products on the matrix units (FlashInfer/QServe GQA decode), smaller ones on vector
    fma_on_vector = group if group < GQA_MATRIX_GROUP else 0.0
    vector_s = decode_values * (fma_on_vector + dequant) / vector_fma
    matrix_flops = 4.0 * m.num_layers * m.num_heads * m.head_dim * w.prefill_attn_pairs / (p * p)
    if fma_on_vector == 0.0:
        matrix_flops += 2.0 * decode_values * group
    attention_s = max(kv_bytes / bw, vector_s + matrix_flops / matrix)

    link_s = 0.0
    if p > 1:
        link_s = tok_mb * m.hidden_size * WEIGHT_BYTES_PER_PARAM / d.link_bw_bytes_s + d.link_latency_s
    stage_s = linear_s + attention_s + link_s
    time_s = p * stage_s + d.step_overhead_s
    return StepCost(time_s, p * linear_s, p * attention_s, p * link_s, d.step_overhead_s,
                    p * p * (weight_bytes + kv_bytes), p * p * (lin_flops + matrix_flops))
