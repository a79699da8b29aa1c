"""Oaken quantizer against a plain NumPy reference: groups, shifts, codes, error bounds, encoding."""
import numpy as np
import pytest

from cpu_attn.calibrate import window_thresholds
from cpu_attn.oaken import INNER, MIDDLE, OUTER, SEGMENT, dequantize, effective_bits, quantize

THR = np.array([-2.0, -0.1, 0.1, 2.0], np.float32)


def reference_groups(x, thr):
    s_lo, t_lo, t_hi, s_hi = thr
    g = np.full(x.shape, MIDDLE)
    g[(x >= t_lo) & (x <= t_hi)] = INNER
    g[(x < s_lo) | (x > s_hi)] = OUTER
    return g


def reference_scales(x, thr):
    """Per token: largest shifted magnitude per group / (8 middle, 15 inner and outer)."""
    s_lo, t_lo, t_hi, s_hi = thr
    g = reference_groups(x, thr)
    y = np.where(g == OUTER, x - np.where(x > s_hi, s_hi, s_lo),
                 np.where(g == MIDDLE, x - np.where(x > t_hi, t_hi, t_lo), x))
    peaks = np.stack([np.where(g == k, np.abs(y), 0).max(-1) for k in (MIDDLE, INNER, OUTER)], -1)
    return peaks / np.array([8, 15, 15]), peaks


def decoded_groups(dense, sparse, counts):
    """Group of every position as the encoding says: middle unless a sparse entry names it."""
    g = np.full((dense.shape[0], dense.shape[1] * 2), MIDDLE)
    for t in range(g.shape[0]):
        e = 0
        for seg, n in enumerate(counts[t].tolist()):
            for entry in sparse[t, e:e + n]:
                g[t, seg * SEGMENT + (int(entry) & 63)] = OUTER if entry & 64 else INNER
            e += n
    return g


@pytest.mark.parametrize("num", [192, 256, 4096])  # SmolLM2 3x64, 2x128, Llama-2-7B 32x128
def test_roundtrip_within_half_a_step_per_group(num):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((50, num)) * rng.uniform(0.3, 1.5, (50, 1))).astype(np.float32)
    x[:, 5] *= 8  # a heavy channel, as keys have
    dense, sparse, counts, scales, num_sparse = quantize(x, THR)
    g = reference_groups(x, THR)
    assert (decoded_groups(dense, sparse, counts) == g).all()
    assert (num_sparse == (g != MIDDLE).sum(-1)).all() and (counts.sum(-1) == num_sparse).all()
    ref_scales, peaks = reference_scales(x, THR)
    ref_scales = np.where(ref_scales > 0, np.clip(ref_scales, 2.0**-14, None), 0)
    np.testing.assert_array_equal(scales, ref_scales.astype(np.float32).astype(np.float16).astype(np.float32))
    err = np.abs(dequantize(THR, dense, sparse, counts, scales) - x)
    for k in (MIDDLE, INNER, OUTER):
        # half a step (middle: 0.6, its levels sit at (m + 0.4) * step), plus what rounding the
        # scale to fp16 can add at the top code
        bound = scales[:, k] * (0.6 if k == MIDDLE else 0.5) + peaks[:, k] * 2**-10 + 1e-6
        assert (np.where(g == k, err, 0) <= bound[:, None]).all(), k


def test_all_outliers_zeros_and_bad_values():
    x = np.full((1, 64), 5.0, np.float32)
    x[0, ::2] = -7.0
    dense, sparse, counts, scales, num_sparse = quantize(x, THR)
    assert num_sparse[0] == 64 and counts[0, 0] == 64
    np.testing.assert_allclose(dequantize(THR, dense, sparse, counts, scales), x, atol=3e-3)  # fp16 scale: 15 * (5 / 15) * 2**-11
    zeros = np.zeros((2, 128), np.float32)
    out = quantize(zeros, THR)
    np.testing.assert_array_equal(dequantize(THR, *out[:4]), zeros)
    bad = np.zeros((1, 64), np.float32)
    bad[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(bad, THR)
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize(np.zeros((1, 60), np.float32), THR)


def int4_per_token(x):
    """Baseline: asymmetric 4-bit over each token's whole vector, no outlier handling."""
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    scale = (hi - lo) / 15
    return np.round((x - lo) / scale) * scale + lo


def test_real_smollm2_kv_beats_int4_under_5_5_bits():
    """K and V of a real WikiText window: Oaken error well below per-token INT4, <= 5.5 bits."""
    from cpu_attn.calibrate import collect_kv
    from gpu_model.loader import load_model, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer
    from tests.conftest import SHARED

    model_dir = resolve_model_dir(None)
    model = load_model(model_dir)
    path = SHARED / "data" / "wikitext-2" / "valid.txt"
    text = path.read_text()[:20000] if path.exists() else "The quick brown fox jumps over the lazy dog. " * 200
    ids = Tokenizer(model_dir, model.cfg.eos_token_ids).encode(text)[:256]
    for layer, (k, v) in list(enumerate(collect_kv(model, ids)))[::7]:
        for x in (k.reshape(len(ids), -1), v.reshape(len(ids), -1)):
            thr = window_thresholds(x, 0.04, 0.06)
            dense, sparse, counts, scales, num_sparse = quantize(x, thr)
            oaken_mse = np.mean((dequantize(thr, dense, sparse, counts, scales) - x) ** 2)
            int4_mse = np.mean((int4_per_token(x) - x) ** 2)
            assert oaken_mse < int4_mse, (layer, oaken_mse, int4_mse)
            assert effective_bits(x.shape[1], num_sparse) <= 5.5
