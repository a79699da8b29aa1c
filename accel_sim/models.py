"""Model shapes the cost model needs: layer geometry, parameter counts, KV geometry.

Numbers are the public Hugging Face `config.json` of each checkpoint (named in `source`);
parameter counts are derived from them, not copied, so a test can check the derivation
against the published totals (Llama2-7B 6.74 B, OPT-30B 30 B, Mixtral-8x7B 46.7 B ...).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    """Intermediate size of one MLP (of one expert for MoE)."""
    vocab_size: int
    is_gated_mlp: bool
    """SwiGLU (3 matrices: gate, up, down) vs plain 2-matrix MLP (OPT)."""
    is_tied_embeddings: bool
    """LM head shares the embedding matrix (stored once)."""
    num_experts: int = 1
    experts_per_token: int = 1
    sliding_window: int | None = None
    """Tokens a query attends to (Mistral); KV older than this is neither read nor kept."""
    max_position_embeddings: int = 4096
    source: str = ""

    # ---- parameters (counts, not bytes)
    @property
    def attn_params_per_layer(self) -> int:
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q + kv + self.num_heads * self.head_dim * self.hidden_size

    @property
    def expert_params(self) -> int:
        return (3 if self.is_gated_mlp else 2) * self.hidden_size * self.ffn_size

    @property
    def mlp_params_per_layer(self) -> int:
        router = self.hidden_size * self.num_experts if self.num_experts > 1 else 0
        return self.num_experts * self.expert_params + router

    @property
    def layer_params(self) -> int:
        """All decoder layers (norms and biases are < 0.1 % and left out)."""
        return self.num_layers * (self.attn_params_per_layer + self.mlp_params_per_layer)

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        embeddings = self.head_params * (1 if self.is_tied_embeddings else 2)
        return self.layer_params + embeddings

    @property
    def active_layer_params(self) -> int:
        """Decoder-layer parameters one token multiplies by (top-k experts for MoE)."""
        mlp = self.experts_per_token * self.expert_params + (self.hidden_size * self.num_experts
                                                             if self.num_experts > 1 else 0)
        return self.num_layers * (self.attn_params_per_layer + mlp)

    def layer_params_touched(self, num_tokens: float) -> float:
        """Decoder-layer parameters read from memory by a step of `num_tokens` tokens: every
        dense weight once, and for MoE the experts that at least one token routes to, in
        expectation under uniform routing: E * (1 - (1 - k/E)^T)."""
        if self.num_experts == 1:
            return float(self.layer_params)
        e, k = self.num_experts, self.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** max(num_tokens, 1.0))
        return self.num_layers * (self.attn_params_per_layer + touched * self.expert_params
                                  + self.hidden_size * e)

    # ---- KV geometry
    @property
    def kv_values_per_token(self) -> int:
        """K and V values one token adds over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def kv_tokens(self, seq_len: float) -> float:
        """Tokens of KV a sequence of `seq_len` keeps and reads (capped by a sliding window)."""
        return min(seq_len, self.sliding_window) if self.sliding_window else seq_len


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab=32000, source="", **kw) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, kv_heads, hidden // heads, ffn, vocab, True, False,
                      source=source, **kw)


def _opt(name, layers, hidden, heads, source) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, heads, hidden // heads, 4 * hidden, 50272, False, True,
                      max_position_embeddings=2048, source=source)


MODELS: dict[str, ModelShape] = {m.name: m for m in [
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, source="meta-llama/Llama-2-7b-hf config.json"),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, source="meta-llama/Llama-2-13b-hf config.json"),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, source="meta-llama/Llama-2-70b-hf config.json"),
    _opt("opt-1.3b", 24, 2048, 32, "facebook/opt-1.3b config.json"),
    _opt("opt-6.7b", 32, 4096, 32, "facebook/opt-6.7b config.json"),
    _opt("opt-13b", 40, 5120, 40, "facebook/opt-13b config.json"),
    _opt("opt-30b", 48, 7168, 56, "facebook/opt-30b config.json"),
    _llama("mistral-7b", 32, 4096, 32, 8, 14336, sliding_window=4096, max_position_embeddings=32768,
           source="mistralai/Mistral-7B-v0.1 config.json (sliding_window 4096)"),
    _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, num_experts=8, experts_per_token=2,
           max_position_embeddings=32768, source="mistralai/Mixtral-8x7B-v0.1 config.json (8 experts, top-2)"),
    ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True, True, max_position_embeddings=8192,
               source="HuggingFaceTB/SmolLM2-135M-Instruct config.json (the bundled model)"),
]}

# The six models of the Oaken paper's Figure 11 (throughput vs batch), and how many A100s the
# paper gives each (one for the small ones, two in pipeline parallel for the large ones; §7 setup).
PAPER_FIG11_MODELS = ("llama2-7b", "llama2-13b", "mistral-7b", "opt-30b", "mixtral-8x7b", "llama2-70b")
PAPER_GPU_COUNT = {"llama2-7b": 1, "llama2-13b": 1, "mistral-7b": 1, "opt-30b": 2, "mixtral-8x7b": 2,
                   "llama2-70b": 2}


def get_model(name: str) -> ModelShape:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
