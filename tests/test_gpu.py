"""The CUDA path: linear layers on the GPU, attention and KV on the CPU. Skipped without CUDA."""
import pytest
import torch

from tests.test_model import PROMPTS_TINY, greedy_through_backend, hf_greedy, tiny_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_fp32_matches_hf(tmp_path):
    model_dir, hf = tiny_model_dir(tmp_path, tie_word_embeddings=False)
    ours = greedy_through_backend(model_dir, PROMPTS_TINY, num_new=10, device="cuda", dtype="float32")
    assert ours == [hf_greedy(hf, p, 10) for p in PROMPTS_TINY]


def test_cuda_bf16_agrees_with_fp32_on_most_tokens(tmp_path):
    model_dir, _ = tiny_model_dir(tmp_path, tie_word_embeddings=True)
    fp32 = greedy_through_backend(model_dir, PROMPTS_TINY, num_new=10, device="cuda", dtype="float32")
    bf16 = greedy_through_backend(model_dir, PROMPTS_TINY, num_new=10, device="cuda", dtype="bfloat16")
    first_tokens_equal = sum(a[0] == b[0] for a, b in zip(fp32, bf16))
    assert first_tokens_equal >= 2, (fp32, bf16)


def test_cuda_mx_weights_stay_packed_on_the_gpu(tmp_path):
    """--weight-format mxfp6 on CUDA: the linears stay packed in GPU memory (6.25 bits a weight, the dense copies
    dropped) and are decoded per call; greedy tokens agree with the CPU's MX kernels on most first tokens."""
    from gpu_model.loader import load_model
    from gpu_model.model import LINEARS
    from gpu_model.weight_format import WeightFormat, weight_bits

    model_dir, _ = tiny_model_dir(tmp_path, tie_word_embeddings=True)
    model = load_model(model_dir, device="cuda", dtype=torch.bfloat16, weight_format=WeightFormat("mxfp6"),
                       cache_dir=tmp_path)
    assert all(getattr(layer, name).weight.is_meta for layer in model.layers for name in LINEARS)
    assert weight_bits(model) == 6.25 and model.quant["layers.0.qkv"].codes.is_cuda
    args = dict(num_new=10, weight_format="mxfp6", model_cache_dir=str(tmp_path))
    cpu = greedy_through_backend(model_dir, PROMPTS_TINY, **args)
    cuda = greedy_through_backend(model_dir, PROMPTS_TINY, device="cuda", dtype="bfloat16", **args)
    assert [len(t) for t in cuda] == [10] * len(PROMPTS_TINY)
    assert sum(a[0] == b[0] for a, b in zip(cpu, cuda)) >= 2, (cpu, cuda)


def test_cuda_magicpig_hashes_on_the_gpu_through_prefill_and_decode(tmp_path):
    """MagicPIG's codes made on the GPU: prefill-only steps (no decode rows to hash) and sampled decode.
    The first token comes from exact prefill attention and must match the CPU's; later ones may
    differ where a projection's sign differs between the two devices' sums."""
    from cpu_attn.magicpig import LshConfig

    model_dir, _ = tiny_model_dir(tmp_path)
    lsh = LshConfig(l=20, sinks=1, window=2, dense_layers=(0,), min_context=4, min_collisions=2)
    cpu, cuda = (greedy_through_backend(model_dir, PROMPTS_TINY, num_new=10, device=d, lsh=lsh)
                 for d in ("cpu", "cuda"))
    assert [len(t) for t in cuda] == [10] * len(PROMPTS_TINY)
    assert [t[0] for t in cuda] == [t[0] for t in cpu]


def test_cuda_device_attention_matches_the_cpu_worker():
    """Partial offload's accelerator-side attention (bf16 KV on the GPU) against the CPU worker (fp32 store) on
    the same rows: a two-chunk prompt beside another sequence's decodes, then decode steps."""
    from gpu_model.device_attn import DeviceAttentionWorker
    from tests.test_offload import BLOCKS, compare_with_cpu_worker

    dev = DeviceAttentionWorker(2, 2, 64, 16, BLOCKS, "cuda", torch.bfloat16)
    compare_with_cpu_worker(dev, 8, (40, 33), 30, 4, 0.05, 0.03)   # bf16 KV


@pytest.mark.parametrize("gpu_kv_dtype, executor, cpu_actors", [("auto", "local", 0), ("fp8", "local", 0),
                                                                ("auto", "ray", 0), ("auto", "ray", 2)])
def test_serve_on_cuda_offloads_by_default(gpu_kv_dtype, executor, cpu_actors):
    """`hetserve serve` with the linears on the GPU and --gpu-kv-cache-bytes unset: the GPU's free memory after the model
    (less the activations' reserve) becomes its KV pool, sequences go there first, and the GPU attends them (bf16
    values, or fp8 with --gpu-kv-dtype fp8); on Ray in the backend actor, or in the model actor beside CPU attention
    actors."""
    if executor == "ray":
        pytest.importorskip("ray")
    from server.config import ServeConfig
    from tests.conftest import RunningServer
    from tests.test_preemption import complete

    server = RunningServer(ServeConfig(kv_cache_bytes=256 * 2**20, gpu_kv_dtype=gpu_kv_dtype, executor=executor,
                                       ray_cpu_actors=cpu_actors))
    try:
        spec = server.engine.blocks.spec
        assert spec.first_fit and spec.shards[0] > 0
        assert complete(server.url, 1)
        step = server.engine.metrics.step
        seconds = {s.labels["part"]: s.value for m in step.collect() for s in m.samples if s.name.endswith("_sum")}
        assert seconds["gpu_attn"] > 0
    finally:
        server.close()
