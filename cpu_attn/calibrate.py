"""Offline Oaken threshold profiling (issue #3, first part).

Run windows of real text through the model, collect K (post-RoPE, as the store holds it) and V
of every layer, and find per layer and per K/V four thresholds that split values into groups:

    outer_lo | middle | inner_lo .. inner_hi | middle | outer_hi
      ~2%        ~45%        ~6% (inner)        ~45%     ~2%

As in the Oaken paper, thresholds are computed per window and averaged over windows, so one
unusual window cannot move them far. The result is a small JSON file next to the model cache.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

THRESHOLDS_FILE = "oaken_thresholds.json"
DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "valid.txt"
"""Calibration text when none is given: WikiText-2 valid (the test split is kept for scoring)."""


@dataclass(frozen=True)
class OakenThresholds:
    values: np.ndarray
    """[num_layers, 2 (K, V), 4]: outer_lo, inner_lo, inner_hi, outer_hi (of K / key_scales, and V)."""
    outer_ratio: float = 0.04
    inner_ratio: float = 0.06
    key_scales: np.ndarray | None = None
    """[num_layers, Hkv * D] per-channel key smoothing: the store keeps K / key_scales and
    attention multiplies q by key_scales, so q.k is unchanged (QServe's SmoothAttention); None = 1."""
    key_smoothing: float = 0.0
    """alpha of key_scales = (per-channel max |K|) ** alpha, normalized to geometric mean 1."""

    def save(self, path: Path) -> None:
        data = {"outer_ratio": self.outer_ratio, "inner_ratio": self.inner_ratio, "key_smoothing": self.key_smoothing,
                "thresholds": self.values.tolist()}
        if self.key_scales is not None:
            data["key_scales"] = self.key_scales.tolist()
        path.write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: Path) -> "OakenThresholds":
        data = json.loads(Path(path).read_text())
        scales = data.get("key_scales")
        return cls(np.asarray(data["thresholds"], dtype=np.float32), data["outer_ratio"], data["inner_ratio"],
                   None if scales is None else np.asarray(scales, dtype=np.float32), data.get("key_smoothing", 0.0))

    def group_fractions(self, layer: int, kv: int, x: np.ndarray) -> tuple[float, float, float]:
        """Fractions of x (any shape) in the outer, middle and inner groups."""
        lo, ilo, ihi, hi = self.values[layer, kv]
        outer = np.mean((x < lo) | (x > hi))
        inner = np.mean((x >= ilo) & (x <= ihi))
        return float(outer), float(1 - outer - inner), float(inner)


def window_thresholds(x: np.ndarray, outer_ratio: float, inner_ratio: float) -> np.ndarray:
    """x: values of one layer's K (or V) over one window -> [4] thresholds."""
    qs = [outer_ratio / 2, 0.5 - inner_ratio / 2, 0.5 + inner_ratio / 2, 1 - outer_ratio / 2]
    return np.quantile(x.astype(np.float64).ravel(), qs).astype(np.float32)


def collect_kv(model, token_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Exact prefill of one window; per layer (k [T, Hkv, D] post-RoPE, v [T, Hkv, D]) as float32."""
    import torch

    from cpu_attn.prefill import prefill_attention

    with torch.inference_mode():
        dev = model.device
        x = model.embed(torch.tensor(token_ids, device=dev))
        cos, sin = model.rope(torch.arange(len(token_ids), device=dev))
        out = []
        for i in range(model.cfg.num_layers):
            q, k, v = model.pre_attention(i, x, cos, sin)
            q, k, v = (t.float().cpu() for t in (q, k, v))
            out.append((k.numpy().copy(), v.numpy().copy()))
            attn = prefill_attention(q, k, v, 0, model.cfg.head_dim**-0.5)
            x = model.post_attention(i, x, attn.reshape(len(token_ids), -1).to(device=dev, dtype=model.dtype))
    return out


def text_windows(token_ids: list[int], num_windows: int, window_tokens: int) -> list[list[int]]:
    """Evenly spaced, non-overlapping windows (fewer when the text is short)."""
    count = min(num_windows, len(token_ids) // window_tokens)
    if count < 1:
        raise ValueError(f"text has {len(token_ids)} tokens, fewer than one window of {window_tokens}")
    stride = len(token_ids) // count
    return [token_ids[i * stride:i * stride + window_tokens] for i in range(count)]


def key_scales(model, windows: list[list[int]], alpha: float) -> np.ndarray:
    """[num_layers, Hkv * D]: per-channel max |K| per window, averaged, to the power alpha,
    normalized per layer to geometric mean 1."""
    if alpha == 0:
        return np.ones((model.cfg.num_layers, model.cfg.num_kv_heads * model.cfg.head_dim), np.float32)
    peaks = np.mean([[np.abs(k).reshape(len(k), -1).max(0) for k, _ in collect_kv(model, w)] for w in windows], axis=0)
    s = np.maximum(peaks, 1e-3) ** alpha
    return (s / np.exp(np.log(s).mean(-1, keepdims=True))).astype(np.float32)


def calibrate(model, windows: list[list[int]], outer_ratio: float = 0.04, inner_ratio: float = 0.06,
              key_smoothing: float = 0.75, progress: bool = True) -> OakenThresholds:
    """Thresholds averaged over windows; key smoothing factors from the first (up to) 16 windows."""
    if not (0 < outer_ratio < 1 and 0 < inner_ratio < 1 and outer_ratio + inner_ratio < 1):
        raise ValueError("outer_ratio and inner_ratio must be in (0, 1) and sum to less than 1")
    if not 0 <= key_smoothing <= 1:
        raise ValueError("key_smoothing must be in [0, 1]")
    from tqdm import tqdm

    scales = key_scales(model, windows[:16], key_smoothing)
    total = np.zeros((model.cfg.num_layers, 2, 4), dtype=np.float64)
    for window in tqdm(windows, desc="calibrating", unit="window", disable=not progress):
        for layer, (k, v) in enumerate(collect_kv(model, window)):
            total[layer, 0] += window_thresholds(k.reshape(len(k), -1) / scales[layer], outer_ratio, inner_ratio)
            total[layer, 1] += window_thresholds(v, outer_ratio, inner_ratio)
    return OakenThresholds((total / len(windows)).astype(np.float32), outer_ratio, inner_ratio,
                           None if key_smoothing == 0 else scales, key_smoothing)
