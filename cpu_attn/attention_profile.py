"""Per-layer attention entropy, and the layers that layered KV sparsity keeps whole because of it.

A layer whose queries spread their attention over many tokens (high entropy) loses much of it when it
keeps a budget of tokens; one that attends to a few keeps almost all. `attention_entropy` runs windows
of text through the model and measures, per layer, the mean entropy (nats) of the softmax rows of
each window's last `observe` queries, over all query heads. `full_layers_from_entropy` turns that
into `--kv-full-layers`: the leading layers whose entropy is at least BROAD times the median layer's
(full layers come first in the KV layout, hetcore/kv_policy.py), at least one.

    SmolLM2-135M, 4 windows x 2048 tokens of WikiText-2 valid, 128 queries each:
    layer   0    1    2    3    4  ...  13   18   25  ...  28   29     median 3.0
    nats  6.68 4.39 4.47 3.76 3.57 ... 2.10 1.66 1.54 ... 3.03 3.03  -> layers 0-2 (>= 4.2): 3

The profile is kept beside the model (PROFILE_FILE in its cache directory); `hetserve calibrate
--attention-profile` writes it, and a layered server without --kv-full-layers measures it on first
use (`model_full_layers`).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from cpu_attn.calibrate import DEFAULT_TEXT, text_windows

log = logging.getLogger("hetserve")

PROFILE_FILE = "attention_profile.json"
BROAD = 2.0
"""A layer is broad when its entropy is at least this many times the median layer's."""
PROFILE_WINDOWS, PROFILE_WINDOW_TOKENS, PROFILE_OBSERVE = 4, 2048, 128


def attention_entropy(model, windows: list[list[int]], observe: int = PROFILE_OBSERVE) -> np.ndarray:
    """[num_layers] float64: per layer, the mean entropy (nats) of the attention of each window's last
    `observe` queries, over query heads and windows (causal, exact, from the model's own q and k)."""
    from cpu_attn.prefill import prefill_attention

    cfg = model.cfg
    total = np.zeros(cfg.num_layers)
    scale = cfg.head_dim ** -0.5
    group = cfg.num_heads // cfg.num_kv_heads
    with torch.no_grad():
        for ids in windows:
            n, a = len(ids), min(observe, len(ids))
            x = model.embed(torch.tensor(ids, device=model.device))
            cos, sin = model.rope(torch.arange(n, device=model.device))
            for i in range(cfg.num_layers):
                q, k, v = model.pre_attention(i, x, cos, sin)  # [T, H, D], [T, Hkv, D]
                qq, kk = q[-a:].float().cpu(), k.float().cpu().repeat_interleave(group, dim=1)
                s = torch.einsum("ahd,nhd->han", qq, kk) * scale
                s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n - a, n)[:, None], float("-inf"))
                p = torch.softmax(s, dim=-1)
                total[i] += -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean().item()
                attn = prefill_attention(q, k, v, 0, scale)
                x = model.post_attention(i, x, attn.reshape(n, -1).to(device=x.device, dtype=x.dtype))
    return total / len(windows)


def full_layers_from_entropy(entropy: np.ndarray) -> int:
    """The count of leading layers at least BROAD x the median layer's entropy, at least 1."""
    threshold = BROAD * float(np.median(entropy))
    count = 0
    while count < len(entropy) and entropy[count] >= threshold:
        count += 1
    return max(1, count)


def save_profile(path: Path, entropy: np.ndarray, num_windows: int, window_tokens: int, observe: int) -> None:
    path.write_text(json.dumps({"entropy_nats": [round(float(e), 5) for e in entropy], "windows": num_windows,
                                "window_tokens": window_tokens, "observe": observe, "broad": BROAD,
                                "kv_full_layers": full_layers_from_entropy(entropy)}, indent=1))


def load_entropy(path: Path) -> np.ndarray:
    return np.asarray(json.loads(path.read_text())["entropy_nats"], dtype=np.float64)


def measure_profile(model, ids: list[int], path: Path, num_windows: int = PROFILE_WINDOWS,
                    window_tokens: int = PROFILE_WINDOW_TOKENS) -> np.ndarray:
    """attention_entropy of windows of the token ids `ids` (at most the model's context each), saved to `path`."""
    tokens = min(window_tokens, model.cfg.max_position_embeddings, len(ids))
    windows = text_windows(ids, num_windows, tokens)
    entropy = attention_entropy(model, windows)
    save_profile(path, entropy, len(windows), tokens, PROFILE_OBSERVE)
    return entropy


def model_full_layers(model, model_dir: Path, encode: Callable[[str], list[int]]) -> int:
    """--kv-full-layers for `model`: from the profile in `model_dir`, measured there now when missing (on the
    default text, tokenized by `encode`; seconds for a small model)."""
    path = model_dir / PROFILE_FILE
    if path.is_file():
        entropy = load_entropy(path)
        if len(entropy) == model.cfg.num_layers:
            return full_layers_from_entropy(entropy)
    log.warning("no attention profile for this model yet: measuring it now on %d windows of %s to choose "
                "--kv-full-layers (once per model; `hetserve calibrate --attention-profile` does it beforehand)",
                PROFILE_WINDOWS, DEFAULT_TEXT.name)
    count = full_layers_from_entropy(measure_profile(model, encode(DEFAULT_TEXT.read_text()), path))
    log.info("attention profile saved to %s: --kv-full-layers %d", path, count)
    return count
