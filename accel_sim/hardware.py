"""Devices, KV formats and the systems built from them.

Device and format numbers live in `data/` (one YAML file per device, one for the KV formats),
each as `{value, source}` so every constant says where it came from. A `System` is what gets
simulated: a device kind, the KV format its software stores, and how many devices hold one
model replica (pipeline stages).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from accel_sim.models import ModelShape

DATA_DIR = Path(__file__).with_name("data")
WEIGHT_BYTES_PER_PARAM = 2  # fp16/bf16 weights on every system (the paper's baselines are KV-only quantized)
WEIGHT_FORMAT_BITS = {"auto": 16.0, "bf16": 16.0, "fp32": 32.0, "gguf": 5.0, "mxfp8": 8.25, "mxfp6": 6.25,
                      "mxfp6_e3m2": 6.25, "mxfp4": 4.25, "mxint8": 8.25}
"""Bits per weight of each --weight-format (auto: the systems' fp16; gguf: Q4_1's 5), scales included."""


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    description: str
    peak_tflops: float
    """Matrix (tensor-core / MPU) fp16 peak."""
    vector_tflops: float
    """Peak of the units that run decode attention and KV dequantization (counted as FMA = 2 flops)."""
    mem_bytes: float
    mem_bw_bytes_s: float
    eta_mem: float
    eta_compute: float
    eta_vector: float
    kv_dequant_hidden: bool
    """KV (de)quantization happens in the memory path and costs no compute time (Oaken's engines)."""
    step_overhead_s: float
    usable_mem_fraction: float
    link_bw_bytes_s: float
    link_latency_s: float
    active_power_w: float
    idle_power_w: float
    sources: dict


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits_per_value: float
    dequant_instr_per_value: float
    residual_fp16_tokens: int
    """Newest tokens of each sequence kept in fp16 (KIVI's residual)."""


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), path
    return data


@lru_cache(maxsize=None)
def load_device(name: str) -> DeviceSpec:
    path = DATA_DIR / "devices" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown device {name!r}; known: {', '.join(device_names())}")
    raw = _load(path)
    fields = {k: v["value"] for k, v in raw.items() if isinstance(v, dict)}
    sources = {k: v["source"] for k, v in raw.items() if isinstance(v, dict)}
    return DeviceSpec(name=raw["name"], description=raw["description"], sources=sources,
                      **{k: (bool(v) if isinstance(v, bool) else float(v)) for k, v in fields.items()})


def device_names() -> list[str]:
    return sorted(p.stem for p in (DATA_DIR / "devices").glob("*.yaml"))


@lru_cache(maxsize=None)
def load_formats() -> dict[str, KVFormat]:
    raw = _load(DATA_DIR / "kv_formats.yaml")
    return {name: KVFormat(name, float(f["bits_per_value"]["value"]), float(f["dequant_instr_per_value"]["value"]),
                           int(f["residual_fp16_tokens"]["value"])) for name, f in raw.items()}


# name -> (device, KV format, what runs on it)
SYSTEMS: dict[str, tuple[str, str, str]] = {
    "oaken-lpddr": ("oaken-lpddr", "oaken", "Oaken accelerator, LPDDR, Oaken KV"),
    "oaken-hbm": ("oaken-hbm", "oaken", "Oaken accelerator, HBM, Oaken KV"),
    "lpu-lpddr": ("oaken-lpddr", "fp16", "the same accelerator without Oaken (LPU), fp16 KV"),
    "lpu-hbm": ("oaken-hbm", "fp16", "LPU-style accelerator, HBM, fp16 KV"),
    "a100-vllm": ("a100-80gb", "fp16", "A100 80GB, vLLM fp16"),
    "a100-kivi": ("a100-80gb", "kivi4", "A100 80GB, KIVI 4-bit KV"),
    "a100-qserve": ("a100-80gb", "qserve_kv4", "A100 80GB, QServe KV4 (weights fp16, KV-only)"),
    "h100-vllm": ("h100-sxm", "fp16", "H100 SXM, vLLM fp16"),
}


@dataclass(frozen=True)
class LayeredKV:
    """Layered KV sparsity (`hetserve serve --kv-policy layered`): the first `full_layers` layers keep every token
    of a sequence, the others at most a budget of tokens once its prompt has been computed (`budget_tokens`, or
    `budget_ratio` of the prompt; while a prompt is prefilled every layer holds all of it)."""
    full_layers: int
    budget_tokens: int | None = None
    budget_ratio: float | None = None

    def __post_init__(self):
        if (self.budget_tokens is None) == (self.budget_ratio is None):
            raise ValueError("layered KV takes one of budget_tokens and budget_ratio")
        if self.full_layers < 0 or (self.budget_tokens is not None and self.budget_tokens < 1) or \
                (self.budget_ratio is not None and not 0 < self.budget_ratio <= 1):
            raise ValueError(f"layered KV needs full_layers >= 0 and a budget of >= 1 token or a ratio in (0, 1]: "
                             f"{self}")

    def budget(self, prompt: int) -> int:
        """Tokens a sparse layer keeps of a sequence whose prompt (with any output recomputed) had `prompt`."""
        if self.budget_tokens is not None:
            return self.budget_tokens
        return max(1, math.ceil(self.budget_ratio * prompt))


@dataclass(frozen=True)
class System:
    name: str
    device: DeviceSpec
    fmt: KVFormat
    model: ModelShape
    num_devices: int
    """Pipeline stages holding one model replica."""
    weight_bits: float = 16.0
    """Bits per weight of the model's weights (WEIGHT_FORMAT_BITS)."""
    layered: LayeredKV | None = None
    """Layered KV sparsity; None: every layer keeps every token."""

    @property
    def full_layer_share(self) -> float:
        """The share of the KV layers that keep every token (1 without layered KV)."""
        return 1.0 if self.layered is None else self.layered.full_layers / self.model.num_layers

    @property
    def weight_bytes(self) -> float:
        return self.model.total_params * self.weight_bits / 8

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.kv_values_per_token * self.fmt.bits_per_value / 8

    def seq_kv_bytes(self, seq_len: float) -> float:
        """KV bytes one sequence of `seq_len` tokens holds (window-capped, KIVI residual in fp16)."""
        n = self.model.kv_tokens(seq_len)
        residual = min(n, self.fmt.residual_fp16_tokens) * self.model.kv_values_per_token * \
            (16 - self.fmt.bits_per_value) / 8
        return n * self.kv_bytes_per_token + residual

    @property
    def per_seq_overhead_tokens(self) -> float:
        """KIVI's fp16 residual expressed in tokens of this format (0 for the others)."""
        return self.fmt.residual_fp16_tokens * (16 - self.fmt.bits_per_value) / self.fmt.bits_per_value

    @property
    def kv_capacity_bytes(self) -> float:
        """Memory left for KV on all stages after the weights (may be <= 0: the model does not fit)."""
        d = self.device
        return self.num_devices * d.mem_bytes * d.usable_mem_fraction - self.weight_bytes

    @property
    def kv_capacity_tokens(self) -> int:
        return max(0, int(self.kv_capacity_bytes // self.kv_bytes_per_token))

    def fits_batch(self, batch: int, seq_len: int) -> bool:
        """Whether `batch` sequences of `seq_len` tokens all fit at once (the paper's OOM criterion)."""
        return self.kv_capacity_bytes >= batch * self.seq_kv_bytes(seq_len)


def auto_num_devices(device: DeviceSpec, model: ModelShape, min_kv_fraction: float = 0.1,
                     weight_bits: float = 16.0) -> int:
    """Fewest pipeline stages whose memory holds the weights and leaves `min_kv_fraction` for KV."""
    usable = device.mem_bytes * device.usable_mem_fraction
    return max(1, math.ceil(model.total_params * weight_bits / 8 / (usable * (1 - min_kv_fraction))))


def make_system(name: str, model: ModelShape, num_devices: int | None = None, weight_format: str = "auto",
                layered: LayeredKV | None = None) -> System:
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    if weight_format not in WEIGHT_FORMAT_BITS:
        raise ValueError(f"unknown weight format {weight_format!r}; known: {', '.join(WEIGHT_FORMAT_BITS)}")
    device_name, fmt_name, _ = SYSTEMS[name]
    device = load_device(device_name)
    bits = WEIGHT_FORMAT_BITS[weight_format]
    n = num_devices or auto_num_devices(device, model, weight_bits=bits)
    if layered is not None and layered.full_layers > model.num_layers:
        raise ValueError(f"{layered.full_layers} full layers: {model.name} has {model.num_layers}")
    return System(name, device, load_formats()[fmt_name], model, n, bits, layered)
