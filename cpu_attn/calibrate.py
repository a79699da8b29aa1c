"""Offline Oaken threshold profiling: the thresholds the Oaken KV store quantizes by.

Run windows of real text through the model, collect K (post-RoPE, as the store holds it) and V
of every layer, and find per layer and per K/V four thresholds that split values into groups:

    outer_lo | middle | inner_lo .. inner_hi | middle | outer_hi
      ~2%        ~45%        ~6% (inner)        ~45%     ~2%

As in the Oaken paper, thresholds are computed per window and averaged over windows, so one
unusual window cannot move them far. The result is a small JSON file next to the model cache.

Windows are placed at positions spread over the context the store will serve (window i starts at
frac(i * 0.618...) * (context - window): any prefix of the windows covers the range). RoPE is
relative, so the model computes the same for a window wherever it sits, but the keys it stores are
rotated by their position: statistics taken at positions 0..511 only (a channel's mean, its peak)
describe low-frequency channels that have barely turned yet, and keys 8k tokens later fall outside
them (measured: 13 % of key values past the outer thresholds at position 7000 instead of 4 %, and
+75 % perplexity at 8k with centering calibrated at 0..511).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hetcore.data import WIKITEXT2_VALID

THRESHOLDS_FILE = "oaken_thresholds.json"
DEFAULT_TEXT = WIKITEXT2_VALID
"""Calibration text when none is given: WikiText-2 valid, bundled with the package (the test split, test.txt
beside it, is kept for scoring)."""


BUNDLED_DIR = Path(__file__).resolve().parent / "calibrations"
"""Thresholds shipped for models hetserve ships with, as `hetserve calibrate` writes them with its defaults and fp32
linears; a file is named <GGUF file stem>.<first 16 hex digits of the GGUF's sha256>.json (`bundled_thresholds`)."""

CALIBRATION_WINDOWS = 100
"""Windows of `hetserve calibrate` and of the server's calibration on first use: 32 windows gave
SmolLM2 +1.02 % perplexity over fp32 KV at 512 tokens against +0.61 % with 100 (same KL, 0.0083)."""
CALIBRATION_WINDOW_TOKENS = 512

CALIBRATION_VERSION = 7
"""2: per-channel key centering and value smoothing (files of version 1 still load, without them);
3: windows spread over the context's positions (version 2 took keys at positions 0..511 only);
4: the key center is the pre-RoPE mean, turned to each key's position (2 and 3: one post-RoPE
mean for every position; such files still load, as a center that does not turn);
5: default ratios 0.06 / 0.08 (4 had 0.04 / 0.06; a cached file of 4 is redone on first use);
6: centered keys and values turned by a Hadamard rotation per head, smoothing off by default;
7: default ratios back to the paper's 0.04 / 0.06 (a cached file of 6 is redone on first use)."""

OUTER_RATIO, INNER_RATIO = 0.04, 0.06
"""Default shares of the outer and inner groups: the paper's. With the Hadamard rotation they hold the KV accuracy
targets on SmolLM2 at 5.17 realized bits (KL 0.0055, top-1 95.3 %; at 8k tokens KL 0.0061, top-1 95.4 %, 5.19
bits), where 0.06 / 0.08 realizes 5.51 bits at 8k (README, KV formats)."""
SPARSE_FRACTION = 0.125
"""Default sparse budget of a KV block, as a share of its values (the paper's): room for the ~10 % the default
ratios put in the sparse groups, plus slack for blocks with more (a token past it has values demoted to middle:
at 512 tokens top-1 95.30 % against 95.40 % with 0.16)."""
_CHANNEL_ARRAYS = ("key_scales", "key_bias", "value_scales", "rotation")


def hadamard(d: int, seed: int = 0) -> np.ndarray:
    """[d, d] orthogonal: random signs on the rows of a Walsh-Hadamard matrix (block-diagonal with
    blocks of the largest power of two dividing d). x @ H spreads each channel's share of x over all
    channels of its block, so a few large channels no longer set a token's scale alone (QuaRot)."""
    n = d & -d
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], d)
    return (signs[:, None] * np.kron(np.eye(d // n), h) / np.sqrt(n)).astype(np.float32)


def bundled_thresholds(gguf: Path) -> Path | None:
    """The shipped calibration of this GGUF file, matched by content; hashed only when one is shipped under its name."""
    candidates = list(BUNDLED_DIR.glob(f"{gguf.stem}.*.json"))
    if not candidates:
        return None
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    want = f"{gguf.stem}.{digest.hexdigest()[:16]}.json"
    return next((p for p in candidates if p.name == want), None)


def thresholds_file(dtype) -> str:
    """The model cache's thresholds file for a model whose linears run in `dtype` (a torch dtype):
    keys and values from bf16 linears fall outside thresholds calibrated in fp32 (SmolLM2 at 8k:
    5.8 % outer values instead of 4 %, Oaken +6.3 % perplexity instead of +1.4 % with thresholds
    calibrated in bf16), so each dtype gets its own calibration."""
    name = str(dtype).removeprefix("torch.")
    return THRESHOLDS_FILE if name == "float32" else f"oaken_thresholds_{name}.json"


@dataclass(frozen=True)
class OakenThresholds:
    values: np.ndarray
    """[num_layers, 2 (K, V), 4]: outer_lo, inner_lo, inner_hi, outer_hi of the stored K and V
    (after the per-channel transforms below)."""
    outer_ratio: float = OUTER_RATIO
    inner_ratio: float = INNER_RATIO
    key_scales: np.ndarray | None = None
    """[num_layers, Hkv * D] per-channel key smoothing: the store keeps (K - R(p) key_bias) / key_scales
    and attention multiplies q by key_scales, so q.k is unchanged (QServe's SmoothAttention); None = 1."""
    key_smoothing: float = 0.0
    """alpha of key_scales = (per-channel max |K - R(p) key_bias|) ** alpha, normalized to geometric mean 1."""
    key_bias: np.ndarray | None = None
    """[num_layers, Hkv * D] per-channel mean of the keys before RoPE, b; None = 0. A key at
    position p is stored as k - R(p) b (b turned by RoPE to p, `rotate`): keys share a large mean
    before RoPE in every channel pair, so once rotated the mean spins with the position, and a
    single post-RoPE mean removes little of it (measured on SmolLM2: relative key error 0.0021 with
    one post-RoPE mean, 0.00096 with R(p) b). Attention adds R(p) b back to each decoded key."""
    rope_inv_freq: np.ndarray | None = None
    """[D / 2] the model's RoPE frequencies that turn key_bias (zeros: a center that does not turn)."""
    value_scales: np.ndarray | None = None
    """[num_layers, Hkv * D] per-channel value smoothing: the store keeps V / value_scales and scales
    attention outputs back (attention is linear in V); None = 1."""
    value_smoothing: float = 0.0
    rotation: np.ndarray | None = None
    """[D, D] orthogonal (`hadamard`), None = off: the store keeps each head's transformed K and V
    times it (x @ rotation), attention turns queries the same way and outputs back."""
    context_tokens: int = 0
    """Positions the windows were spread over (0: all at position 0, files before version 3)."""
    version: int = CALIBRATION_VERSION
    """Of the calibration that wrote it (files without one are version 1)."""

    def save(self, path: Path) -> None:
        data = {"version": self.version, "outer_ratio": self.outer_ratio, "inner_ratio": self.inner_ratio,
                "key_smoothing": self.key_smoothing, "value_smoothing": self.value_smoothing,
                "context_tokens": self.context_tokens, "thresholds": self.values.tolist()}
        for name in _CHANNEL_ARRAYS + ("rope_inv_freq",):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name).tolist()
        path.write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: Path) -> "OakenThresholds":
        data = json.loads(Path(path).read_text())
        arrays = {name: None if data.get(name) is None else np.asarray(data[name], dtype=np.float32)
                  for name in _CHANNEL_ARRAYS}
        return cls(np.asarray(data["thresholds"], dtype=np.float32), data["outer_ratio"], data["inner_ratio"],
                   key_smoothing=data.get("key_smoothing", 0.0), value_smoothing=data.get("value_smoothing", 0.0),
                   context_tokens=data.get("context_tokens", 0), version=data.get("version", 1),
                   rope_inv_freq=_rope_inv_freq(data, arrays["key_bias"]), **arrays)

    def for_layers(self, layers: slice) -> OakenThresholds:
        """The calibration of a run of layers (a layered cache's group store, cpu_attn/kv_store.layered_stores)."""
        cut = {name: getattr(self, name)[layers] for name in ("values", "key_scales", "key_bias", "value_scales")
               if getattr(self, name) is not None}
        return replace(self, **cut)

    def per_head(self, num_kv_heads: int) -> OakenThresholds:
        """The same calibration with every layer split into `num_kv_heads` layers of one kv-head each (layer l's
        kv-head h becomes layer l * num_kv_heads + h: cpu_attn/kv_store.HeadRowsStore)."""
        split = {name: getattr(self, name).reshape(-1, getattr(self, name).shape[1] // num_kv_heads)
                 for name in ("key_scales", "key_bias", "value_scales") if getattr(self, name) is not None}
        return replace(self, values=np.repeat(self.values, num_kv_heads, axis=0), **split)

    def key_centers(self, layer: int, positions: np.ndarray) -> np.ndarray:
        """[T] positions -> [T, Hkv * D]: key_bias of `layer` turned to each position (R(p) b)."""
        b = self.key_bias[layer].reshape(1, -1, len(self.rope_inv_freq) * 2)
        return rotate(b, self.rope_inv_freq, positions).reshape(len(positions), -1)

    def stored(self, layer: int, kv: int, x: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        """K (kv 0) or V (kv 1) of `layer`, [T, Hkv, D] or [T, Hkv * D] -> [T, Hkv * D] as the store
        keeps it; keys need their positions when centered."""
        x = x.reshape(len(x), -1)
        if kv == 0:
            x = x if self.key_bias is None else x - self.key_centers(layer, positions)
            x = x if self.key_scales is None else x / self.key_scales[layer]
        else:
            x = x if self.value_scales is None else x / self.value_scales[layer]
        if self.rotation is None:
            return x
        d = len(self.rotation)
        return (x.reshape(len(x), -1, d) @ self.rotation).reshape(len(x), -1)

    def group_fractions(self, layer: int, kv: int, x: np.ndarray) -> tuple[float, float, float]:
        """Fractions of x (any shape, as stored: see `stored`) in the outer, middle and inner groups."""
        lo, ilo, ihi, hi = self.values[layer, kv]
        outer = np.mean((x < lo) | (x > hi))
        inner = np.mean((x >= ilo) & (x <= ihi))
        return float(outer), float(1 - outer - inner), float(inner)


def _rope_inv_freq(data: dict, key_bias: np.ndarray | None) -> np.ndarray | None:
    if "rope_inv_freq" in data:
        return np.asarray(data["rope_inv_freq"], np.float64)
    return None if key_bias is None else np.zeros(key_bias.shape[-1] // 2)  # versions 2-3: a fixed center


def rotate_half(x: np.ndarray) -> np.ndarray:
    """RoPE's rotate-half: [..., D] -> (-x[D/2:], x[:D/2])."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def turn(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T or 1, H, D] turned by RoPE (rotate-half layout) by angles with cos, sin [T, D / 2] -> [T, H, D] float32."""
    cos, sin = (np.tile(t, 2)[:, None, :] for t in (cos, sin))
    return (x * cos + rotate_half(x) * sin).astype(np.float32)


def rotate(x: np.ndarray, inv_freq: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [T or 1, H, D] turned by RoPE to positions [T] -> [T, H, D] float32; negative positions turn back."""
    angle = np.outer(np.asarray(positions, np.float64), np.asarray(inv_freq, np.float64))  # [T, D / 2]
    return turn(x, np.cos(angle), np.sin(angle))


def window_thresholds(x: np.ndarray, outer_ratio: float, inner_ratio: float) -> np.ndarray:
    """x: values of one layer's K (or V) over one window -> [4] thresholds."""
    qs = [outer_ratio / 2, 0.5 - inner_ratio / 2, 0.5 + inner_ratio / 2, 1 - outer_ratio / 2]
    return np.quantile(x.astype(np.float64).ravel(), qs).astype(np.float32)


def collect_kv(model, token_ids: list[int], start: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Exact prefill of one window at positions start, start + 1, ...; per layer (k [T, Hkv, D]
    post-RoPE, v [T, Hkv, D]) as float32."""
    import torch

    from cpu_attn.prefill import prefill_attention

    with torch.inference_mode():
        dev = model.device
        x = model.embed(torch.tensor(token_ids, device=dev))
        cos, sin = model.rope(torch.arange(start, start + len(token_ids), device=dev))
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


def window_starts(num_windows: int, window_tokens: int, context_tokens: int) -> list[int]:
    """Where each window sits: frac(i * golden ratio) of the room in the context, so any prefix of
    the windows is spread over the positions too."""
    room = max(context_tokens - window_tokens, 0)
    return [int(((i * 0.6180339887498949) % 1.0) * room) for i in range(num_windows)]


def _smoothing(peaks: np.ndarray, alpha: float) -> np.ndarray | None:
    """Per-channel peaks [L, C] -> peaks ** alpha normalized per layer to geometric mean 1 (None for alpha 0)."""
    if alpha == 0:
        return None
    s = np.maximum(peaks, 1e-3) ** alpha
    return (s / np.exp(np.log(s).mean(-1, keepdims=True))).astype(np.float32)


def channel_transforms(model, windows: list[list[int]], starts: list[int], inv_freq: np.ndarray, key_smoothing: float,
                       key_centering: bool, value_smoothing: float) -> tuple[np.ndarray | None, ...]:
    """(key_scales, key_bias, value_scales), each [num_layers, Hkv * D] or None: per window the
    per-channel mean of the keys before RoPE b, max |K - R(p) b| and max |V|, averaged over
    windows (a window's peaks are taken around its own mean, so one pass over the windows does);
    inv_freq: the model's RoPE frequencies."""
    def stats(k, v, positions):
        b = rotate(k, inv_freq, -positions).mean(0, keepdims=True) if key_centering else np.zeros_like(k[:1])
        k_peak = np.abs(k - rotate(b, inv_freq, positions)).max(0)
        return b.ravel(), k_peak.ravel(), np.abs(v).max(0).ravel()

    per_window = [[stats(k, v, s + np.arange(len(k))) for k, v in collect_kv(model, w, s)]
                  for w, s in zip(windows, starts)]  # [W, L, 3, C]
    bias, k_peak, v_peak = np.mean(per_window, axis=0).transpose(1, 0, 2)
    bias = bias.astype(np.float32) if key_centering else None
    return _smoothing(k_peak, key_smoothing), bias, _smoothing(v_peak, value_smoothing)


def calibrate(model, windows: list[list[int]], outer_ratio: float = OUTER_RATIO, inner_ratio: float = INNER_RATIO,
              key_smoothing: float = 0.0, key_centering: bool = True, value_smoothing: float = 0.0,
              context_tokens: int | None = None, progress: bool = True, rotate: bool = True) -> OakenThresholds:
    """Thresholds averaged over windows; the per-channel transforms from the first (up to) 16 windows.
    Windows are spread over positions 0 .. context_tokens (default: the model's maximum). With
    `rotate`, stored K and V are turned by `hadamard` per head after centering and smoothing
    (smoothing then hurts: SmolLM2 fake-quantized, KL 0.0082 without, 0.0116 with key smoothing 0.75)."""
    if not (0 < outer_ratio < 1 and 0 < inner_ratio < 1 and outer_ratio + inner_ratio < 1):
        raise ValueError("outer_ratio and inner_ratio must be in (0, 1) and sum to less than 1")
    if not (0 <= key_smoothing <= 1 and 0 <= value_smoothing <= 1):
        raise ValueError("key_smoothing and value_smoothing must be in [0, 1]")
    from tqdm import tqdm

    context_tokens = context_tokens or model.cfg.max_position_embeddings
    starts = window_starts(len(windows), max(map(len, windows)), context_tokens)
    inv_freq = model.inv_freq.double().cpu().numpy()
    k_scale, k_bias, v_scale = channel_transforms(model, windows[:16], starts, inv_freq, key_smoothing, key_centering,
                                                  value_smoothing)
    cal = OakenThresholds(np.zeros((model.cfg.num_layers, 2, 4), np.float32), outer_ratio, inner_ratio, k_scale,
                          key_smoothing, k_bias, None if k_bias is None else inv_freq, v_scale, value_smoothing,
                          hadamard(model.cfg.head_dim) if rotate else None, context_tokens)
    total = np.zeros(cal.values.shape, dtype=np.float64)
    for window, start in tqdm(list(zip(windows, starts)), desc="calibrating", unit="window", disable=not progress):
        positions = start + np.arange(len(window))
        for layer, kv in enumerate(collect_kv(model, window, start)):
            for kind in (0, 1):
                total[layer, kind] += window_thresholds(cal.stored(layer, kind, kv[kind], positions), outer_ratio,
                                                        inner_ratio)
    return replace(cal, values=(total / len(windows)).astype(np.float32))
