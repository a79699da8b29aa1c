"""What a hetero backend is built from: one record for the model and KV cache (BackendConfig), one
for the Ray executor's placement (RayConfig). `hetserve serve` fills both from its ServeConfig
here; benchmarks and tests build them directly. Pure Python: no torch, no numba."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetcore.kv_policy import KVPolicy
from server.config import SPARSE_FRACTION, ServeConfig, offload_runs

if TYPE_CHECKING:
    from cpu_attn.magicpig import LshConfig


@dataclass(frozen=True)
class BackendConfig:
    device: str = "auto"
    """Where the linear layers run: auto (cuda if present), cuda or cpu."""
    dtype: str = "auto"
    """Model dtype: auto (float32 on cpu, bfloat16 on cuda), float32, float16 or bfloat16."""
    cpu_linear_dtype: str = "auto"
    """On the CPU with dtype float32, the linear layers' weights and matmuls: auto, float32 or bfloat16."""
    gguf_blocks_max_tokens: int | None = None
    """On the CPU, steps of at most this many tokens multiply by the GGUF's own quantized blocks (None: the default)."""
    activation_bits: int = 16
    """On the CPU, the bits the integer-dot linears round activations to: 16, or 8 (gpu_model/loader.py)."""
    weight_format: str = "auto"
    """The linear layers' weight format (server.config.WEIGHT_FORMATS; gpu_model/weight_format.py)."""
    weight_rotation: str = "none"
    """MX weight formats: none or hadamard."""
    weight_format_head: str = "same"
    """MX weight formats: same (the LM head takes the format) or dense."""
    model_cache_dir: str = "~/.cache/hetserve/models"
    """Where converted weights (MX formats) are cached."""
    kv_format: str = "fp16"
    """KV cache format of the CPU store (server.config.KV_FORMATS)."""
    kv_capacity_bytes: int = 2**30
    """KV cache capacity in bytes, MagicPIG's state included; the Ray executor splits it among its CPU actors."""
    block_size: int = 16
    """Tokens per KV block."""
    max_model_len: int | None = None
    """Longest prompt plus output in tokens (None: the model's context)."""
    oaken_thresholds_path: str | None = None
    """Oaken thresholds JSON (None: the model cache's, calibrated on first use when missing)."""
    oaken_sparse_fraction: float = SPARSE_FRACTION
    """Oaken sparse entries a KV block has room for, as a share of its values."""
    oaken_recent_blocks: int = 0
    """Oaken: blocks per layer kept in full precision while they fill (0: none)."""
    lsh: LshConfig | None = None
    """MagicPIG's settings for sampled decode attention (None: exact attention)."""
    max_num_seqs: int = 1
    """Most sequences running at once: MagicPIG sets aside room for that many sequences' key centers."""
    kv_policy: KVPolicy = KVPolicy()
    """How many tokens each layer's KV keeps (hetcore/kv_policy.py; layered needs exact attention)."""
    draft_weight_format: str | None = None
    """Speculative self-mx: the weight format of a second copy of the model that drafts (None: none)."""
    draft_model: str | None = None
    """Speculative draft-model: the path of the model that drafts (server/draft_model.py; None: none)."""
    gpu_kv_cache_bytes: int | None = None
    """Partial offload (server/offload.OffloadBackend): a KV pool of this many bytes on the model's device, filled
    first; 0: none; None: where the linears run on a CUDA device, what it has free after the model
    (offload.device_kv_budget), else none (offloads)."""
    gpu_kv_dtype: str = "auto"
    """Partial offload: the accelerator pool's values, auto (the model's dtype) or fp8 (float8 e4m3)."""

    def __post_init__(self) -> None:
        if self.kv_capacity_bytes <= 0 or self.block_size <= 0 or self.max_num_seqs <= 0:
            raise ValueError("kv_capacity_bytes, block_size and max_num_seqs must be positive")
        if self.kv_policy.is_layered and self.lsh is not None:
            raise ValueError("kv_policy layered needs exact attention, not magicpig")

    def offloads(self, cuda: bool) -> bool:
        """Whether a backend built from this record runs partial offload, `cuda`: whether its process has a CUDA
        device (server.config.offload_runs)."""
        return offload_runs(self.gpu_kv_cache_bytes, self.device, cuda)

    def load_model(self, model_dir, device: str, dtype):
        """The model in `model_dir` as this record says (gpu_model.loader.load_model)."""
        from gpu_model.loader import load_model
        from gpu_model.weight_format import WeightFormat

        weight_format = WeightFormat(self.weight_format, self.weight_rotation, self.weight_format_head)
        return load_model(model_dir, device, dtype, self.gguf_blocks_max_tokens, self.cpu_linear_dtype,
                          weight_format, self.model_cache_dir, self.activation_bits)

    @classmethod
    def from_serve_config(cls, cfg: ServeConfig) -> BackendConfig:
        recent = cfg.max_num_seqs if cfg.oaken_recent_blocks is None else cfg.oaken_recent_blocks
        return cls(device=cfg.device, dtype=cfg.dtype, cpu_linear_dtype=cfg.cpu_linear_dtype,
                   gguf_blocks_max_tokens=cfg.gguf_blocks_max_tokens, activation_bits=cfg.activation_bits,
                   weight_format=cfg.weight_format,
                   weight_rotation=cfg.weight_rotation, weight_format_head=cfg.weight_format_head,
                   model_cache_dir=cfg.model_cache_dir, kv_format=cfg.kv_format,
                   kv_capacity_bytes=cfg.kv_capacity_bytes(), block_size=cfg.block_size,
                   max_model_len=cfg.max_model_len, oaken_thresholds_path=cfg.oaken_thresholds,
                   oaken_sparse_fraction=cfg.oaken_sparse_fraction, oaken_recent_blocks=recent,
                   lsh=cfg.lsh_config(), max_num_seqs=cfg.max_num_seqs, kv_policy=cfg.kv_policy_config(),
                   draft_weight_format=cfg.speculative_config().draft_weight_format,
                   draft_model=cfg.speculative_model,
                   gpu_kv_cache_bytes=cfg.gpu_kv_cache_bytes if cfg.offload_possible else 0,
                   gpu_kv_dtype=cfg.gpu_kv_dtype)


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None
    """An existing Ray cluster to join, e.g. auto or HEAD_IP:6379 (None: start a local one)."""
    cpu_actors: int = 0
    """CPU attention actors, one KV shard each; 0: the KV in the model actor's process."""
    actor_cpus: int = 0
    """CPUs (and kernel threads) per CPU attention actor (0: the machine's cores divided by cpu_actors)."""
    kv_resource: str = "kv_node"
    """Custom resource every CPU attention actor needs one of (empty: any node)."""
    microbatches: int = 0
    """Micro-batches per step, so the model actor computes one while the CPU actors attend another (0: auto)."""

    def __post_init__(self) -> None:
        if self.cpu_actors < 0 or self.actor_cpus < 0 or self.microbatches not in (0, 1, 2):
            raise ValueError("cpu_actors must be >= 0, actor_cpus >= 0, microbatches 0, 1 or 2")

    @classmethod
    def from_serve_config(cls, cfg: ServeConfig) -> RayConfig:
        return cls(address=cfg.ray_address, cpu_actors=cfg.ray_cpu_actors, actor_cpus=cfg.ray_actor_cpus,
                   kv_resource=cfg.ray_kv_resource, microbatches=cfg.ray_microbatches)
