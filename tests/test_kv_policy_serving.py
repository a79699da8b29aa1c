"""Layered KV sparsity through the whole server (SmolLM2-135M, fp32 KV, fp32 linears): with a budget
no sequence reaches, the text equals the full cache's; with a small one, requests that evict still
complete under preemption, and every block of every layer group comes back."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.config import ServeConfig
from tests.conftest import RunningServer

PROMPTS = ["Tell me about the history of the number 37.", "river " * 150 + "Which word came before?",
           "The capital of France is", "Once upon a time, " * 20]


def complete(url: str, prompt: str, max_tokens: int = 40) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def run_all(srv: RunningServer) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: complete(srv.url, p), PROMPTS))


def serve(**kw) -> RunningServer:
    return RunningServer(ServeConfig(kv_format="fp32", cpu_linear_dtype="float32", max_num_batched_tokens=64, **kw))


@pytest.mark.slow  # ~30 s: three servers; test_kv_policy_blocks.py covers the accounting in the default run
def test_layered_serving_equals_full_without_eviction_and_frees_every_group():
    full = serve(kv_cache_bytes=64 * 2**20)
    try:
        reference = run_all(full)
    finally:
        full.close()
    roomy = serve(kv_cache_bytes=64 * 2**20, kv_policy="layered", kv_budget_tokens=1024)
    try:
        assert roomy.engine.blocks.spec.kv_layout.num_groups == 10
        assert run_all(roomy) == reference
        assert roomy.engine.blocks.num_free_blocks == roomy.engine.blocks.spec.num_blocks
    finally:
        roomy.close()
    # 3 full layers of 30, the rest 48 + 16 rows at most: the 150-word prompt evicts at its end
    per_group = 2 * 3 * 3 * 16 * 64 * 4  # K and V of 3 layers, 3 kv-heads, 16 tokens, head_dim 64, fp32
    tight = serve(kv_cache_bytes=120 * per_group, kv_policy="layered", kv_budget_tokens=48, kv_window=16)
    try:
        texts = run_all(tight)
        assert texts[0] == reference[0] and texts[2] == reference[2]  # short: never more than 64 rows
        assert all(len(t) > 0 for t in texts) and tight.engine.blocks.num_evictions > 0
        metrics = httpx.get(tight.url + "/metrics").text
        assert 'hetserve:kv_cache_group_usage_bytes{group="9"}' in metrics
        assert tight.engine.blocks.num_free_blocks == 120
    finally:
        tight.close()


def test_layered_over_oaken_evicts_serves_and_frees_every_group():
    """Oaken KV (calibrated, full-precision tails) under a budget the prompts outgrow: every request completes with
    rows evicted at prompts' ends and while decoding (kept rows move as their codes), four at once, and every block
    of every group comes back."""
    srv = RunningServer(ServeConfig(kv_format="oaken", max_num_batched_tokens=64, kv_cache_bytes=32 * 2**20,
                                    max_num_seqs=4, kv_policy="layered", kv_budget_tokens=48, kv_window=16))
    try:
        assert srv.engine.blocks.spec.kv_layout.num_groups > 1
        texts = run_all(srv)
        assert all(len(t) > 0 for t in texts) and srv.engine.blocks.num_evictions > 0
        assert srv.engine.blocks.num_free_blocks == srv.engine.blocks.spec.num_blocks
    finally:
        srv.close()


def test_layered_refuses_what_it_cannot_run_in_one_line():
    from hetcore.kv_policy import KVPolicyError

    with pytest.raises(ValueError, match="kv_policy layered needs attention exact"):
        ServeConfig(kv_format="oaken", attention="magicpig", kv_policy="layered")
    with pytest.raises(ValueError, match="one micro-batch a step on the ray executor"):
        ServeConfig(executor="ray", ray_cpu_actors=2, ray_microbatches=2, kv_policy="layered")
    with pytest.raises(KVPolicyError, match="give kv_budget_tokens or kv_budget_ratio, not both"):
        ServeConfig(kv_policy="layered", kv_budget_tokens=100, kv_budget_ratio=0.5)
    with pytest.raises(KVPolicyError, match="kv_full_layers 40 is outside 1..30"):
        serve(kv_cache_bytes=2**20, kv_policy="layered", kv_full_layers=40)


def test_layered_on_ray_cpu_actors_gives_the_local_text():
    """Two CPU attention actors, each a shard of the layered cache (its group tables offset like the block table):
    with a budget the prompts outgrow (eviction at a prompt's end and during decode), the same greedy text as the
    local executor, and every block back. One request at a time: a prompt's chunks (and so the queries that score
    it at its end) depend on what else shares its steps."""
    kw = dict(kv_cache_bytes=64 * 2**20, kv_policy="layered", kv_budget_tokens=48, kv_window=16)

    def run_each(srv: RunningServer) -> list[str]:
        return [complete(srv.url, p) for p in PROMPTS]

    local = serve(**kw)
    try:
        reference = run_each(local)
        assert local.engine.blocks.num_evictions > 0
    finally:
        local.close()
    ray = serve(executor="ray", ray_cpu_actors=2, **kw)
    try:
        assert run_each(ray) == reference
        assert ray.engine.blocks.num_evictions > 0 and ray.engine.blocks.spec.shards == (
            ray.engine.blocks.spec.num_blocks // 2,) * 2
        assert ray.engine.blocks.num_free_blocks == ray.engine.blocks.spec.num_blocks
    finally:
        ray.close()

