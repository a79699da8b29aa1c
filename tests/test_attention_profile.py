"""The attention profile that chooses layered KV sparsity's full layers: entropy against a NumPy twin,
the rule, its file beside the model, and the server's use of it when --kv-full-layers is not given."""
import numpy as np
import pytest
import torch

from cpu_attn.attention_profile import (PROFILE_FILE, attention_entropy, full_layers_from_entropy, load_entropy,
                                        model_full_layers, save_profile)
from gpu_model.loader import load_model
from hetcore.kv_policy import KVPolicy, KVPolicyError
from tests.test_model import tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir, _ = tiny_model_dir(tmp_path_factory.mktemp("tiny"), num_hidden_layers=4)
    return model_dir, load_model(model_dir)


def numpy_entropy(model, ids: list[int], observe: int) -> np.ndarray:
    """The layers' mean entropy over the last `observe` queries, softmax in float64 from the model's own q, k
    and an exact causal attention for the next layer's input."""
    cfg, n = model.cfg, len(ids)
    group = cfg.num_heads // cfg.num_kv_heads
    out = np.zeros(cfg.num_layers)
    with torch.no_grad():
        x = model.embed(torch.tensor(ids))
        cos, sin = model.rope(torch.arange(n))
        for i in range(cfg.num_layers):
            q, k, v = model.pre_attention(i, x, cos, sin)
            qn, kn, vn = (t.double().numpy() for t in (q, k, v))
            kn, vn = kn.repeat(group, axis=1), vn.repeat(group, axis=1)
            s = np.einsum("qhd,khd->hqk", qn, kn) / np.sqrt(cfg.head_dim)
            s[:, np.triu(np.ones((n, n), bool), 1)] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            last = p[:, n - observe:]
            out[i] = -(last * np.log(np.where(last > 0, last, 1))).sum(-1).mean()
            attn = np.einsum("hqk,khd->qhd", p, vn).reshape(n, -1)
            x = model.post_attention(i, x, torch.from_numpy(attn).float())
    return out


def test_entropy_matches_numpy(tiny):
    _, model = tiny
    windows = [list(np.random.default_rng(s).integers(0, 101, 48)) for s in (1, 2)]
    want = np.mean([numpy_entropy(model, w, 16) for w in windows], axis=0)
    got = attention_entropy(model, windows, observe=16)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert (got > 0).all() and (got <= np.log(48) + 1e-6).all()  # a row over at most 48 keys


@pytest.mark.parametrize("entropy, count", [
    ([6.7, 4.4, 4.5, 3.8, 3.0, 2.9, 2.0, 3.0, 2.5], 1),  # SmolLM2's shape: median 3.0, broad from 6.0
    ([6.7, 6.1, 4.5, 3.8, 3.0, 2.9, 2.0, 3.0, 2.5], 2),
    ([3.0] * 8, 1),  # nothing broader than the rest: one full layer, the least layered sparsity allows
    ([2.0, 5.0, 5.0, 2.0, 2.0], 1),  # broad layers after a narrow first one are not a leading run
    ([9.0, 9.0, 1.0, 1.0, 1.0], 2),
])
def test_full_layers_are_the_leading_broad_ones(entropy, count):
    assert full_layers_from_entropy(np.array(entropy)) == count


def test_profile_is_measured_once_and_kept_beside_the_model(tiny, tmp_path, monkeypatch):
    model_dir, model = tiny
    path = model_dir / PROFILE_FILE
    path.unlink(missing_ok=True)
    encode = lambda text: [b % 101 for b in text.encode()[:4000]]  # noqa: E731 (the tiny model has no tokenizer)
    count = model_full_layers(model, model_dir, encode)
    assert path.is_file() and count == full_layers_from_entropy(load_entropy(path))
    assert len(load_entropy(path)) == model.cfg.num_layers

    def fail(*a, **kw):
        raise AssertionError("measured again")
    monkeypatch.setattr("cpu_attn.attention_profile.attention_entropy", fail)
    assert model_full_layers(model, model_dir, encode) == count


def test_backend_takes_its_full_layers_from_the_profile(tiny):
    """No --kv-full-layers: the layered layout's full layers are the profile's choice."""
    from server.backend_config import BackendConfig
    from server.hetero import HeteroBackend

    model_dir, _ = tiny
    save_profile(model_dir / PROFILE_FILE, np.array([5.0, 5.0, 0.0, 0.0]), 1, 32, 8)  # median 2.5: layers 0, 1 broad
    config = BackendConfig(kv_format="fp32", kv_capacity_bytes=2**20, block_size=4, cpu_linear_dtype="float32",
                           kv_policy=KVPolicy("layered", full_layers=None, budget_tokens=16, window=4, sinks=2))
    backend = HeteroBackend(model_dir, config)
    assert backend.config.kv_policy.full_layers == 2 and backend.kv_spec.kv_layout.num_groups == 2  # 2 layers a group
    save_profile(model_dir / PROFILE_FILE, np.array([5.0, 1.0, 1.0, 1.0]), 1, 32, 8)
    backend = HeteroBackend(model_dir, config)
    assert backend.config.kv_policy.full_layers == 1 and backend.kv_spec.kv_layout.num_groups == 4  # 1 layer a group
    with pytest.raises(KVPolicyError, match="not chosen yet"):
        config.kv_policy.layout(4, 256)
