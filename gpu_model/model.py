"""A Llama-architecture decoder split into the two halves of a hetero decode step.

Tokens from every sequence in a step are packed into one flat batch (no padding);
positions are per token. Attention itself is not here: the caller runs it between
`pre_attention` and `post_attention` of each layer, on the CPU attention workers.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from cpu_attn.layered_worker import LayeredDecodeKV
from cpu_attn.worker import DecodeKV
from gpu_model.config import ModelConfig
from gpu_model.quant import BlockWeight, QuantWeight
from gpu_model import cpu_decode
from gpu_model.cpu_decode import DecodeStack, DecodeWeights
from gpu_model.quant_amx import block_matmul
from gpu_model.quant_vnni import VnniWeight

LINEARS = ("qkv", "o", "gate_up", "down")
"""A layer's linear modules, in the order a step runs them (fused q|k|v and gate|up)."""
ALL_STEPS = 1 << 62
"""A quant_max_tokens that sends every step to the block weights (MX weights packed on an accelerator)."""


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] with the config's scaling (default, linear, llama3)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    scaling = dict(cfg.rope_scaling or ())
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] (rotate-half layout, as in Hugging Face weights)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv = nn.Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=False)  # fused q|k|v
        self.o = nn.Linear(q_out, cfg.hidden_size, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # fused gate|up
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


def pack_for_onednn(weights: dict[str, torch.Tensor], tokens_hint: int = 16) -> dict[str, torch.Tensor]:
    """bf16 weights [out, in] -> the same in oneDNN's blocked layout (what torch.compile's CPU freezing
    does). A plain bf16 weight is reordered into that layout on every call: at 16 tokens a step the
    reorder is half the matmul's time (SmolLM2's 576 x 1536 qkv: 152 us plain, 76 us packed on an AMX
    Xeon; equal at 512 tokens). Returns {} where this torch has no oneDNN or the packed matmul does not
    give plain linear's result on a probe input (private ops: checked rather than trusted)."""
    if not torch.backends.mkldnn.is_available():
        return {}
    try:
        packed = {key: torch.ops.mkldnn._reorder_linear_weight(w, tokens_hint) for key, w in weights.items()}
        key, w = next(iter(weights.items()))
        probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed[key], None, "none", [], "")
        if not torch.equal(got, nn.functional.linear(probe, w)):
            return {}
    except (RuntimeError, AttributeError):
        return {}
    return packed


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # the loader fills every weight: skip nn.Embedding's random init (on the meta device it imports
        # torch._dynamo, 1.6 s of a server's start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.quant: dict[str, BlockWeight] = {}
        """Block-quantized copies of linears ("layers.3.qkv", "head"), used for small batches: GGUF
        blocks or MX (gpu_model/mx_weight.py)."""
        self.quant_max_tokens = 0
        """Steps with at most this many tokens use `quant` (set by the loader; 0 = never)."""
        self.tile_rows = 0
        """Steps of at least this many tokens multiply integer-dot weights by AMX tiles (gpu_model/quant_amx.py;
        0: never). Set by the loader where the CPU has them."""
        self.decode_weights: list[DecodeWeights | None] = []
        """Per layer, its linears when all four are in the integer-dot layout: such steps run the layer's
        linears in two calls (gpu_model/cpu_decode.py)."""
        self.decode_stack: DecodeStack | None = None
        """On the CPU in float32, with decode_weights of one kind per linear in every layer: all layers' weights
        stacked (decode_weights are views of it), so that a decode step can run every layer in one call
        (decode_layers)."""
        self.head_weight: torch.Tensor | None = None
        """The output projection in the linears' dtype when that is not the embedding's (cast_linears)."""
        self.packed: dict[str, torch.Tensor] = {}
        """bf16 linears ("layers.3.qkv", "head") in oneDNN's own blocked layout, on CPUs (cast_linears)."""

    def _linear(self, key: str, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q = self.quant.get(key)
        if q is not None and x.shape[0] <= self.quant_max_tokens:
            return block_matmul(x, q, self.tile_rows) if isinstance(q, VnniWeight) else q.matmul(x)
        if weight.dtype != x.dtype:  # bf16 linears in an fp32 model (cast_linears)
            packed = self.packed.get(key)
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), packed, None, "none", [], "").to(x.dtype)
            return nn.functional.linear(x.to(weight.dtype), weight).to(x.dtype)
        return nn.functional.linear(x, weight)

    def _decode_weights(self, i: int, x: torch.Tensor) -> DecodeWeights | None:
        return self.decode_weights[i] if self.decode_weights and x.shape[0] <= self.quant_max_tokens else None

    def _normed_linear(self, key: str, weight: torch.Tensor, x: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """_linear of rms_norm(x, norm); the integer-dot kernels do the norm while they round x."""
        q = self.quant.get(key)
        if isinstance(q, VnniWeight) and x.shape[0] <= self.quant_max_tokens:
            return block_matmul(x, q, self.tile_rows, norm=norm, eps=self.cfg.rms_norm_eps)
        return self._linear(key, weight, rms_norm(x, norm, self.cfg.rms_norm_eps))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def linear_dtype(self) -> torch.dtype:
        """The linear layers' weights' dtype: the model's, or bf16 in an fp32 model after cast_linears."""
        return self.layers[0].qkv.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [T] -> x: [T, hidden]"""
        return self.embed_tokens(token_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, 1, D], computed once per step and shared by all layers."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def pre_attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [T, hidden] -> q: [T, Hq, D], k: [T, Hkv, D] (post-RoPE), v: [T, Hkv, D]"""
        cfg, layer = self.cfg, self.layers[i]
        T, num_qk = x.shape[0], cfg.num_heads + cfg.num_kv_heads
        fused = self._decode_weights(i, x)
        if fused is not None:  # norm, qkv and RoPE in one call
            qkv = cpu_decode.pre(x, layer.attn_norm, cfg.rms_norm_eps, fused, cos, sin, num_qk, cfg.head_dim,
                                 self.tile_rows)
            qk = qkv[:, : num_qk * cfg.head_dim].view(T, num_qk, cfg.head_dim)
        else:
            qkv = self._linear(f"layers.{i}.qkv", layer.qkv.weight, rms_norm(x, layer.attn_norm, cfg.rms_norm_eps))
            qk = qkv[:, : num_qk * cfg.head_dim].view(T, num_qk, cfg.head_dim)
            # q and k sit side by side in the fused projection: rotate both in one pass
            if qkv.device.type == "cpu" and qkv.dtype == torch.float32:
                cpu_decode.rope_rows(qkv.numpy(), num_qk, cfg.head_dim, cos.numpy().reshape(T, -1),
                                     sin.numpy().reshape(T, -1))
            else:
                qk = apply_rope(qk, cos, sin)
        v = qkv[:, num_qk * cfg.head_dim :].reshape(T, cfg.num_kv_heads, cfg.head_dim)
        return qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], v

    def post_attention(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] (layer input), attn: [T, Hq * D] -> next layer input [T, hidden]"""
        layer, eps = self.layers[i], self.cfg.rms_norm_eps
        fused = self._decode_weights(i, x)
        if fused is not None:  # o, residual, norm, gate_up, silu * up, down, residual in one call
            return cpu_decode.post(x, attn, layer.mlp_norm, eps, fused, self.tile_rows)
        h = x + self._linear(f"layers.{i}.o", layer.o.weight, attn)
        gate, up = self._linear(f"layers.{i}.gate_up", layer.gate_up.weight, rms_norm(h, layer.mlp_norm, eps)).chunk(2, -1)
        return h + self._linear(f"layers.{i}.down", layer.down.weight, nn.functional.silu(gate) * up)

    def decode_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv: DecodeKV | LayeredDecodeKV) -> tuple[torch.Tensor, float]:
        """Every layer of a step of decode rows in one call (cpu_decode.decode_layers; kv: the attention
        worker's DecodeKV; needs decode_stack and at most quant_max_tokens tokens) -> the last layer's output
        [T, hidden] and the share of the time spent writing and attending KV."""
        assert self.decode_stack is not None and x.shape[0] <= self.quant_max_tokens
        out = x.detach().numpy().copy()
        share = cpu_decode.decode_layers(out, self.decode_stack, self.cfg.rms_norm_eps,
                                         cos.numpy().reshape(x.shape[0], -1), sin.numpy().reshape(x.shape[0], -1), kv,
                                         self.cfg.num_heads, self.tile_rows)
        return torch.from_numpy(out), share

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] -> [N, vocab] in float32."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self._normed_linear("head", w if self.head_weight is None else self.head_weight, x, self.norm).float()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in Hugging Face's LlamaForCausalLM, fusing qkv and gate|up."""
        own: dict[str, torch.Tensor] = {"embed_tokens.weight": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            own[f"layers.{i}.attn_norm"] = sd[p + "input_layernorm.weight"]
            own[f"layers.{i}.qkv.weight"] = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            own[f"layers.{i}.o.weight"] = sd[p + "self_attn.o_proj.weight"]
            own[f"layers.{i}.mlp_norm"] = sd[p + "post_attention_layernorm.weight"]
            own[f"layers.{i}.gate_up.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
            own[f"layers.{i}.down.weight"] = sd[p + "mlp.down_proj.weight"]
        if self.lm_head is not None:
            own["lm_head.weight"] = sd["lm_head.weight"]
        self.load_state_dict(own, strict=True)

    def cast_linears(self, dtype: torch.dtype, pack: bool = False) -> None:
        """Keep the linear layers' weights (and the output projection's) in `dtype` while the
        embeddings, norms and activations between the matmuls stay in the model's dtype: on a
        CPU with native bf16 dot products (AVX512-BF16, AMX) bf16 matmuls run 3-4x faster than
        fp32 at 2 to 512 tokens a step (README: Usage, `cpu_linear_dtype`). With `pack` (CPUs with
        native bf16) they are also kept in oneDNN's blocked layout (pack_for_onednn)."""
        for layer in self.layers:
            for name in LINEARS:
                getattr(layer, name).to(dtype)
        if self.lm_head is not None:
            self.lm_head.to(dtype)
        else:
            self.head_weight = self.embed_tokens.weight.to(dtype)
        if pack and dtype == torch.bfloat16 and self.device.type == "cpu":
            self.packed = pack_for_onednn(self.matmul_weights())

    def matmul_weights(self) -> dict[str, torch.Tensor]:
        """Every matmul's weight by its _linear key, in the order a step runs them (the head last)."""
        out = {f"layers.{i}.{name}": getattr(layer, name).weight
               for i, layer in enumerate(self.layers) for name in LINEARS}
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        out["head"] = head if self.head_weight is None else self.head_weight  # as logits() picks it
        return out

    def step_weight_bytes(self, num_tokens: int) -> int:
        """The bytes of linear weights a step of `num_tokens` tokens (and as many logits) reads: the block copies
        where such a step uses them, else the dense weights (bf16 ones where cast_linears made them)."""
        total = 0
        for key, weight in self.matmul_weights().items():
            q = self.quant.get(key)
            if q is not None and num_tokens <= self.quant_max_tokens:
                total += q.nbytes
            else:
                packed = self.packed.get(key)
                total += weight.numel() * weight.element_size() if packed is None else packed.numel() * packed.element_size()
        return total

    def attach_quant(self, sd: dict[str, QuantWeight], max_tokens: int, vnni: bool = False, x_bits: int = 16) -> None:
        """Use GGUF blocks (Hugging Face names) for steps of at most `max_tokens` tokens. With `vnni` (a CPU
        with AVX512-VNNI) they multiply x rounded to int16 per block (gpu_model/quant_vnni.py, ~2^-16 of
        each value; to int8 with x_bits 8); else x in float32, which gives the fp32 copy's products exactly."""
        def layout(w: QuantWeight) -> BlockWeight:
            return VnniWeight.from_blocks(w, x_bits) if vnni and VnniWeight.fits(w) else w

        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            fused = {
                "qkv": [sd.get(p + f"self_attn.{n}_proj.weight") for n in "qkv"],
                "gate_up": [sd.get(p + "mlp.gate_proj.weight"), sd.get(p + "mlp.up_proj.weight")],
                "o": [sd.get(p + "self_attn.o_proj.weight")],
                "down": [sd.get(p + "mlp.down_proj.weight")],
            }
            for key, parts in fused.items():
                w = QuantWeight.concat(parts)
                if w is not None:
                    self.quant[f"layers.{i}.{key}"] = layout(w)
        head = sd.get("model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight")
        if head is not None:
            self.quant["head"] = layout(head)
        self.attach_blocks({}, max_tokens)

    def attach_blocks(self, blocks: dict[str, BlockWeight], max_tokens: int) -> None:
        """Add block weights (matmul keys: layers.3.qkv, ..., head) and use them for steps of at most `max_tokens`
        tokens; a layer whose four linears are all in the integer-dot layout runs them in two calls
        (gpu_model/cpu_decode.py)."""
        self.quant.update(blocks)
        self.quant_max_tokens = max_tokens
        layers = [tuple(self.quant.get(f"layers.{i}.{name}") for name in LINEARS) for i in range(self.cfg.num_layers)]
        self.decode_weights = [DecodeWeights(*ws) if all(isinstance(w, VnniWeight) for w in ws) else None
                               for ws in layers]
        self.decode_stack = None
        if self.device.type == "cpu" and self.dtype == torch.float32:
            norms = [torch.stack([getattr(layer, name).detach() for layer in self.layers]) for name in ("attn_norm",
                                                                                                      "mlp_norm")]
            stacked = cpu_decode.stack_layers(self.decode_weights, *(n.numpy() for n in norms))
            if stacked is not None:
                self.decode_stack, self.decode_weights = stacked
                for i, layer in enumerate(self.layers):  # the norms live in the stack: a later load writes both
                    layer.attn_norm.data, layer.mlp_norm.data = norms[0][i], norms[1][i]
                    for name, w in zip(LINEARS, self.decode_weights[i]):
                        self.quant[f"layers.{i}.{name}"] = w
