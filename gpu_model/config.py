"""Model configuration read from a Hugging Face `config.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-architecture decoder."""

    vocab_size: int = 49152
    """Number of token ids."""
    hidden_size: int = 576
    """Residual stream width."""
    intermediate_size: int = 1536
    """SwiGLU inner width."""
    num_layers: int = 30
    """Decoder layers."""
    num_heads: int = 9
    """Query heads."""
    num_kv_heads: int = 3
    """Key/value heads (GQA when fewer than num_heads)."""
    head_dim: int = 64
    """Width of one head."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    """RoPE scaling parameters as sorted (key, value) pairs; None for plain RoPE."""
    max_position_embeddings: int = 8192
    """Context length the model was trained for."""
    tie_word_embeddings: bool = True
    """Whether the output head reuses the embedding matrix."""
    bos_token_id: int | None = 1
    """Beginning-of-sequence token."""
    eos_token_ids: tuple[int, ...] = (2,)
    """Tokens that end generation."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a parsed Hugging Face LlamaConfig dict (transformers 4.x or 5.x keys)."""
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        eos = hf.get("eos_token_id", 2)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads", num_heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else tuple(sorted({**scaling, "rope_type": rope_type}.items())),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        return cls.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
