"""The Ray executor over the default long-context path (Oaken KV + MagicPIG sampling, two CPU
attention actors): the same greedy text as the local executor, and no actor lost on the way."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.config import ServeConfig
from tests.conftest import SHARED, RunningServer

pytest.importorskip("ray")


def test_ray_oaken_magicpig_matches_local():
    """One request at a time the text must be equal: which requests share a step changes the
    linears' float rounding, which Oaken's levels and the LSH sign bits can turn into another
    token. Each prompt is prefilled in chunks (a step's budget of 128 tokens), so in its first decode
    steps MagicPIG centers its keys on the whole prompt and codes them on the CPU actor, and the centers
    go back to the model actor for the later keys. A prompt sent again takes its blocks from the
    prefix cache and its center is chosen the same way: equal text again. Concurrent requests then
    only have to complete without losing an actor."""
    text = (SHARED / "data" / "wikitext-2" / "test.txt").read_text()[:20000]
    common = dict(kv_format="oaken", attention="magicpig", lsh_min_context=256, lsh_window=32,
                  kv_cache_bytes=2 * 2**30, max_num_seqs=8, max_num_batched_tokens=128)

    def run(cfg: ServeConfig) -> tuple[list[str], int]:
        server = RunningServer(cfg)
        try:
            def ask(i):
                body = {"prompt": text[i * 2500:i * 2500 + 1400], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
                assert r.status_code == 200, r.text
                # past lsh_min_context: sampled attention on MagicPIG's layers
                assert r.json()["usage"]["prompt_tokens"] > 300 and r.json()["usage"]["completion_tokens"] == 24
                return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            alone = [ask(i) for i in (0, 1, 2, 0)]  # the last from the prefix cache (its key center sent back)
            assert [c > 300 for _, c in alone] == [False, False, False, True]
            with ThreadPoolExecutor(6) as pool:
                list(pool.map(ask, range(6)))
            assert server.engine.blocks.used_bytes == 0
            timings = server.engine.last_step_timings  # MagicPIG's exact layers' share, from the actors too
            assert 0 < timings.cpu_attn_dense_s < timings.cpu_attn_s
            return alone, server.engine.scheduler.num_preemptions
        finally:
            server.close()

    local, _ = run(ServeConfig(**common))
    on_ray, preemptions = run(ServeConfig(executor="ray", ray_cpu_actors=2, **common))
    assert preemptions == 0  # a CPU actor that crashed would have sent its sequences back for recompute
    assert on_ray == local
