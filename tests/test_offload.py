"""Partial offload (--gpu-kv-cache-bytes) on the CPU: the accelerator-side attention worker against
the CPU worker, first-fit placement and the guard, and the whole server with sequences in both pools
giving the same greedy text as with every sequence on the host. No speed is claimed on a CPU."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cpu_attn.kv_store import PagedKVStore
from cpu_attn.worker import AttentionWorker, ChunkLayout
from gpu_model.device_attn import DeviceAttentionWorker
from hetcore.backend import KVSpec
from server.block_manager import BlockManager
from server.config import ServeConfig, offload_runs
from benchmarks.bench_gpu_offload import SHAPES, random_model
from hetcore.backend import KVCapacityError
from server.backend_config import BackendConfig
from server.offload import OffloadBackend, OffloadGuard, device_kv_budget
from tests.conftest import RunningServer
from tests.test_preemption import BYTES_PER_BLOCK_FP32, complete

LAYERS, HKV, HQ, D, BS, BLOCKS = 2, 2, 4, 16, 4, 32


def compare_with_cpu_worker(dev: DeviceAttentionWorker, num_q_heads: int, prompt: tuple[int, int], other: int,
                            decodes: int, rtol: float, atol: float, stored=lambda x: x) -> None:
    """A prompt of prompt[0] + prompt[1] tokens in two chunks beside another sequence's prompt of `other` tokens and
    its first decode, then `decodes` decode steps of both, one sequence on consecutive blocks (a view) and one on
    scattered ones: every layer's output of `dev` against the CPU worker's over an fp32 store, within rtol, atol.
    `stored`: the values `dev` keeps of k and v (the CPU worker is given those)."""
    num_layers, num_kv_heads, _, head_dim = dev.k_cache.shape
    cpu = AttentionWorker(PagedKVStore(num_layers, num_kv_heads, head_dim, dev.block_size, BLOCKS, "float32"), head_dim)
    g = torch.Generator().manual_seed(0)
    first, second = prompt
    tables = {0: tuple(range(0, 8)), 1: (20, 9, 31, 8, 12, 3, 27, 15)}
    steps = [[ChunkLayout(first, 0, tables[0], 0), ChunkLayout(other, 0, tables[1], 1)],
             [ChunkLayout(second, first, tables[0], 0), ChunkLayout(1, other, tables[1], 1)]]
    steps += [[ChunkLayout(1, first + second + i, tables[0], 0), ChunkLayout(1, other + 1 + i, tables[1], 1)]
              for i in range(decodes)]
    device = dev.k_cache.device
    for layouts in steps:
        rows = sum(c.num_tokens for c in layouts)
        cpu.begin_step(layouts)
        dev.begin_step(layouts)
        for layer in range(num_layers):
            q, k, v = (torch.randn(rows, h, head_dim, generator=g) for h in (num_q_heads, num_kv_heads, num_kv_heads))
            want = cpu.attend(layer, q, stored(k), stored(v))
            got = dev.attend(layer, q.to(device), k.to(device), v.to(device)).float().cpu()
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_device_worker_matches_the_cpu_worker_over_prefill_and_decode_steps():
    """The torch worker equals the CPU worker (exact fp32 stores) to fp32 rounding."""
    compare_with_cpu_worker(DeviceAttentionWorker(LAYERS, HKV, D, BS, BLOCKS, "cpu", torch.float32), HQ, (7, 6), 5, 5,
                            1e-5, 1e-5)


def test_fp8_device_store_attends_the_rounded_values_exactly():
    """An fp8 store (--gpu-kv-dtype fp8) keeps each k, v value as float8 e4m3 (clamped to +-448): its attention equals
    the exact fp32 attention over those rounded values, and a block takes a quarter of the fp32 bytes."""
    from gpu_model.device_attn import FP8

    def rounded(x):
        return x.clamp(-448, 448).to(FP8).float()

    dev = DeviceAttentionWorker(LAYERS, HKV, D, BS, BLOCKS, "cpu", FP8)
    assert dev.k_cache.dtype == FP8
    compare_with_cpu_worker(dev, HQ, (7, 6), 5, 5, 1e-5, 1e-5, stored=rounded)
    assert (DeviceAttentionWorker.bytes_per_block(LAYERS, HKV, D, BS, FP8) * 4
            == DeviceAttentionWorker.bytes_per_block(LAYERS, HKV, D, BS, torch.float32))
    x = torch.tensor([[[1000.0, -1000.0, 0.1]]])
    assert rounded(x).tolist() == [[[448.0, -448.0, 0.1015625]]]


def test_first_fit_places_on_the_first_shard_with_room_and_respects_open_shards():
    spec = KVSpec(block_size=4, num_blocks=12, bytes_per_block=1, shards=(4, 8), first_fit=True)
    blocks = BlockManager(spec)
    assert blocks.allocate(1, 12) and blocks.shard_of(1) == 0  # 3 blocks on the accelerator's pool
    blocks.allocate(2, 8)
    assert blocks.shard_of(2) == 1  # 2 blocks: 1 left on shard 0, so the host's
    blocks.allocate(3, 4)
    assert blocks.shard_of(3) == 0  # 1 block: fits the accelerator's last one
    blocks.open = {0}
    assert not blocks.can_hold(4, 8)  # shard 0 full, shard 1 closed to new sequences
    assert blocks.can_hold(2, 16)  # a sequence already on the closed shard keeps growing there
    blocks.open = {0, 1}
    assert blocks.can_hold(4, 8)


def test_first_fit_places_a_prompt_by_its_whole_length():
    """A prompt whose first chunk fits the accelerator's pool but whose whole length does not goes to the host's, and
    its first allocation follows that choice."""
    spec = KVSpec(block_size=4, num_blocks=12, bytes_per_block=1, shards=(4, 8), first_fit=True)
    blocks = BlockManager(spec)
    assert blocks.can_hold(1, 8, place_tokens=24)  # a 2-block chunk of a 6-block prompt
    blocks.allocate(1, 8)
    assert blocks.shard_of(1) == 1
    assert blocks.can_hold(2, 8, place_tokens=16)  # 4 blocks: the accelerator's pool holds it whole
    blocks.allocate(2, 8)
    assert blocks.shard_of(2) == 0


def test_a_sequence_moves_to_the_accelerators_pool_once_it_has_room():
    """move: a host-placed table becomes as many blocks of the accelerator's pool; the host blocks go free, or stay
    cached (idle) where registered, and the next allocation grows the new table."""
    spec = KVSpec(block_size=4, num_blocks=12, bytes_per_block=1, shards=(4, 8), first_fit=True, promote_to=0)
    blocks = BlockManager(spec)
    blocks.allocate(1, 12)  # 3 blocks on the accelerator's pool
    old = blocks.allocate(2, 8)  # 2 blocks: only 1 left there, so on the host's
    blocks.register(2, [b"k0"])
    blocks.commit()
    assert blocks.shard_of(2) == 1 and not blocks.can_move(2, 0)
    blocks.free(1)
    assert blocks.can_move(2, 0, spare=2) and not blocks.can_move(2, 0, spare=3)
    src, dst = blocks.move(2, 0)
    assert src == old and blocks.shard_of(2) == 0 and all(b < 4 for b in dst) and blocks.table(2) == dst
    assert len(blocks._free[1]) == 7 and list(blocks._idle[1]) == [old[0]]  # the registered block stays cached
    assert blocks.allocate(2, 12)[:2] == dst and blocks.shard_of(2) == 0
    blocks.free(2)
    assert blocks.num_free_blocks == 12


def test_scheduler_moves_a_decoding_host_sequence_when_no_request_waits():
    from server.scheduler import SchedulerConfig, Scheduler, Sequence
    from hetcore.backend import SamplingParams, StepOutput

    spec = KVSpec(block_size=4, num_blocks=12, bytes_per_block=1, shards=(4, 8), first_fit=True, promote_to=0)
    s = Scheduler(SchedulerConfig(8, 64, False), BlockManager(spec))
    greedy = SamplingParams(temperature=0.0)
    short, long = Sequence(0, list(range(10)), greedy), Sequence(1, list(range(20, 30)), greedy)
    for seq in (short, long):
        s.add(seq)
    s.schedule()  # both prompts: 3 blocks each, the first on the accelerator's pool, the second on the host's
    assert s.blocks.shard_of(0) == 0 and s.blocks.shard_of(1) == 1
    s.update(StepOutput(sampled={0: 1, 1: 1}))
    assert not s.schedule().moves  # no room there yet
    s.update(StepOutput(sampled={0: 1, 1: 1}))
    s.finish(short)
    inp = s.schedule()
    (move,) = inp.moves
    assert move.seq_id == 1 and move.num_tokens == 11 and len(move.src_table) == 3 and all(b >= 4 for b in move.src_table)
    (chunk,) = inp.chunks
    assert chunk.block_table == move.dst_table and all(b < 4 for b in move.dst_table) and s.num_moves == 1


def test_guard_without_a_reference_closes_while_host_attention_outlasts_the_accelerator():
    """No step of these accelerator rows alone yet: host attention must hide behind the accelerator's work."""
    guard = OffloadGuard(window=4, reopen=0.8)
    for _ in range(4):
        guard.observe(2, 1, 0.025, 0.010, 0.020)
    assert guard.is_open
    for _ in range(4):
        guard.observe(2, 1, 0.045, 0.040, 0.020)
    assert not guard.is_open
    for _ in range(3):
        guard.observe(2, 1, 0.025, 0.017, 0.020)
    assert not guard.is_open  # 0.85 of the accelerator's time: not yet
    guard.observe(2, 1, 0.021, 0.001, 0.020)
    assert guard.is_open


def test_guard_closes_when_host_rows_slow_the_accelerator_rows_more_than_they_add():
    """Against the accelerator's rows alone (the fastest of their last decode steps): 4 rows alone in 20 ms, so 4 + 1
    rows pay up to 25 ms a step, whatever the host's own attention took."""
    guard = OffloadGuard(window=4, reopen=0.8)
    guard.observe(4, 0, 0.900, 0.0, 0.900)  # a step that compiled a kernel is not the reference
    guard.observe(4, 0, 0.020, 0.0, 0.020)
    guard.observe(4, 0, 0.100, 0.0, 0.020, is_decode=False)  # a prompt chunk in the step: not a reference
    assert min(guard.alone[4]) == 0.020 and 0.100 not in guard.alone[4]
    for _ in range(4):
        guard.observe(4, 1, 0.024, 0.010, 0.022)
    assert guard.is_open
    for _ in range(4):  # the host's attention (10 ms) hides behind the accelerator's (36 ms), yet the step lost
        guard.observe(4, 1, 0.040, 0.010, 0.036)
    assert not guard.is_open
    for _ in range(4):
        guard.observe(4, 1, 0.024, 0.010, 0.022)
    assert not guard.is_open  # 0.96 of 25 ms: not yet
    for _ in range(4):
        guard.observe(4, 1, 0.019, 0.010, 0.018)
    assert guard.is_open
    guard.observe(0, 3, 5.0, 5.0, 0.001)  # host rows alone: all the work there is, not judged
    assert guard.is_open and len(guard.steps) == 4


def test_offload_server_gives_the_host_only_greedy_text(server):
    """Eight requests at once with room for about two on the accelerator's pool: some run there, the rest on
    the host, every step attends both; greedy text equals the all-host server's (fp32 KV and linears)."""
    reference = [complete(server.url, i) for i in range(8)]
    cfg = ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, cpu_linear_dtype="float32",
                      gpu_kv_cache_bytes=10 * BYTES_PER_BLOCK_FP32)
    offload = RunningServer(cfg)
    try:
        spec = offload.engine.blocks.spec
        assert spec.shards[0] == 10 and spec.first_fit
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda i: complete(offload.url, i), range(8)))
        assert texts == reference
        assert offload.engine.blocks.used_bytes == 0
        step = offload.engine.metrics.step
        seconds = {s.labels["part"]: s.value for m in step.collect() for s in m.samples if s.name.endswith("_sum")}
        assert seconds["gpu_attn"] > 0 and seconds["cpu_attn"] > 0  # both pools attended
    finally:
        offload.close()


@pytest.mark.parametrize("executor, cpu_actors", [("local", 0), pytest.param("ray", 0, marks=pytest.mark.slow),
                                                   ("ray", 2)])
def test_host_sequences_move_to_the_accelerator_with_the_same_greedy_text(server, executor, cpu_actors):
    """Two short requests fill the accelerator's pool (4-block prompts, 11 blocks), four long ones that come while they
    run go to the host's; as the short ones end, host-placed ones move there (their KV copied) and finish there, with
    the all-host server's greedy text. On Ray the pools sit in the one backend actor, or the accelerator's in the
    model actor (shard 0) and the host's in two CPU attention actors (shards 1 and 2, which the moves gather from);
    the actor says after each step which shards are open."""
    if executor == "ray":
        pytest.importorskip("ray")
    import time

    import httpx

    def text(url, i):
        body = {"prompt": f"Request {i}. " + "Tell me about the history of the number seven. " * 5,
                "max_tokens": 8 if i < 2 else 40, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        assert 48 < r.json()["usage"]["prompt_tokens"] <= 64  # 4 blocks of 16
        return r.json()["choices"][0]["text"]

    reference = [text(server.url, i) for i in range(6)]
    offload = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, cpu_linear_dtype="float32",
                                        gpu_kv_cache_bytes=11 * BYTES_PER_BLOCK_FP32, executor=executor,
                                        ray_cpu_actors=cpu_actors, ray_microbatches=2))
    try:
        spec = offload.engine.blocks.spec
        assert spec.promote_to == 0 and spec.shards[0] == 11 and len(spec.shards) == 1 + max(1, cpu_actors)
        assert offload.engine.backend.live_shards() == offload.engine.backend.open_shards() == set(range(len(spec.shards)))
        with ThreadPoolExecutor(6) as pool:
            short = [pool.submit(text, offload.url, i) for i in range(2)]
            while len(offload.engine.scheduler.running) < 2 and not all(f.done() for f in short):
                time.sleep(0.002)
            long = [pool.submit(text, offload.url, i) for i in range(2, 6)]
            assert [f.result() for f in short + long] == reference
        assert offload.engine.scheduler.num_moves >= 1
        assert offload.engine.blocks.used_bytes == 0
        step = offload.engine.metrics.step
        seconds = {s.labels["part"]: s.value for m in step.collect() for s in m.samples if s.name.endswith("_sum")}
        assert seconds["gpu_attn"] > 0 and seconds["cpu_attn"] > 0  # both pools attended
    finally:
        offload.close()


def test_offload_server_with_fp8_accelerator_kv():
    """--gpu-kv-dtype fp8: the accelerator's pool holds twice the blocks of the same bytes as bf16 (four times fp32's)
    and serves requests beside the host's (text close to, not always equal to, the fp32 server's)."""
    cfg = ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, cpu_linear_dtype="float32",
                      gpu_kv_cache_bytes=10 * BYTES_PER_BLOCK_FP32, gpu_kv_dtype="fp8")
    offload = RunningServer(cfg)
    try:
        assert offload.engine.blocks.spec.shards[0] == 40  # fp32 blocks' bytes hold 4x the fp8 blocks
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda i: complete(offload.url, i), range(4)))
        assert all(texts)
        step = offload.engine.metrics.step
        seconds = {s.labels["part"]: s.value for m in step.collect() for s in m.samples if s.name.endswith("_sum")}
        assert seconds["gpu_attn"] > 0
    finally:
        offload.close()


def test_offload_is_refused_beside_what_it_cannot_serve():
    with pytest.raises(ValueError, match="gpu_kv_cache_bytes needs"):
        ServeConfig(gpu_kv_cache_bytes=2**20, speculative_method="ngram")
    with pytest.raises(ValueError, match="gpu_kv_dtype fp8 is for partial offload"):
        ServeConfig(gpu_kv_cache_bytes=0, gpu_kv_dtype="fp8")
    with pytest.raises(ValueError, match="gpu_kv_dtype must be one of auto, fp8"):
        ServeConfig(gpu_kv_dtype="fp4")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pass gpu_kv_cache_bytes, or serve on a CUDA device"):
            ServeConfig(gpu_kv_dtype="fp8")


def test_gpu_hosts_offload_by_default_within_what_is_free():
    """Unset, gpu_kv_cache_bytes is the CUDA device's free memory after the model less a tenth of it (at least 2 GiB)
    for activations; 0 turns offload off; where offload cannot serve a configuration, unset means none (no error)."""
    gib = 2**30
    assert device_kv_budget(free=100 * gib, total=140 * gib) == 86 * gib
    assert device_kv_budget(free=10 * gib, total=16 * gib) == 8 * gib  # the 2 GiB floor
    assert device_kv_budget(free=gib, total=16 * gib) == 0
    assert ServeConfig().offload_possible and ServeConfig(gpu_kv_cache_bytes=0).gpu_kv_cache_bytes == 0
    assert ServeConfig(executor="ray").offload_possible and ServeConfig(executor="ray", ray_cpu_actors=2).offload_possible
    assert not ServeConfig(speculative_method="ngram").offload_possible
    assert not ServeConfig(device="cpu").offload_by_default
    assert not ServeConfig(gpu_kv_cache_bytes=0).offload_by_default
    assert ServeConfig().offload_by_default == torch.cuda.is_available()
    # where the backend is built (the server's process, or Ray's backend actor on its node) the same rule decides
    assert [offload_runs(b, d, cuda) for b, d, cuda in ((None, "auto", True), (None, "cuda", True), (None, "cpu", True),
                                                          (None, "auto", False), (0, "cuda", True), (5, "cpu", False))] \
        == [True, True, False, False, False, True]
    assert BackendConfig.from_serve_config(ServeConfig(speculative_method="ngram")).gpu_kv_cache_bytes == 0
    assert BackendConfig.from_serve_config(ServeConfig(executor="ray")).gpu_kv_cache_bytes is None


def test_an_unsized_offload_on_the_cpu_is_refused_in_one_line():
    cfg = ServeConfig(kv_format="fp32", kv_cache_bytes=64 * 2**20, cpu_linear_dtype="float32")
    with pytest.raises(KVCapacityError, match="needs --gpu-kv-cache-bytes"):
        OffloadBackend(None, BackendConfig.from_serve_config(cfg), model=random_model(SHAPES["tiny"], "cpu", torch.float32))
