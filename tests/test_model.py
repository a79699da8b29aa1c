"""The split model + CPU attention against HF transformers on tiny random Llama models."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hetcore.backend import SamplingParams, SeqChunk, StepInput
from server.block_manager import BlockManager

GREEDY = SamplingParams(temperature=0.0)
PROMPTS_TINY = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [2, 71, 82], [7]]


def tiny_model_dir(tmp_path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
                         **overrides})
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    return tmp_path, hf


def greedy_through_backend(model_dir, prompts, num_new, chunk=5, device="cpu", dtype="float32", linears="float32",
                           **backend_args):
    """Prefill in chunks of `chunk` tokens, then decode all sequences in one batch per step."""
    from server.backend_config import BackendConfig
    from server.hetero import HeteroBackend

    backend = HeteroBackend(model_dir, BackendConfig(device=device, dtype=dtype, kv_capacity_bytes=2**22, block_size=4,
                                                     cpu_linear_dtype=linears, **{"kv_format": "fp32", **backend_args}))
    blocks = BlockManager(backend.kv_spec)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    for _ in range(num_new + 4):
        chunks = []
        for i, seq in enumerate(tokens):
            if len(seq) - len(prompts[i]) >= num_new:
                continue
            n = min(chunk, len(seq) - computed[i])
            table = blocks.allocate(i, computed[i] + n)
            is_last = computed[i] + n == len(seq)
            chunks.append(SeqChunk(i, tuple(seq[computed[i]:computed[i] + n]), computed[i], table,
                                   GREEDY if is_last else None, len(seq) - len(prompts[i])))
            computed[i] += n
        if not chunks:
            break
        out = backend.step(StepInput(tuple(chunks)))
        for seq_id, tok in out.sampled.items():
            tokens[seq_id].append(tok)
    return [t[len(p):] for t, p in zip(tokens, prompts)]


def hf_greedy(hf, prompt, num_new):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("overrides", [
    {"tie_word_embeddings": False},
    {"tie_word_embeddings": True, "rope_theta": 500000.0},
    {"tie_word_embeddings": False, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"tie_word_embeddings": False, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
])
def test_batched_chunked_decode_matches_hf(tmp_path, overrides):
    model_dir, hf = tiny_model_dir(tmp_path, **overrides)
    ours = greedy_through_backend(model_dir, PROMPTS_TINY, num_new=10)
    assert ours == [hf_greedy(hf, p, 10) for p in PROMPTS_TINY]


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_linears_stay_close_to_fp32_and_batch_invariant(tmp_path, tied):
    """cpu_linear_dtype bfloat16 (the default on CPUs with native bf16): each projection within
    bf16's rounding of the fp32 one, activations in fp32; with every step on the bf16 path (no GGUF
    blocks here), a sequence's greedy tokens are the same alone as in a batch on this tiny model
    (on the real one a near-tie may flip: test_preemption.py runs fp32 linears)."""
    from gpu_model.loader import load_model

    model_dir, _ = tiny_model_dir(tmp_path, tie_word_embeddings=tied)
    ref, bf = load_model(model_dir, cpu_linear_dtype="float32"), load_model(model_dir, cpu_linear_dtype="bfloat16")
    assert bf.layers[0].gate_up.weight.dtype == torch.bfloat16 and bf.embed_tokens.weight.dtype == torch.float32
    x = torch.randn(7, 64)
    cos, sin = ref.rope(torch.arange(7))
    pairs = [*zip(ref.pre_attention(0, x, cos, sin), bf.pre_attention(0, x, cos, sin)),
             (ref.post_attention(1, x, x), bf.post_attention(1, x, x)), (ref.logits(x), bf.logits(x))]
    for a, b in pairs:
        assert b.dtype == torch.float32
        assert ((a - b).norm() / a.norm()).item() < 1e-2  # bf16 keeps 8 bits of mantissa: ~0.4 % per value
    batched = greedy_through_backend(model_dir, PROMPTS_TINY, num_new=10, linears="bfloat16")
    assert batched == greedy_through_backend(model_dir, PROMPTS_TINY, num_new=10, linears="float32")
    assert batched == [greedy_through_backend(model_dir, [p], num_new=10, linears="bfloat16")[0] for p in PROMPTS_TINY]



@pytest.mark.parametrize("tied", [True, False])
def test_packed_bf16_linears_give_plain_linears_results(tmp_path, tied):
    """cast_linears(pack=True) keeps oneDNN-blocked copies of the bf16 weights (the loader's choice on
    CPUs with native bf16): every matmul, the head included, must give exactly plain linear's bf16
    result at any step size. Where this torch cannot pack, the model must fall back to plain."""
    from gpu_model.loader import load_model
    from gpu_model.model import LINEARS

    model_dir, _ = tiny_model_dir(tmp_path, tie_word_embeddings=tied)
    model = load_model(model_dir, cpu_linear_dtype="float32")
    model.cast_linears(torch.bfloat16, pack=True)
    if not model.packed:
        pytest.skip("no oneDNN packing in this torch (the model multiplies by the plain bf16 weights)")
    assert set(model.packed) == {f"layers.{i}.{n}" for i in range(2) for n in LINEARS} | {"head"}
    weights = model.matmul_weights()
    for tokens in (1, 2, 16, 300):
        x = torch.randn(tokens, 64)
        for key, w in weights.items():
            x_in = x if w.shape[1] == 64 else torch.randn(tokens, w.shape[1])
            got = model._linear(key, w, x_in)
            assert got.dtype == torch.float32
            assert torch.equal(got, nn.functional.linear(x_in.bfloat16(), w).float()), (key, tokens)

def test_loader_rejects_what_it_cannot_load(tmp_path):
    from gpu_model.loader import ModelLoadError, resolve_model_dir

    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(tmp_path / "nope.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="expected a .gguf"):
        resolve_model_dir(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_dir(tmp_path)


def test_sampler_top_k_top_p_and_seed():
    from gpu_model.sampler import filter_logits, sample

    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0)[2:]).all()
    kept = filter_logits(logits, 0, 0.5)  # the top token alone holds > 0.5 of the mass
    assert torch.isfinite(kept).tolist() == [True, False, False, False]
    p = SamplingParams(temperature=1.0, seed=5)
    draws = [sample(logits[None], [p], [i])[0] for i in range(200)]
    assert draws == [sample(logits[None], [p], [i])[0] for i in range(200)]
    freq0 = draws.count(0) / len(draws)
    assert 0.55 < freq0 < 0.8  # softmax([3,2,1,0])[0] = 0.64


def test_sampler_penalties_bias_and_logprobs_against_numpy():
    from gpu_model.sampler import logprobs, penalize, sample

    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.normal(size=(3, 50)).astype(np.float32))
    history = [7, 7, 7, 3, 49]
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=-0.25, logprobs=4,
                       logit_bias=((2, 1.5), (7, -3.0)))
    want = logits[0].numpy().copy()
    for t in set(history):  # OpenAI's definition: counts of the request's sampled tokens
        want[t] -= 0.5 + -0.25 * history.count(t)
    want[2] += 1.5
    want[7] -= 3.0
    np.testing.assert_allclose(penalize(logits[0], p, history).numpy(), want, rtol=0, atol=1e-6)
    assert sample(logits[:1], [p], [0], [history]) == [int(want.argmax())]
    logits[1, 11] = 50.0  # a clear winner the penalty must overturn
    greedy = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert sample(logits[1:2], [greedy], [0], [[11] * 30]) != [11]
    assert sample(logits[1:2], [greedy], [0], [()]) == [11]
    lps = logprobs(logits, [5, 11, 0], [p.logprobs, 0, None])
    ref = logits[0].double().numpy() - np.log(np.exp(logits[0].double().numpy()).sum())
    assert lps[0][0] == pytest.approx(ref[5], abs=1e-5)  # the raw distribution, not the penalized one
    assert [i for i, _ in lps[0][1]] == list(np.argsort(-ref)[:4])
    assert np.allclose([x for _, x in lps[0][1]], np.sort(ref)[::-1][:4], atol=1e-5)
    assert lps[1][1] == () and lps[1][0] == pytest.approx(0.0, abs=1e-5) and lps[2] is None
