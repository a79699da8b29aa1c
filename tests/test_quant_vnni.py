"""GGUF blocks and MX weights with integer dot products: against a NumPy twin of the kernel's arithmetic (x
rounded to int16 per block, exact integer dots, float scales), and against the exact product within the
rounding's stated bound."""
import numpy as np
import pytest
import torch

from gpu_model.model import rms_norm
from gpu_model.quant import from_gguf_rows
from gpu_model.mx_weight import MXWeight, rotate
from gpu_model.quant_vnni import VnniWeight, is_available, mx_available, vnni_matmul, x8_available
from tests.test_quant import random_blocks

pytestmark = pytest.mark.skipif(not is_available(), reason="this CPU has no integer dots (AVX512-VNNI or AVX2)")


def rounded(v: np.ndarray, qmax: int = 32767) -> np.ndarray:
    """x rounded per block of 32 as the kernels do: scale max |v| / qmax (float32), round half to even."""
    blocks = v.reshape(v.shape[0], -1, 32)
    scale = (np.abs(blocks).max(-1, keepdims=True) / np.float32(qmax)).astype(np.float32)
    q = np.where(scale > 0, np.rint(blocks / np.where(scale > 0, scale, 1)), 0)
    return (q * scale.astype(np.float64)).reshape(v.shape)


KINDS = ["q4_1", "q4_1x8", "q8_0", "q8_0x8", "mxfp4", "mxfp6", "mxint8"]
"""q4_1x8, q8_0x8: the GGUF kind with 8-bit activations (x rounded to max |x| / 127 per block)."""


def qmax_of(kind: str) -> int:
    return 127 if kind.endswith("x8") else 32767


class MXBlocks:
    """An MX weight with the dequantize() of QuantWeight: its exact values."""

    def __init__(self, w: MXWeight):
        self.mx, self.shape = w, w.shape

    def dequantize(self) -> np.ndarray:
        return self.mx.decode()


def weights(kind: str, num_rows: int, num_blocks: int, seed: int):
    rng = np.random.default_rng(seed)
    if kind.startswith("mx"):
        if not mx_available(kind):
            pytest.skip(f"this CPU has no integer-dot kernel for {kind}")
        # rows of unlike sizes, some blocks' values far apart (small and large scales in one row)
        dense = rng.standard_normal((num_rows, 32 * num_blocks)) * np.exp(rng.normal(0, 2, (num_rows, num_blocks))
                                                                          ).repeat(32, axis=1)
        w = MXWeight.encode(dense.astype(np.float32), kind)
        return MXBlocks(w), VnniWeight.from_mx(kind, w.codes, w.scales)
    if kind.endswith("x8"):
        if not x8_available(kind[:-2]):
            pytest.skip(f"this CPU has no 8-bit integer dots for {kind[:-2]}")
        w = from_gguf_rows(random_blocks(kind[:-2], num_rows, num_blocks, rng), kind[:-2])
        return w, VnniWeight.from_blocks(w, x_bits=8)
    w = from_gguf_rows(random_blocks(kind, num_rows, num_blocks, rng), kind)
    return w, VnniWeight.from_blocks(w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_x", [1, 2, 3, 5, 8, 11])  # one to eight rows a pass, two passes
def test_matches_numpy_twin_and_bound(kind, num_x):
    w, packed = weights(kind, num_rows=48, num_blocks=5, seed=num_x)
    assert packed.shape == w.shape
    x = np.random.default_rng(7).standard_normal((num_x, w.shape[1])).astype(np.float32)
    got = vnni_matmul(x, packed)
    dense = w.dequantize().astype(np.float64)
    qmax = qmax_of(kind)
    twin = rounded(x, qmax) @ dense.T
    # the twin to float32 rounding of the sum of |terms|
    np.testing.assert_allclose(got, twin, rtol=0, atol=1e-6 * (np.abs(rounded(x, qmax)) @ np.abs(dense).T).max())
    # the exact product within the rounding of x: half a step (max |x_block| / qmax) per value
    step = np.abs(x.reshape(num_x, -1, 32)).max(-1).repeat(32, axis=1) / qmax
    bound = (step / 2) @ np.abs(dense).T
    assert (np.abs(got - x.astype(np.float64) @ dense.T) <= bound * 1.01 + 1e-6).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_x", [2, 3, 4, 9])
def test_rows_do_not_depend_on_their_partners(kind, num_x):
    """x's rows go through the kernel one to eight at a time: each row's products are the same bits alone."""
    _, packed = weights(kind, num_rows=16, num_blocks=4, seed=3)
    x = np.random.default_rng(1).standard_normal((num_x, 128)).astype(np.float32)
    together = vnni_matmul(x, packed)
    for i in range(num_x):
        np.testing.assert_array_equal(together[i], vnni_matmul(x[i:i + 1], packed)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_norm_and_gate_fused_into_the_rounding(kind):
    """norm: the matmul of rms_norm(x) * norm; gated: of silu(gate) * up; each as the unfused kernel gives it
    on the same input computed in torch, to float32 rounding."""
    _, packed = weights(kind, num_rows=32, num_blocks=4, seed=5)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 128)).astype(np.float32)
    norm = rng.uniform(0.5, 2, 128).astype(np.float32)
    normed = rms_norm(torch.from_numpy(x), torch.from_numpy(norm), 1e-5).numpy()
    np.testing.assert_allclose(vnni_matmul(x, packed, norm, 1e-5), vnni_matmul(normed, packed), rtol=1e-4, atol=1e-4)
    gate_up = rng.standard_normal((2, 256)).astype(np.float32)
    g, u = torch.from_numpy(gate_up).chunk(2, dim=-1)
    act = (torch.nn.functional.silu(g) * u).numpy()
    np.testing.assert_allclose(vnni_matmul(gate_up, packed, gated=True), vnni_matmul(act, packed), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["q4_1", "q4_1x8", "q8_0x8"])
def test_zeros_and_non_finite_inputs(kind):
    _, packed = weights(kind, num_rows=16, num_blocks=4, seed=4)
    assert not vnni_matmul(np.zeros((2, 128), np.float32), packed).any()
    x = np.ones((2, 128), np.float32)
    x[0, 40] = np.nan
    x[1, 3] = np.inf
    out = vnni_matmul(x, packed)
    assert np.isnan(out).all()


def test_only_whole_groups_of_rows_fit():
    rng = np.random.default_rng(0)
    assert not VnniWeight.fits(from_gguf_rows(random_blocks("q8_0", 24, 2, rng), "q8_0"))  # not whole groups of 16
    assert VnniWeight.fits(from_gguf_rows(random_blocks("q4_1", 32, 3, rng), "q4_1"))  # any number of blocks


@pytest.mark.parametrize("num_x", [1, 3])
def test_hadamard_rotated_mx_turns_x_before_rounding(num_x):
    """Codes of W H (mxfp4 with --weight-rotation hadamard): the kernel turns each block of x by H, then rounds,
    so the product is x W^T to the rounding of x H; norm and gate are computed before the turn."""
    if not mx_available("mxfp4"):
        pytest.skip("this CPU has no integer-dot kernel for mxfp4")
    rng = np.random.default_rng(num_x)
    w = MXWeight.encode(rng.standard_normal((32, 96)).astype(np.float32), "mxfp4", rotation="hadamard")
    packed = VnniWeight.from_mx("mxfp4", w.codes, w.scales, "hadamard")
    assert packed.rotated
    x = rng.standard_normal((num_x, 96)).astype(np.float32)
    turned = rotate(x)
    stored = w.decode().astype(np.float64)  # W H
    got = vnni_matmul(x, packed)
    np.testing.assert_allclose(got, rounded(turned) @ stored.T, rtol=0,
                               atol=1e-5 * (np.abs(turned) @ np.abs(stored).T).max())
    np.testing.assert_allclose(got, x @ w.dense().T, rtol=0, atol=1e-3 * np.abs(x @ w.dense().T).max())
    gate_up = rng.standard_normal((num_x, 192)).astype(np.float32)
    g, u = torch.from_numpy(gate_up).chunk(2, dim=-1)
    act = (torch.nn.functional.silu(g) * u).numpy()
    np.testing.assert_allclose(vnni_matmul(gate_up, packed, gated=True), vnni_matmul(act, packed), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6", "mxint8"])
def test_mx_layout_keeps_the_bits_per_weight(fmt):
    _, packed = weights(fmt, num_rows=32, num_blocks=6, seed=0)
    one = MXWeight.encode(np.ones((1, 32), np.float32), fmt)
    assert packed.kind == fmt and packed.bits_per_weight == one.bits_per_weight


def test_mx_weights_the_kernels_cannot_give_stay_out():
    """A NaN scale (255), or a zero scale (2^-127) in a block with nonzero codes, or rows not in whole groups:
    from_mx answers None, and the float MX kernels keep those weights."""
    w = MXWeight.encode(np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32), "mxfp4")
    assert VnniWeight.from_mx("mxfp4", w.codes, w.scales) is not None
    assert VnniWeight.from_mx("mxfp4", w.codes[:24], w.scales[:24]) is None
    nan = w.scales.copy()
    nan[3, 1] = 255
    assert VnniWeight.from_mx("mxfp4", w.codes, nan) is None
    tiny = w.scales.copy()
    tiny[5, 0] = 0
    assert VnniWeight.from_mx("mxfp4", w.codes, tiny) is None
    zeros = MXWeight.encode(np.zeros((16, 64), np.float32), "mxfp4")  # scale 0, codes 0: zeros either way
    assert not vnni_matmul(np.ones((1, 64), np.float32), VnniWeight.from_mx("mxfp4", zeros.codes, zeros.scales)).any()
    assert VnniWeight.from_mx("mxfp8", w.codes, w.scales) is None  # no integer-dot kernel for FP8


def test_default_model_layer_matches_the_float_kernels():
    """Every linear of the bundled model, norms and gate fused, against the float32 block kernels (which give
    the fp32 copy's products): within 1e-4 of the output's scale."""
    from gpu_model.loader import QUANT_FILE, load_model, resolve_model_dir
    from gpu_model.quant import load_quant

    model_dir = resolve_model_dir(None)
    blocks = load_quant(model_dir / QUANT_FILE)
    vnni, plain = (load_model(model_dir, cpu_linear_dtype="float32", gguf_blocks_max_tokens=0) for _ in range(2))
    vnni.attach_quant(blocks, 4, vnni=True)
    plain.attach_quant(blocks, 4, vnni=False)
    assert all(isinstance(w, VnniWeight) for w in vnni.quant.values())
    assert all(w is not None for w in vnni.decode_weights)  # steps of <= 4 tokens run gpu_model/cpu_decode.py
    x = torch.randn(2, vnni.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = vnni.rope(torch.tensor([5, 9]))
    attn = torch.randn(2, vnni.cfg.num_heads * vnni.cfg.head_dim, generator=torch.Generator().manual_seed(1))
    pairs = [*zip(vnni.pre_attention(3, x, cos, sin), plain.pre_attention(3, x, cos, sin)),
             (vnni.post_attention(3, x, attn), plain.post_attention(3, x, attn)), (vnni.logits(x), plain.logits(x))]
    for a, b in pairs:
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4


def test_eight_bit_activations_on_the_default_model():
    """activation_bits 8: the bundled model's blocks (Q4_1 linears, a Q8_0 head, the latter at 16 bits where the CPU
    has no 8-bit kernel for Q8_0) take x rounded to int8 (the x8 layouts) and give the 16-bit model's layer outputs
    and logits within 3 % of their scale; combinations without Q4_1 integer dots are refused at load, in one line."""
    from gpu_model.loader import ModelLoadError, load_model, resolve_model_dir
    from gpu_model.weight_format import WeightFormat

    if not x8_available():
        pytest.skip("this CPU has no 8-bit integer dots (AVX512-VNNI or AVX2)")
    model_dir = resolve_model_dir(None)
    x16, x8 = (load_model(model_dir, gguf_blocks_max_tokens=4, activation_bits=b) for b in (16, 8))
    head_bits = 8 if x8_available("q8_0") else 16
    assert {(w.kind, w.x_bits) for w in x8.quant.values()} == {("q4_1", 8), ("q8_0", head_bits)}
    assert all(w is not None for w in x8.decode_weights)
    x = torch.randn(3, x8.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = x8.rope(torch.tensor([5, 9, 11]))
    attn = torch.randn(3, x8.cfg.num_heads * x8.cfg.head_dim, generator=torch.Generator().manual_seed(1))
    pairs = [*zip(x8.pre_attention(3, x, cos, sin), x16.pre_attention(3, x, cos, sin)),
             (x8.post_attention(3, x, attn), x16.post_attention(3, x, attn))]
    if x8_available("q8_0"):
        pairs.append((x8.logits(x), x16.logits(x)))
    else:  # the head keeps 16-bit x
        assert torch.equal(x8.logits(x), x16.logits(x))
    for a, b in pairs:
        assert 0 < ((a - b).abs().max() / b.abs().max()).item() < 3e-2
    with pytest.raises(ModelLoadError, match="activation_bits 8 needs"):
        load_model(model_dir, weight_format=WeightFormat("mxfp4"), activation_bits=8)
    with pytest.raises(ModelLoadError, match="activation_bits 8 needs"):
        load_model(model_dir, cpu_linear_dtype="float32", activation_bits=8)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_float16_scales_as_read_from_the_gguf(kind):
    """from_blocks keeps a GGUF's float16 scales as float16 bits (fewer bytes a step); the kernels widen them
    exactly, so the products equal those of the same weights with float32 scales, bit for bit."""
    w, packed = weights(kind, num_rows=32, num_blocks=6, seed=3)
    assert packed.scales.dtype == np.uint16
    wide = VnniWeight(kind, packed.scales.view(np.float16).astype(np.float32), packed.qs)
    assert packed.nbytes < wide.nbytes
    for num_x in (1, 4, 9):
        x = np.random.default_rng(num_x).standard_normal((num_x, w.shape[1])).astype(np.float32)
        assert np.array_equal(vnni_matmul(x, packed), vnni_matmul(x, wide))
