"""GGUF block weights: exact against the dequantized copy, matmul kernels against NumPy."""
import numpy as np
import pytest
import torch

from gpu_model.quant import QuantWeight, from_gguf_rows, hf_row_order, quant_matmul


def random_blocks(kind, num_rows, num_blocks, rng):
    d = rng.uniform(-0.05, 0.05, (num_rows, num_blocks, 1)).astype(np.float16).view(np.uint8)
    if kind == "q8_0":
        q = rng.integers(-128, 128, (num_rows, num_blocks, 32)).astype(np.int8).view(np.uint8)
        return np.concatenate([d, q], axis=-1).reshape(num_rows, -1)
    m = rng.uniform(-0.1, 0.1, (num_rows, num_blocks, 1)).astype(np.float16).view(np.uint8)
    q = rng.integers(0, 256, (num_rows, num_blocks, 16)).astype(np.uint8)
    return np.concatenate([d, m, q], axis=-1).reshape(num_rows, -1)


def reference_dequant(kind, raw):
    """Straight from the ggml block definitions, in float64."""
    num_rows = raw.shape[0]
    width = 34 if kind == "q8_0" else 20
    blocks = raw.reshape(num_rows, -1, width)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)
    if kind == "q8_0":
        return (d * blocks[..., 2:].view(np.int8)).reshape(num_rows, -1)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    q = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], axis=-1)
    return (d * q + m).reshape(num_rows, -1)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 33])  # matvec; matmul: odd, even (row pairs), odd
def test_matmul_matches_numpy(kind, num_tokens):
    rng = np.random.default_rng(0)
    raw = random_blocks(kind, num_rows=37, num_blocks=6, rng=rng)
    w = from_gguf_rows(raw, kind)
    dense = reference_dequant(kind, raw)
    np.testing.assert_array_equal(w.dequantize(), dense.astype(np.float32))
    x = rng.standard_normal((num_tokens, 6 * 32)).astype(np.float32)
    got = quant_matmul(torch.from_numpy(x), w).numpy()
    ref = x.astype(np.float64) @ dense.T
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    zero = quant_matmul(torch.zeros(num_tokens, 6 * 32), w).numpy()
    assert not zero.any()


def test_concat_refuses_mixed_formats():
    rng = np.random.default_rng(1)
    a = from_gguf_rows(random_blocks("q4_1", 4, 2, rng), "q4_1")
    b = from_gguf_rows(random_blocks("q8_0", 4, 2, rng), "q8_0")
    assert QuantWeight.concat([a, b]) is None
    assert QuantWeight.concat([a, a]).shape == (8, 64)


def test_row_order_undoes_llama_cpp_permutation():
    # llama.cpp's convert script: w.reshape(heads, 2, rows // heads // 2, ...).swapaxes(1, 2)
    heads, rows = 3, 24
    hf = np.arange(rows)
    gguf = hf.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)
    assert (gguf[hf_row_order(rows, heads)] == hf).all()


def test_default_gguf_blocks_equal_the_dequantized_weights(server):
    """Every Q4_1/Q8_0 tensor of the bundled model, q/k rows reordered, equals transformers' fp32 copy."""
    from safetensors.torch import load_file

    from gpu_model.loader import QUANT_FILE
    from gpu_model.quant import load_quant

    model_dir = server.engine.backend.model_dir
    blocks = load_quant(model_dir / QUANT_FILE)
    dense = load_file(model_dir / "model.safetensors")
    assert len(blocks) == 30 * 7 + 1
    for name, w in blocks.items():
        np.testing.assert_array_equal(w.dequantize(), dense[name].numpy(), err_msg=name)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_matvec_row_does_not_depend_on_its_partner(kind):
    """A row of x gets the same bits alone as paired with another (the matvec kernel's two-row path)."""
    rng = np.random.default_rng(2)
    w = from_gguf_rows(random_blocks(kind, num_rows=21, num_blocks=5, rng=rng), kind)
    x = torch.from_numpy(rng.standard_normal((2, 5 * 32)).astype(np.float32))
    pair, alone = quant_matmul(x, w).numpy(), quant_matmul(x[:1], w).numpy()
    np.testing.assert_array_equal(pair[:1], alone)
    np.testing.assert_array_equal(pair[1:], quant_matmul(x[1:], w).numpy())
