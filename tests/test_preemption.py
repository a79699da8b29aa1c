"""A KV store too small for the load: requests are preempted and recomputed, never lost, and
greedy output does not change."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.config import ServeConfig
from tests.conftest import RunningServer

BYTES_PER_BLOCK_FP32 = 2 * 30 * 3 * 16 * 64 * 4  # SmolLM2-135M, block_size 16


def complete(url, i, **kw):
    body = {"prompt": f"Request {i}. Tell me about the history of the number {i * 37}.", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"] if not kw else r.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_small_kv_forces_preemption_with_identical_greedy_text(server):
    reference = [complete(server.url, i) for i in range(8)]
    small = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=20 * BYTES_PER_BLOCK_FP32,
                                      cpu_linear_dtype="float32"))  # bf16 linears round each output: batch-variant
    try:
        assert small.engine.blocks.spec.num_blocks == 20  # 320 tokens for 8 x ~65
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda i: complete(small.url, i), range(8)))
        assert small.engine.scheduler.num_preemptions > 0
        assert texts == reference
        assert small.engine.blocks.used_bytes == 0
        # echo's prompt logprobs: a recomputed prompt is scored again, each position reported once
        preempted = small.engine.scheduler.num_preemptions
        with ThreadPoolExecutor(8) as pool:
            scores = list(pool.map(lambda i: complete(small.url, i, echo=True, logprobs=0), range(8)))
            wants = list(pool.map(lambda i: complete(server.url, i, echo=True, logprobs=0), range(8)))
        assert small.engine.scheduler.num_preemptions > preempted
        for got, want in zip(scores, wants):
            assert got[0] is None and len(got) == len(want) and got[1:] == pytest.approx(want[1:], abs=1e-3)
        too_long = httpx.post(small.url + "/v1/completions", json={"prompt": "river " * 400, "max_tokens": 1}, timeout=60)
        assert too_long.status_code == 400
        assert "the KV cache holds at most 320 of a sequence" in too_long.json()["error"]["message"]
    finally:
        small.close()


@pytest.mark.slow  # the fp16 preemption test above covers the scheduler path in the default run
def test_oaken_kv_under_preemption_completes_every_request():
    """The Oaken store (calibrated on first use when the model cache has no thresholds) through
    the whole server: prefill, decode, preemption and recompute. Every request completes and every
    block comes back. Text may drift from the request sent alone: a prefill chunk attends to its
    own K/V exactly but to earlier chunks (and a recomputed request to its earlier tokens) through
    the quantized store, so chunking and recompute change numerics, a little."""
    from cpu_attn.kv_store import OakenKVStore

    per_block = OakenKVStore.bytes_per_block(30, 3, 64, 16)
    tails = OakenKVStore.tail_bytes(30, 3, 64, 16, 8)
    oaken = RunningServer(ServeConfig(kv_format="oaken", kv_cache_bytes=tails + 20 * per_block, max_num_seqs=8))
    try:
        assert oaken.engine.blocks.spec.num_blocks == 20
        alone = [complete(oaken.url, i) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda i: complete(oaken.url, i), range(8)))
        assert oaken.engine.scheduler.num_preemptions > 0
        assert all(len(t) > 100 for t in texts)
        assert all(t[:60] == a[:60] for t, a in zip(texts, alone))
        assert sum(t == a for t, a in zip(texts, alone)) >= 4
        assert oaken.engine.blocks.used_bytes == 0
    finally:
        oaken.close()
