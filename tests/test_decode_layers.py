"""A decode step with every layer in one call (gpu_model/cpu_decode.decode_layers) against the same step run a
layer at a time: the same tokens, log-probabilities, accepted drafts and KV cache, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_attn.fp16 import narrow
from hetcore.backend import SamplingParams, SeqChunk, StepInput
from server.block_manager import BlockManager

GREEDY = SamplingParams(temperature=0.0, logprobs=5)


def test_narrowing_to_fp16_rounds_as_numpy():
    """f32_to_fp16 against astype(np.float16): random bit patterns (nan and inf among them) and every half's
    neighbourhood (ties, carries into the exponent, subnormals, overflow to inf)."""
    bits = np.random.default_rng(0).integers(0, 2**32, size=200_000, dtype=np.int64)
    halves = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32).astype(np.int64)
    near = np.concatenate([halves + d for d in (-1, 0, 1, 0xFFF, 0x1000, 0x1001)])
    x = (np.concatenate([bits, near]) % 2**32).astype(np.uint32).view(np.float32)
    out = np.empty(x.shape, np.uint16)
    narrow(x, out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out, x.astype(np.float16).view(np.uint16))


def backends(config, monkeypatch) -> tuple:
    """Two backends of `config`: one that runs decode steps in one call (each call noted in the list returned third),
    one that runs them a layer at a time."""
    from gpu_model.loader import resolve_model_dir
    from server.hetero import HeteroBackend

    fused, layered = (HeteroBackend(resolve_model_dir(None), config) for _ in range(2))
    if not fused.model_worker.fuses_decode(1):
        pytest.skip("the default linears are not in the integer-dot layout on this CPU (no AVX512-VNNI)")
    monkeypatch.setattr(layered.model_worker, "fuses_decode", lambda num_tokens: False)
    one_call = []
    forward_decode = fused.model_worker.forward_decode
    monkeypatch.setattr(fused.model_worker, "forward_decode", lambda *args: one_call.append(1) or forward_decode(*args))
    return fused, layered, one_call


@pytest.mark.parametrize("kv_format", ["fp16", "fp32"])
def test_decode_in_one_call_gives_the_layer_by_layer_bits(kv_format, monkeypatch):
    from server.backend_config import BackendConfig

    fused, layered, one_call = backends(BackendConfig(kv_format=kv_format, kv_capacity_bytes=16 * 2**20), monkeypatch)
    prompts = [list(range(100, 137)), [5, 6, 7, 8, 9], list(range(300, 360))]
    blocks = BlockManager(fused.kv_spec)
    tokens = [list(p) for p in prompts]

    def chunk(i: int, drafts: tuple[int, ...] = ()) -> SeqChunk:
        seq = tokens[i]
        return SeqChunk(i, (seq[-1], *drafts), len(seq) - 1, blocks.allocate(i, len(seq) + len(drafts)), GREEDY,
                        len(seq) - len(prompts[i]), num_draft=len(drafts))

    steps = [[SeqChunk(i, tuple(p), 0, blocks.allocate(i, len(p)), GREEDY) for i, p in enumerate(prompts)]]
    steps += [lambda: [chunk(1)]] * 2 + [lambda: [chunk(i) for i in range(3)]]  # one sequence; all three
    steps += [lambda: [chunk(i, tuple(tokens[i][-3:])) for i in range(3)]]  # three drafts each (accepted or not)
    steps += [lambda: [chunk(0, (7,)), chunk(1), chunk(2, tuple(tokens[2][-5:-1]))]]  # drafts beside a decode
    steps += [lambda: [chunk(i) for i in range(3)]] * 4
    for step, make in enumerate(steps):
        inp = StepInput(tuple(make if step == 0 else make()))
        a, b = fused.step(inp), layered.step(inp)
        assert (a.sampled, a.logprobs, a.accepted, a.accepted_logprobs) == (b.sampled, b.logprobs, b.accepted,
                                                                             b.accepted_logprobs)
        if step:
            assert a.timings.cpu_attn_s > 0  # the one call's attention share is counted as attention
        for seq_id, tok in a.sampled.items():
            tokens[seq_id].extend((*a.accepted.get(seq_id, ()), tok))
    assert len(one_call) == len(steps) - 1
    assert np.array_equal(fused.attn_worker.store.k, layered.attn_worker.store.k)
    assert np.array_equal(fused.attn_worker.store.v, layered.attn_worker.store.v)


def test_layers_stack_only_when_each_linear_has_one_kind():
    """stack_layers: every layer's weights on a leading axis, each layer's DecodeWeights views of them (the same
    values); None where one linear's kind or shape differs between layers (those models run a layer at a time)."""
    from gpu_model.cpu_decode import DecodeWeights, stack_layers
    from tests.test_quant_vnni import weights

    def layer(seed: int, qkv_kind: str = "q4_1") -> DecodeWeights:
        return DecodeWeights(*(weights(kind, num_rows=32, num_blocks=2, seed=seed + i)[1]
                               for i, kind in enumerate((qkv_kind, "q4_1", "q4_1", "q4_1"))))

    norms = np.ones((2, 64), np.float32)
    layers = [layer(0), layer(10)]
    stack, views = stack_layers(layers, norms, norms)
    assert stack.qkv.qs.shape == (2, *layers[0].qkv.qs.shape)
    for got, want in zip(views, layers):
        for a, b in zip(got, want):
            assert np.array_equal(a.qs, b.qs) and np.array_equal(a.scales, b.scales)
            assert np.shares_memory(a.qs, stack.qkv.qs) or np.shares_memory(a.qs, stack.down.qs) \
                or np.shares_memory(a.qs, stack.o.qs) or np.shares_memory(a.qs, stack.gate_up.qs)
    assert stack_layers([layer(0), layer(10, qkv_kind="q8_0")], norms, norms) is None
    assert stack_layers([layer(0), None], norms, norms) is None


@pytest.mark.parametrize("kv_format,full_layers", [("fp16", 1), ("fp32", 3)])
def test_layered_decode_in_one_call_gives_the_layer_by_layer_bits(kv_format, full_layers, monkeypatch):
    """Layered KV sparsity (one group a layer; groups of three): decode steps in one call against the same steps a
    layer at a time, with evictions during decode: the same tokens and log-probabilities, scores and KV, bit for bit."""
    from hetcore.kv_policy import KVPolicy
    from server.backend_config import BackendConfig
    from server.scheduler import Scheduler, SchedulerConfig, Sequence

    policy = KVPolicy("layered", full_layers=full_layers, budget_tokens=24, window=8, evict_slack=4)
    config = BackendConfig(kv_format=kv_format, kv_capacity_bytes=16 * 2**20, kv_policy=policy)
    fused, layered, one_call = backends(config, monkeypatch)
    schedulers = [Scheduler(SchedulerConfig(4, 32), BlockManager(b.kv_spec)) for b in (fused, layered)]
    for s in schedulers:
        for i, prompt in enumerate([list(range(100, 150)), list(range(300, 340)), [5, 6, 7, 8, 9] * 6]):
            s.add(Sequence(i, prompt, GREEDY))
    for _ in range(24):
        inputs = [s.schedule() for s in schedulers]
        assert inputs[0] == inputs[1]
        a, b = fused.step(inputs[0]), layered.step(inputs[1])
        assert (a.sampled, a.logprobs) == (b.sampled, b.logprobs)
        for s, out in zip(schedulers, (a, b)):
            s.update(out)
    assert len(one_call) >= 10 and schedulers[0].blocks.num_evictions > 0
    x, y = fused.attn_worker, layered.attn_worker
    assert x.stores[0] is x.stores[-1]  # one store over every group's blocks
    assert np.array_equal(x.stores[0].k, y.stores[0].k) and np.array_equal(x.stores[0].v, y.stores[0].v)
    assert x._scores.keys() == y._scores.keys()
    assert all(np.array_equal(x._scores[i], y._scores[i]) for i in x._scores)
