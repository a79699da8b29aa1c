"""The linear layers' weight format (`--weight-format`): what it means, MX conversion of a model's
dense weights with its cache, and packed MX safetensors (`hetserve quantize`).

    auto   the loader's default: GGUF blocks where the model has them, `cpu_linear_dtype` linears
    gguf   the GGUF's own Q4_1 / Q8_0 blocks (gpu_model/quant.py) for steps up to the block limit
    mxfp8, mxfp6, mxfp6_e3m2, mxfp4, mxint8   OCP MX weights (gpu_model/mx.py) for steps up to the block limit
    bf16, fp32   dense linears in that dtype, no blocks

With an MX format the dense copy that larger steps (prefill) multiply by holds the MX values too
(decoded once at load), so every step computes with the same weights. The packed file stores one
MXWeight per Hugging Face linear (`model.layers.3.self_attn.q_proj.weight`, ...; the LM head as
`lm_head.weight`) as `<name>.codes` and `<name>.scales`, and its metadata names the format.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_model.mx_device import DeviceMXWeight
from gpu_model.mx_weight import ROTATIONS, MXWeight
from gpu_model.quant import BlockWeight
from gpu_model.quant_vnni import MX_KINDS, VnniWeight, mx_available

WEIGHT_FORMATS = ("auto", "gguf", "mxfp8", "mxfp6", "mxfp6_e3m2", "mxfp4", "mxint8", "bf16", "fp32")
MX_FORMATS = ("mxfp8", "mxfp6", "mxfp6_e3m2", "mxfp4", "mxint8")
HEAD_CHOICES = ("same", "dense")
MX_FILE = "mx_weights.safetensors"
MX_LAYOUT = "1"
"""Version of the packed layout (gpu_model/mx.py) a packed file holds; others are refused."""
HEAD = "lm_head.weight"
log = logging.getLogger(__name__)
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


class WeightFormatError(ValueError):
    """A weight format that cannot be used, or a packed file that does not hold what it says."""


@dataclass(frozen=True)
class WeightFormat:
    name: str = "auto"
    """One of WEIGHT_FORMATS (module docstring)."""
    rotation: str = "none"
    """MX formats: none, or hadamard (a block Hadamard rotation of the input dimension, gpu_model/mx_weight.py)."""
    head: str = "same"
    """MX formats: same (the LM head takes the format too) or dense (it keeps the linears' dense dtype)."""

    def __post_init__(self) -> None:
        if self.name not in WEIGHT_FORMATS:
            raise WeightFormatError(f"unknown weight format {self.name!r}; choose from {', '.join(WEIGHT_FORMATS)}")
        if self.rotation not in ROTATIONS:
            raise WeightFormatError(f"unknown weight rotation {self.rotation!r}; choose from {', '.join(ROTATIONS)}")
        if self.rotation != "none" and not self.is_mx:
            raise WeightFormatError(f"weight rotation {self.rotation} needs an MX weight format, not {self.name}")
        if self.head not in HEAD_CHOICES:
            raise WeightFormatError(f"weight format head must be one of {', '.join(HEAD_CHOICES)}, not {self.head!r}")

    @property
    def is_mx(self) -> bool:
        return self.name in MX_FORMATS

    @property
    def variant(self) -> str:
        """A file-name-safe label: mxfp4, mxfp4-hadamard, mxfp4-dense-head."""
        return "-".join([self.name] + ([self.rotation] if self.rotation != "none" else [])
                        + (["dense-head"] if self.head == "dense" else []))


def linear_names(num_layers: int, with_head: bool) -> list[str]:
    names = [f"model.layers.{i}.{p}.weight" for i in range(num_layers) for p in _PROJECTIONS]
    return names + [HEAD] if with_head else names


def convert(dense: dict[str, torch.Tensor], names: list[str], wf: WeightFormat) -> dict[str, MXWeight]:
    """dense: Hugging Face tensors ([N, K] each) -> MX copies of `names`, with a progress bar."""
    from tqdm import tqdm

    out = {}
    for name in tqdm(names, desc=f"converting to {wf.variant}", unit="tensor", leave=False):
        out[name] = MXWeight.encode(dense[name].float().numpy(), wf.name, wf.rotation)
    return out


def save_packed(weights: dict[str, MXWeight], path: Path, wf: WeightFormat) -> None:
    """One safetensors file: <name>.codes, <name>.scales per weight; metadata: the format, and each
    weight's input size."""
    from safetensors.numpy import save_file

    tensors, shapes = {}, {}
    for name, w in weights.items():
        tensors[name + ".codes"], tensors[name + ".scales"] = w.codes, w.scales
        shapes[name] = w.in_features
    meta = {"weight_format": wf.name, "weight_rotation": wf.rotation, "weight_format_head": wf.head,
            "mx_layout": MX_LAYOUT, "in_features": json.dumps(shapes)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{id(weights)}")
    save_file(tensors, tmp, metadata=meta)
    tmp.replace(path)


def load_packed(path: Path) -> tuple[WeightFormat, dict[str, MXWeight]]:
    """The format and weights of a packed file; WeightFormatError naming the tensor that does not
    match the metadata."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
        try:
            wf = WeightFormat(meta["weight_format"], meta.get("weight_rotation", "none"),
                              meta.get("weight_format_head", "same"))
            shapes = json.loads(meta["in_features"])
        except (KeyError, ValueError) as exc:
            raise WeightFormatError(f"{path}: metadata does not name an MX weight format ({exc})") from None
        if not wf.is_mx:
            raise WeightFormatError(f"{path}: metadata names {wf.name}, not an MX format")
        if meta.get("mx_layout") != MX_LAYOUT:
            raise WeightFormatError(f"{path}: packed layout {meta.get('mx_layout')}, this version reads {MX_LAYOUT}")
        keys = set(f.keys())
        extra = sorted(keys - {n + s for n in shapes for s in (".codes", ".scales")})
        if extra:
            raise WeightFormatError(f"{path}: tensor {extra[0]} is not in the metadata")
        out = {}
        for name, k in shapes.items():
            if name + ".codes" not in keys or name + ".scales" not in keys:
                raise WeightFormatError(f"{path}: tensor {name}: codes or scales missing")
            try:
                codes, scales = f.get_tensor(name + ".codes"), f.get_tensor(name + ".scales")
                out[name] = MXWeight(wf.name, codes, scales, int(k), wf.rotation)
            except ValueError as exc:
                raise WeightFormatError(f"{path}: tensor {name} does not hold {wf.name} weights: {exc}") from None
    return wf, out


def cache_path(cache_dir: Path, model_dir: Path, wf: WeightFormat) -> Path:
    """Where the MX copy of the model in `model_dir` is cached: keyed by the model's weights files
    (path, size, mtime) and the format variant."""
    files = sorted(model_dir.glob("*.safetensors"))
    stamp = ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    key = hashlib.sha1(stamp.encode()).hexdigest()[:12]
    return cache_dir / "weight-formats" / f"{model_dir.name}-{key}" / f"{wf.variant}-layout{MX_LAYOUT}.safetensors"


def mx_weights(dense: dict[str, torch.Tensor], names: list[str], wf: WeightFormat,
               cache: Path | None) -> dict[str, MXWeight]:
    """MX copies of `names`: read from `cache` when it holds this variant, else converted (and cached)."""
    if cache is not None and cache.exists():
        try:
            cached_wf, weights = load_packed(cache)
            if cached_wf == wf and set(names) <= set(weights):
                return weights
        except WeightFormatError as exc:  # a damaged cache file: convert again
            log.warning("converting again: %s", exc)
    weights = convert(dense, names, wf)
    if cache is not None:
        save_packed(weights, cache, wf)
    return weights


def fused(weights: dict[str, MXWeight], num_layers: int) -> dict[str, MXWeight]:
    """Hugging Face names -> LlamaModel's matmul keys (layers.3.qkv, ..., head), rows stacked."""
    out = {}
    for i in range(num_layers):
        for key, parts in _FUSED.items():
            out[f"layers.{i}.{key}"] = MXWeight.concat([weights[f"model.layers.{i}.{p}.weight"] for p in parts])
    if HEAD in weights:
        out["head"] = weights[HEAD]
    return out


def dense_with_mx(sd: dict[str, torch.Tensor], model_dir: Path, wf: WeightFormat, num_layers: int,
                  is_tied: bool, cache: Path | None) -> tuple[WeightFormat, dict[str, MXWeight] | None]:
    """Put MX values into the Hugging Face state dict `sd` (in place) for the linears (and an untied
    head) and return the format in force and the MX weights (None without an MX format). A packed
    directory's own weights (MX_FILE) are used when `wf` is auto or names the same variant."""
    packed_file = model_dir / MX_FILE
    if packed_file.exists():
        packed_wf, weights = load_packed(packed_file)
        if wf.name != "auto" and wf != packed_wf:
            raise WeightFormatError(f"{model_dir} holds {packed_wf.variant} weights: pass --weight-format auto or "
                                    f"its own format, not {wf.variant}")
        wf = packed_wf
    elif wf.is_mx:
        names = linear_names(num_layers, with_head=wf.head == "same")
        dense = {**sd, HEAD: sd["model.embed_tokens.weight"]} if is_tied else sd
        weights = mx_weights(dense, names, wf, cache)
    else:
        return wf, None
    for name, w in weights.items():
        if not (name == HEAD and is_tied):  # a tied head keeps the dense embedding table for lookups
            sd[name] = torch.from_numpy(w.dense())
    return wf, weights


def vnni_layout(w: MXWeight) -> VnniWeight | None:
    """w in the integer-dot layout (gpu_model/quant_vnni.py) where this CPU runs its format so; else None."""
    if w.in_features % 32 or not mx_available(w.fmt):
        return None
    return VnniWeight.from_mx(w.fmt, w.codes, w.scales, w.rotation)


def attach(model, weights: dict[str, MXWeight], max_tokens: int, vnni: bool = False) -> None:
    """Multiply steps of at most `max_tokens` tokens by `weights` (Hugging Face names); with `vnni`, by the
    integer-dot kernels (x rounded to int16 per block of 32) where vnni_layout takes a weight."""
    blocks: dict[str, BlockWeight] = {}
    for key, w in fused(weights, model.cfg.num_layers).items():
        blocks[key] = (vnni_layout(w) if vnni else None) or w
    model.attach_blocks(blocks, max_tokens)
    tied_head_values(model, weights)


def attach_device(model, weights: dict[str, MXWeight]) -> None:
    """Every step multiplies by the MX weights kept packed on the model's device (gpu_model/mx_device.py), and
    the dense linears they replace are dropped (their shapes stay, on the meta device): the device holds the
    format's bytes, not bf16's. A tied head in the format leaves the embedding table dense for lookups."""
    from gpu_model.model import ALL_STEPS, LINEARS

    blocks = {key: DeviceMXWeight(w, model.device) for key, w in fused(weights, model.cfg.num_layers).items()}
    model.attach_blocks(blocks, ALL_STEPS)
    linears = [getattr(layer, name) for layer in model.layers for name in LINEARS]
    if "head" in blocks:
        model.head_weight = None
        if model.lm_head is not None:
            linears.append(model.lm_head)
    for linear in linears:
        linear.weight = torch.nn.Parameter(linear.weight.to("meta"), requires_grad=False)
    if model.device.type == "cuda":  # hand the dense copies' memory back, so that free memory (the KV pool) sees it
        torch.cuda.empty_cache()


def tied_head_values(model, weights: dict[str, MXWeight]) -> None:
    """A quantized head tied to the embeddings: larger steps multiply by its MX values too, as the
    linears do (the embedding lookup keeps the dense table)."""
    from gpu_model.model import pack_for_onednn

    if HEAD in weights and model.lm_head is None:
        model.head_weight = torch.from_numpy(weights[HEAD].dense()).to(model.device, model.linear_dtype)
        if "head" in model.packed:
            packed = pack_for_onednn({"head": model.head_weight})
            if packed:
                model.packed["head"] = packed["head"]
            else:
                del model.packed["head"]


def weight_bits(model) -> float:
    """Bits per weight of the matmuls a decode step reads (linears and head), scales included: the
    block copy's where a matmul has one, else its dense dtype's."""
    nominal = {"q4_1": 5.0, "q8_0": 8.5}
    total_bits = total = 0.0
    for key, w in model.matmul_weights().items():
        q = model.quant.get(key) if model.quant_max_tokens > 0 else None
        if q is None:
            bits = 8 * w.element_size()
        elif isinstance(q, (MXWeight, DeviceMXWeight)) or q.kind in MX_KINDS:
            bits = q.bits_per_weight
        else:
            bits = nominal[q.kind]
        total_bits += bits * w.numel()
        total += w.numel()
    return total_bits / total
