"""--weight-format: MX conversion at load and its cache, packed directories (`hetserve quantize`),
the serving path with MX linears, and bad input."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpu_model.loader import (GGUF_BLOCKS_MAX_TOKENS_BF16, GGUF_BLOCKS_MAX_TOKENS_TILES, TILE_MIN_TOKENS,
                              ModelLoadError, load_model)
from gpu_model.quant_amx import is_available as has_tiles
from gpu_model.mx_weight import MXWeight
from gpu_model.quant_vnni import VnniWeight, mx_available
from gpu_model.weight_format import (MX_FILE, WeightFormat, WeightFormatError, attach_device, load_packed, save_packed,
                                     weight_bits)
from server.config import ServeConfig
from tests.test_model import greedy_through_backend, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))[0]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp6", "mxfp6_e3m2", "mxfp4", "mxint8"])
def test_load_converts_and_caches(model_dir, tmp_path, fmt):
    model = load_model(model_dir, cpu_linear_dtype="float32", weight_format=WeightFormat(fmt), cache_dir=tmp_path)
    assert sorted(model.quant) == sorted([f"layers.{i}.{k}" for i in range(2) for k in ("qkv", "o", "gate_up", "down")]
                                         + ["head"])
    qkv = model.quant["layers.1.qkv"]
    assert isinstance(qkv, MXWeight) and qkv.fmt == fmt
    # the dense copy (prefill) holds the very values the kernels multiply by
    assert torch.equal(model.layers[1].qkv.weight, torch.from_numpy(qkv.decode()))
    assert torch.equal(model.matmul_weights()["head"], torch.from_numpy(model.quant["head"].decode()))
    x = torch.randn(3, 64)
    small = model._linear("layers.1.qkv", model.layers[1].qkv.weight, x)
    assert torch.allclose(small, x @ model.layers[1].qkv.weight.T, rtol=1e-5, atol=1e-5)
    assert weight_bits(model) == {"mxfp8": 8.25, "mxfp6": 6.25, "mxfp6_e3m2": 6.25, "mxfp4": 4.25, "mxint8": 8.25}[fmt]
    cached = list(tmp_path.glob(f"weight-formats/*/{fmt}-layout*.safetensors"))
    assert len(cached) == 1
    again = load_model(model_dir, cpu_linear_dtype="float32", weight_format=WeightFormat(fmt), cache_dir=tmp_path)
    assert np.array_equal(again.quant["layers.1.qkv"].codes, qkv.codes)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6", "mxint8"])
def test_beside_bf16_linears_mx_multiplies_with_integer_dots(model_dir, tmp_path, fmt):
    """As the GGUF blocks: steps of up to 16 tokens (32 with AMX tiles from 4) through gpu_model/quant_vnni.py, a
    layer's linears in two calls, the format's bits kept; the products those of the exact MX values to x's int16
    rounding."""
    if not mx_available(fmt):
        pytest.skip(f"this CPU has no integer-dot kernel for {fmt}")
    model = load_model(model_dir, cpu_linear_dtype="bfloat16", weight_format=WeightFormat(fmt), cache_dir=tmp_path)
    assert model.quant_max_tokens == (GGUF_BLOCKS_MAX_TOKENS_TILES if has_tiles() else GGUF_BLOCKS_MAX_TOKENS_BF16)
    assert model.tile_rows == (TILE_MIN_TOKENS if has_tiles() else 0)
    for key, w in model.quant.items():  # the tiny model's head has 101 rows, not whole groups of 16
        assert isinstance(w, VnniWeight) and w.kind == fmt if key != "head" else isinstance(w, MXWeight)
    assert all(d is not None for d in model.decode_weights)
    assert weight_bits(model) == {"mxfp6": 6.25, "mxfp4": 4.25, "mxint8": 8.25}[fmt]
    x = torch.randn(3, 64)
    cached = load_model(model_dir, cpu_linear_dtype="float32", weight_format=WeightFormat(fmt), cache_dir=tmp_path)
    w = torch.from_numpy(cached.quant["layers.1.qkv"].decode())
    got = model._linear("layers.1.qkv", model.layers[1].qkv.weight, x)
    assert ((got - x @ w.T).abs().max() / (x @ w.T).abs().max()).item() < 1e-4


@pytest.mark.parametrize("linears", ["float32", "bfloat16"])  # float MX kernels; integer dots on VNNI CPUs
def test_dense_head_and_rotation(model_dir, tmp_path, linears):
    wf = WeightFormat("mxfp4", "hadamard", "dense")
    model = load_model(model_dir, cpu_linear_dtype=linears, weight_format=wf, cache_dir=tmp_path)
    assert "head" not in model.quant and model.quant["layers.0.o"].rotation == "hadamard"
    x = torch.randn(2, 64)
    exact = load_model(model_dir, cpu_linear_dtype="float32", weight_format=wf, cache_dir=tmp_path).layers[0].o.weight
    got, want = model._linear("layers.0.o", model.layers[0].o.weight, x), x @ exact.T  # bf16's dense copy rounds W
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


@pytest.mark.parametrize("fmt, rotation", [("mxfp8", "none"), ("mxfp6", "none"), ("mxfp4", "hadamard")])
def test_packed_on_the_device_multiplies_as_the_dense_values(model_dir, tmp_path, fmt, rotation):
    """On an accelerator the linears stay packed (attach_device; run here on the CPU): the dense copies are gone,
    every step size decodes the codes per call, and the products are those of a bf16 model holding the MX values."""
    from gpu_model.model import LINEARS

    wf = WeightFormat(fmt, rotation)
    dense = load_model(model_dir, dtype=torch.bfloat16, weight_format=wf, cache_dir=tmp_path)
    packed = load_model(model_dir, dtype=torch.bfloat16, weight_format=wf, cache_dir=tmp_path)
    attach_device(packed, load_packed(next(tmp_path.glob("weight-formats/*/*.safetensors")))[1])
    assert all(getattr(layer, name).weight.is_meta for layer in packed.layers for name in LINEARS)
    assert weight_bits(packed) == {"mxfp8": 8.25, "mxfp6": 6.25, "mxfp4": 4.25}[fmt]
    assert packed.step_weight_bytes(512) == sum(w.nbytes for w in packed.quant.values())
    for rows in (1, 300):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        for key in ("layers.1.qkv", "layers.0.down"):
            weight = dense.matmul_weights()[key]
            x_in = torch.randn(rows, weight.shape[1]).to(torch.bfloat16)
            got, want = packed._linear(key, weight, x_in), dense._linear(key, weight, x_in)
            if rotation == "none":
                assert torch.equal(got, want)
            else:  # x H is rounded to bf16 before the product
                assert ((got - want).abs().max() / want.abs().max()).item() < 0.03
        got, want = packed.logits(x), dense.logits(x)
        assert torch.equal(got, want) if rotation == "none" else torch.allclose(got, want, rtol=0.05, atol=0.05)


def test_serving_path_matches_the_dense_copy(model_dir, tmp_path):
    prompts = [[1, 5, 9, 13, 17, 21, 2], [3, 4, 40, 7]]
    args = dict(weight_format="mxfp6", model_cache_dir=str(tmp_path))
    kernels = greedy_through_backend(model_dir, prompts, 6, **args)
    dense = greedy_through_backend(model_dir, prompts, 6, gguf_blocks_max_tokens=0, **args)
    assert kernels == dense


def test_quantize_writes_a_directory_model_reads_back(model_dir, tmp_path):
    out = tmp_path / "packed"
    run = subprocess.run([sys.executable, "-m", "hetserve", "quantize", "--weight-format", "mxfp4", "--out", str(out),
                          "--model", str(model_dir)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    wf, weights = load_packed(out / MX_FILE)
    assert wf == WeightFormat("mxfp4") and len(weights) == 2 * 7 + 1
    model = load_model(out, cpu_linear_dtype="float32")
    assert model.quant["layers.0.gate_up"].fmt == "mxfp4"
    converted = load_model(model_dir, cpu_linear_dtype="float32", weight_format=WeightFormat("mxfp4"),
                           cache_dir=tmp_path / "cache")
    assert torch.equal(model.layers[0].gate_up.weight, converted.layers[0].gate_up.weight)
    with pytest.raises(ModelLoadError, match="holds mxfp4 weights"):
        load_model(out, weight_format=WeightFormat("mxfp8"))


def test_packed_file_that_disagrees_with_its_metadata_is_refused(tmp_path):
    w = MXWeight.encode(np.ones((4, 64), np.float32), "mxfp6")
    save_packed({"a.weight": w}, tmp_path / "ok.safetensors", WeightFormat("mxfp6"))
    save_packed({"a.weight": w}, tmp_path / "bad.safetensors", WeightFormat("mxfp4"))
    assert load_packed(tmp_path / "ok.safetensors")[1]["a.weight"].fmt == "mxfp6"
    with pytest.raises(WeightFormatError, match="tensor a.weight does not hold mxfp4"):
        load_packed(tmp_path / "bad.safetensors")


def test_bad_input():
    with pytest.raises(WeightFormatError, match="unknown weight format 'mxfp5'"):
        WeightFormat("mxfp5")
    with pytest.raises(WeightFormatError, match="needs an MX weight format"):
        WeightFormat("bf16", rotation="hadamard")
    with pytest.raises(ValueError, match="weight_format must be one of"):
        ServeConfig(weight_format="fp4")
    for argv in (["quantize", "--weight-format", "mxfp5", "--out", "x"],
                 ["quantize", "--weight-format", "bf16", "--out", "x"], ["eval", "--weight-format", "q4"]):
        run = subprocess.run([sys.executable, "-m", "hetserve", *argv], capture_output=True, text=True)
        assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_tied_head_multiplies_by_its_mx_values(tmp_path):
    tied = tiny_model_dir(tmp_path / "tied", tie_word_embeddings=True)[0]
    model = load_model(tied, cpu_linear_dtype="float32", weight_format=WeightFormat("mxfp8"), cache_dir=tmp_path)
    head = torch.from_numpy(model.quant["head"].decode())
    assert torch.equal(model.head_weight, head) and not torch.equal(model.embed_tokens.weight, head)
