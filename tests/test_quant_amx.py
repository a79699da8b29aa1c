"""Integer-dot weights multiplied by AMX tiles: against a NumPy twin of the kernel's arithmetic (x rounded to bf16,
the weights' exact values, float32 sums), and against the exact product within the rounding's stated bound."""
import numpy as np
import pytest
import torch

from gpu_model.model import rms_norm
from gpu_model.mx_weight import MXWeight, rotate
from gpu_model.quant_amx import TILE_ROWS, block_matmul, is_available
from gpu_model.quant_vnni import VnniWeight, vnni_matmul
from tests.test_quant_vnni import KINDS, weights

pytestmark = pytest.mark.skipif(not is_available(), reason="this CPU has no AMX-BF16")


def bf16(v: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 (ties to even), as float64."""
    u = np.ascontiguousarray(v, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def tiles(x: np.ndarray, w: VnniWeight, **kw) -> np.ndarray:
    return block_matmul(torch.from_numpy(x), w, tile_rows=1, **kw).numpy()


TILED = [k for k in KINDS if not k.endswith("x8")]
"""The layouts the tiles multiply: the x8 ones (8-bit activations) go to vpdpbusd at any number of rows."""


@pytest.mark.parametrize("kind", TILED)
@pytest.mark.parametrize("num_x", [1, 4, 5, TILE_ROWS, TILE_ROWS + 1, 2 * TILE_ROWS + 3])  # one to three passes
def test_matches_numpy_twin_and_bound(kind, num_x):
    w, packed = weights(kind, num_rows=48, num_blocks=5, seed=num_x)
    x = np.random.default_rng(7).standard_normal((num_x, w.shape[1])).astype(np.float32)
    got = tiles(x, packed)
    dense = w.dequantize().astype(np.float64)
    terms = np.abs(bf16(x)) @ np.abs(dense).T
    # the twin to float32 rounding of the sums (per block, then over the blocks)
    np.testing.assert_allclose(got, bf16(x) @ dense.T, rtol=0, atol=2e-6 * terms.max())
    # the exact product within x's rounding: at most 2^-9 of each value
    bound = (np.abs(x.astype(np.float64)) * 2.0**-9) @ np.abs(dense).T
    assert (np.abs(got - x.astype(np.float64) @ dense.T) <= bound * 1.01 + 2e-6 * terms.max()).all()


@pytest.mark.parametrize("kind", ["q4_1", "mxfp6"])
def test_rows_do_not_depend_on_their_partners(kind):
    _, packed = weights(kind, num_rows=32, num_blocks=4, seed=3)
    x = np.random.default_rng(1).standard_normal((TILE_ROWS + 3, 128)).astype(np.float32)
    together = tiles(x, packed)
    for i in (0, 5, TILE_ROWS, TILE_ROWS + 2):
        np.testing.assert_array_equal(together[i], tiles(x[i:i + 1], packed)[0])


@pytest.mark.parametrize("kind", ["q4_1x8", "q8_0x8"])
def test_eight_bit_activations_are_never_tiled(kind):
    _, packed = weights(kind, num_rows=16, num_blocks=3, seed=2)
    x = np.random.default_rng(4).standard_normal((TILE_ROWS + 1, 96)).astype(np.float32)
    np.testing.assert_array_equal(tiles(x, packed), vnni_matmul(x, packed))


def test_below_tile_rows_the_integer_dots_multiply():
    _, packed = weights("q8_0", num_rows=16, num_blocks=3, seed=2)
    x = np.random.default_rng(4).standard_normal((3, 96)).astype(np.float32)
    got = block_matmul(torch.from_numpy(x), packed, tile_rows=4).numpy()
    np.testing.assert_array_equal(got, vnni_matmul(x, packed))
    assert not np.array_equal(block_matmul(torch.from_numpy(x), packed, tile_rows=3).numpy(), got)


@pytest.mark.parametrize("kind", ["q4_1", "mxfp4"])
def test_norm_and_gate_fused_into_the_rounding(kind):
    """norm: the matmul of rms_norm(x) * norm; gated: of silu(gate) * up; each within x's rounding of the
    exact product of the input computed in torch."""
    w, packed = weights(kind, num_rows=32, num_blocks=4, seed=5)
    dense = w.dequantize().astype(np.float64)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    norm = rng.uniform(0.5, 2, 128).astype(np.float32)
    normed = rms_norm(torch.from_numpy(x), torch.from_numpy(norm), 1e-5).numpy().astype(np.float64)
    gate_up = rng.standard_normal((5, 256)).astype(np.float32)
    g, u = torch.from_numpy(gate_up).chunk(2, dim=-1)
    act = (torch.nn.functional.silu(g) * u).numpy().astype(np.float64)
    for got, want in ((tiles(x, packed, norm=torch.from_numpy(norm), eps=1e-5), normed),
                      (tiles(gate_up, packed, gated=True), act)):
        bound = (np.abs(want) * 2.0**-8) @ np.abs(dense).T  # bf16's half step, and float32's of the input
        assert (np.abs(got - want @ dense.T) <= bound + 1e-5).all()


def test_hadamard_rotated_mx_turns_x_before_rounding():
    rng = np.random.default_rng(3)
    w = MXWeight.encode(rng.standard_normal((32, 96)).astype(np.float32), "mxfp4", rotation="hadamard")
    packed = VnniWeight.from_mx("mxfp4", w.codes, w.scales, "hadamard")
    x = rng.standard_normal((6, 96)).astype(np.float32)
    turned = rotate(x)
    stored = w.decode().astype(np.float64)  # W H
    got = tiles(x, packed)
    np.testing.assert_allclose(got, bf16(turned) @ stored.T, rtol=0,
                               atol=1e-5 * (np.abs(turned) @ np.abs(stored).T).max())


def test_zeros_and_non_finite_inputs():
    _, packed = weights("q4_1", num_rows=16, num_blocks=4, seed=4)
    assert not tiles(np.zeros((5, 128), np.float32), packed).any()
    x = np.ones((5, 128), np.float32)
    x[0, 40] = np.nan
    x[1, 3] = np.inf
    out = tiles(x, packed)
    assert np.isnan(out[0]).all() and not np.isfinite(out[1]).any() and np.isfinite(out[2:]).all()


def test_bundled_model_steps_by_tiles_match_the_integer_dots():
    """The bundled model as serve loads it (bf16 linears, GGUF blocks): a layer's fused pre / post calls and the head
    at 5 tokens by tiles against the same by integer dots, within x's bf16 rounding (~2^-9 a value), and the same
    greedy token from the head."""
    from pathlib import Path

    from gpu_model.loader import TILE_MIN_TOKENS, load_model, resolve_model_dir

    model = load_model(resolve_model_dir(None, Path("~/.cache/hetserve/models").expanduser()))
    assert model.tile_rows == TILE_MIN_TOKENS and model.quant_max_tokens >= 5 and model.decode_weights[0] is not None
    torch.manual_seed(0)
    x = torch.randn(5, model.cfg.hidden_size)
    cos, sin = model.rope(torch.arange(5) + 40)
    attn = torch.randn(5, model.cfg.num_heads * model.cfg.head_dim)
    runs = []
    for rows in (TILE_MIN_TOKENS, 0):
        model.tile_rows = rows
        runs.append([*model.pre_attention(3, x, cos, sin), model.post_attention(3, x, attn), model.logits(x)])
    for tiles_out, dots_out in zip(*runs):
        assert ((tiles_out - dots_out).norm() / dots_out.norm()).item() < 5e-3
    assert torch.equal(runs[0][-1].argmax(-1), runs[1][-1].argmax(-1))
