"""MX formats (gpu_model/mx.py) against a plain, element-at-a-time reading of the OCP MX v1.0 spec,
and the Numba kernels (gpu_model/mx_kernels.py) against float64 matmuls of the decoded weights."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from gpu_model import mx
from gpu_model.mx_kernels import decode_row
from gpu_model.mx_weight import _KINDS, _TABLES, MXWeight, hadamard

FORMATS = list(mx.FORMATS)
SPEC = {  # name: (exponent bits, mantissa bits, bias, emax_elem, max normal)
    "mxfp8": (4, 3, 7, 8, 448.0), "mxfp6": (2, 3, 1, 2, 7.5), "mxfp6_e3m2": (3, 2, 3, 4, 28.0),
    "mxfp4": (2, 1, 1, 2, 6.0), "mxint8": (0, 0, 0, 0, 127 / 64)}


def naive_value(fmt: str, code: int) -> float:
    """The element code's value, from the spec's formulas."""
    ebits, mbits, bias, _, _ = SPEC[fmt]
    if fmt == "mxint8":
        return (code - 256 if code >= 128 else code) / 64
    sign = -1.0 if code >> (ebits + mbits) else 1.0
    e, m = (code >> mbits) & ((1 << ebits) - 1), code & ((1 << mbits) - 1)
    if fmt == "mxfp8" and e == 15 and m == 7:
        return math.nan
    if e == 0:
        return sign * 2.0 ** (1 - bias) * (m / 2**mbits)
    return sign * 2.0 ** (e - bias) * (1 + m / 2**mbits)


def naive_encode_block(values: np.ndarray, fmt: str) -> tuple[int, list[int]]:
    """32 float32 values -> (E8M0 scale, element codes): nearest value, ties to the even code, saturated."""
    emax = SPEC[fmt][3]
    if any(not math.isfinite(v) for v in values):
        return 255, [0] * 32
    amax = max(abs(float(v)) for v in values)
    shared = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - emax))
    n_codes = 256 if fmt in ("mxfp8", "mxint8") else 1 << (1 + SPEC[fmt][0] + SPEC[fmt][1])
    table = [(naive_value(fmt, c), c) for c in range(n_codes) if math.isfinite(naive_value(fmt, c))]
    if fmt == "mxint8":
        table = [(v, c) for v, c in table if c != 128]  # -2.0 is never produced: saturate at +-127/64
    sign_shift = 7 if fmt in ("mxfp8", "mxint8") else SPEC[fmt][0] + SPEC[fmt][1]
    codes = []
    for v in values:
        x = float(v) / 2.0**shared
        is_neg = math.copysign(1.0, x) < 0
        # float formats keep the sign (a tiny negative value rounds to -0); the nearest value wins,
        # a tie goes to the even code
        same_sign = [(tv, c) for tv, c in table if fmt == "mxint8" or bool(c >> sign_shift) == is_neg]
        codes.append(min((abs(tv - x), c & 1, c) for tv, c in same_sign)[2])
    return shared + 127, codes


def sample_weights(k: int, rng) -> np.ndarray:
    rows = [rng.standard_normal(k), rng.standard_normal(k) * 1e-3, rng.standard_normal(k) * 3e4,
            np.zeros(k), rng.standard_normal(k) * 1e-41, rng.standard_normal(k) * 1e37,
            np.where(rng.random(k) < 0.1, rng.standard_normal(k) * 50, rng.standard_normal(k) * 0.01)]
    w = np.array(rows, np.float32)
    w[0, :3] = [0.0, -0.0, 1.0]
    return w


def tie_weights(fmt: str) -> np.ndarray:
    """A block whose scale is 2^0 (amax in [2^emax, 2^(emax+1))) holding every midpoint between
    neighbouring values, and values past the largest normal."""
    emax, top = SPEC[fmt][3], SPEC[fmt][4]
    n_codes = {"mxfp6": 64, "mxfp6_e3m2": 64, "mxfp4": 16}.get(fmt, 256)
    values = sorted({abs(naive_value(fmt, c)) for c in range(n_codes) if math.isfinite(naive_value(fmt, c))})
    mids = [(a + b) / 2 for a, b in zip(values, values[1:])]
    row = ([2.0**emax * 1.0] + [top + (2.0 ** (emax + 1) - top) / 2] + mids + [-m for m in mids])[:32]
    row += [0.0] * (32 - len(row))
    return np.array([row[:32]], np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_matches_the_spec_element_by_element(fmt):
    rng = np.random.default_rng(1)
    w = np.concatenate([sample_weights(64, rng), np.pad(tie_weights(fmt), ((0, 0), (0, 32)))])
    w[2, 40] = np.nan
    w[3, 33] = np.inf
    codes, scales = mx.encode(w, mx.FORMATS[fmt])
    unpacked = mx.unpack(codes, mx.FORMATS[fmt])
    for n in range(w.shape[0]):
        for b in range(2):
            scale, expect = naive_encode_block(w[n, 32 * b:32 * b + 32], fmt)
            assert scales[n, b] == scale, (n, b)
            assert unpacked[n, b].tolist() == expect, (n, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_bit_for_bit(fmt):
    rng = np.random.default_rng(2)
    f = mx.FORMATS[fmt]
    n_codes = 1 << f.code_bits
    codes = rng.integers(0, n_codes, (6, 3, 32)).astype(np.uint8)
    scales = np.array([[0, 1, 127], [100, 200, 254], [255, 126, 3], [127, 127, 127], [250, 5, 130], [64, 190, 20]],
                      np.uint8)
    got = mx.decode(mx.pack(codes, f), scales, f)
    value = lambda n, b, c: naive_value(fmt, int(c)) * 2.0 ** (int(scales[n, b]) - 127)  # noqa: E731
    with np.errstate(over="ignore"):  # 448 x 2^127 is inf in float32, as the decoder says
        expect = np.array([[np.float32(value(n, b, c)) if scales[n, b] != 255 else np.nan
                            for b in range(3) for c in codes[n, b]] for n in range(6)], np.float32)
    assert np.array_equal(got.view(np.uint32)[~np.isnan(expect)], expect.view(np.uint32)[~np.isnan(expect)])
    assert np.array_equal(np.isnan(got), np.isnan(expect))
    assert np.array_equal(mx.unpack(mx.pack(codes, f), f), codes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_decode_bit_for_bit(fmt):
    rng = np.random.default_rng(3)
    f = mx.FORMATS[fmt]
    codes = mx.pack(rng.integers(0, 1 << f.code_bits, (5, 4, 32)).astype(np.uint8), f)
    scales = rng.integers(0, 256, (5, 4)).astype(np.uint8)
    scales[0] = [0, 255, 254, 1]
    expect = mx.decode(codes, scales, f)
    row = np.empty(128, np.float32)
    for n in range(5):
        decode_row(_KINDS[fmt], codes, scales, _TABLES[fmt], n, row)
        assert np.array_equal(np.isnan(row), np.isnan(expect[n]))
        nonzero = ~np.isnan(row) & (expect[n] != 0)  # the kernels decode -0 as +0: the sums are the same
        assert np.array_equal(row.view(np.uint32)[nonzero], expect[n].view(np.uint32)[nonzero])
        assert np.all(row[expect[n] == 0] == 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_device_decode_bit_for_bit(fmt):
    """The packed weights decoded by torch operations (gpu_model/mx_device.py, as on a GPU) against mx.decode,
    float32 and bf16 (exact there too), NaN scales and a padded last block included."""
    import torch
    from gpu_model.mx_device import DeviceMXWeight

    rng = np.random.default_rng(4)
    f = mx.FORMATS[fmt]
    codes = mx.pack(rng.integers(0, 1 << f.code_bits, (5, 4, 32)).astype(np.uint8), f)
    scales = rng.integers(60, 190, (5, 4)).astype(np.uint8)
    scales[0] = [0, 255, 254, 1]
    w = DeviceMXWeight(MXWeight(fmt, codes, scales, 120), "cpu")
    expect = mx.decode(codes, scales, f, 120)
    got = w.decode(torch.float32).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(expect))
    assert np.array_equal(got.view(np.uint32)[~np.isnan(got)], expect.view(np.uint32)[~np.isnan(expect)])
    normal = np.abs(expect[1:]) >= 2.0 ** -126  # bf16 keeps float32's exponents; subnormals aside
    bf16 = w.decode(torch.bfloat16)[1:].float().numpy()
    assert np.array_equal(bf16[normal & ~np.isnan(expect[1:])], expect[1:][normal & ~np.isnan(expect[1:])])


@pytest.mark.parametrize("fmt, rotation", [("mxfp6", "none"), ("mxfp4", "hadamard"), ("mxint8", "none")])
def test_device_matmul_against_the_dense_weight(fmt, rotation):
    import torch
    from gpu_model.mx_device import DeviceMXWeight

    rng = np.random.default_rng(5)
    w = MXWeight.encode(rng.standard_normal((40, 96)).astype(np.float32), fmt, rotation)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    dev = DeviceMXWeight(w, "cpu")
    assert dev.shape == w.shape and dev.nbytes == w.nbytes
    got = dev.matmul(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.dense().T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_bits_per_weight():
    assert [mx.FORMATS[f].bits_per_weight for f in ("mxfp8", "mxfp6", "mxfp4", "mxint8")] == [8.25, 6.25, 4.25, 8.25]
    w = MXWeight.encode(np.ones((3, 64), np.float32), "mxfp6")
    assert w.nbytes == 3 * 64 * 6.25 / 8


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("shape", [(1, 32), (13, 45), (37, 576)])
def test_matmul_against_float64(fmt, m, shape):
    rng = np.random.default_rng(4)
    w = MXWeight.encode(rng.standard_normal(shape).astype(np.float32) * 0.1, fmt)
    x = rng.standard_normal((m, shape[1])).astype(np.float32)
    dense = w.decode().astype(np.float64)
    got, expect = w.matmul_numpy(x), x.astype(np.float64) @ dense.T
    bound = 4 * shape[1] * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(dense).T)
    assert np.all(np.abs(got - expect) <= bound + 1e-30)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [2, 5])
def test_matmul_one_hot_rows_read_exact_weights(fmt, m):
    rng = np.random.default_rng(5)
    w = MXWeight.encode(rng.standard_normal((9, 64)).astype(np.float32), fmt)
    cols = rng.integers(0, 64, m)
    x = np.zeros((m, 64), np.float32)
    x[np.arange(m), cols] = 1.0
    assert np.array_equal(w.matmul_numpy(x), w.decode()[:, cols].T)


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_nan_and_inf(fmt):
    rng = np.random.default_rng(6)
    raw = rng.standard_normal((8, 64)).astype(np.float32)
    raw[3, 40] = np.nan  # the block's scale is NaN: row 3 is NaN everywhere
    w = MXWeight.encode(raw, fmt)
    for m in (1, 4):
        x = rng.standard_normal((m, 64)).astype(np.float32)
        x[0, 5] = np.inf
        out = w.matmul_numpy(x)
        assert np.all(np.isnan(out[:, 3]))
        assert np.all(np.isinf(out[0, [0, 1, 2, 4, 5, 6, 7]]) | np.isnan(out[0, [0, 1, 2, 4, 5, 6, 7]]))
        assert np.all(np.isfinite(np.delete(out[1:], 3, axis=1)))


def test_hadamard_rotation_is_folded():
    rng = np.random.default_rng(7)
    h = hadamard()
    assert np.allclose(h @ h.T, np.eye(32), atol=1e-6)
    raw = rng.standard_normal((16, 96)).astype(np.float32)
    plain, rotated = MXWeight.encode(raw, "mxfp4"), MXWeight.encode(raw, "mxfp4", rotation="hadamard")
    x = rng.standard_normal((3, 96)).astype(np.float32)
    expect = x.astype(np.float64) @ rotated.dense().T.astype(np.float64)
    assert np.allclose(rotated.matmul_numpy(x), expect, rtol=1e-4, atol=1e-4)
    exact = x.astype(np.float64) @ raw.T.astype(np.float64)
    err = lambda w: np.abs(w.matmul_numpy(x) - exact).mean()  # noqa: E731
    assert err(rotated) < 1.5 * err(plain)  # Gaussian weights: about equal; the rotation must not hurt
    with pytest.raises(ValueError, match="multiple of 32"):
        MXWeight.encode(raw[:, :40], "mxfp4", rotation="hadamard")


def test_concat_and_validation():
    rng = np.random.default_rng(8)
    a, b = (MXWeight.encode(rng.standard_normal((n, 64)).astype(np.float32), "mxfp4") for n in (3, 5))
    both = MXWeight.concat([a, b])
    assert both.shape == (8, 64)
    assert np.array_equal(both.decode(), np.concatenate([a.decode(), b.decode()]))
    with pytest.raises(ValueError, match="codes must be uint8"):
        MXWeight("mxfp6", a.codes, a.scales, 64)
    with pytest.raises(ValueError, match="unknown MX format"):
        MXWeight.encode(np.ones((1, 32), np.float32), "mxfp5")


AVX2_CHECK = """
import numpy as np
from gpu_model import mx
from gpu_model.mx_weight import MXWeight
rng = np.random.default_rng(9)
for fmt in mx.FORMATS:
    w = MXWeight.encode(rng.standard_normal((9, 96)).astype(np.float32), fmt)
    for m in (1, 2, 5):
        x = np.zeros((m, 96), np.float32)
        x[np.arange(m), rng.integers(0, 96, m)] = 1.0
        cols = x.argmax(1)
        assert np.array_equal(w.matmul_numpy(x), w.decode()[:, cols].T), (fmt, m)
print("ok")
"""


def test_kernels_without_avx512(tmp_path):
    """The AVX2 code paths (pshufb tables, integer conversions), compiled for a Haswell CPU."""
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
