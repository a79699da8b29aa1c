"""The GPU offload benchmark (benchmarks/bench_gpu_offload.py), run end to end on the CPU at
a tiny shape: the same code a CUDA machine runs, with real Oaken + MagicPIG decoding on the
hetserve side and the device-resident KV loop on the other."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch


def test_gpu_offload_benchmark_smoke_run_on_cpu(tmp_path):
    from benchmarks import bench_gpu_offload as bench

    out = tmp_path / "offload.json"
    result = bench.main(["--shape", "tiny", "--device", "cpu", "--context", "1536", "--batch", "1", "2",
                         "--steps", "3", "--calibration-windows", "2", "--max-gpu-batch", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert out.with_suffix(".png").stat().st_size > 0
    (row,) = result["rows"]
    assert [h["concurrency"] for h in row["hetserve"]] == [1, 2] and row["skipped_batches"] == []
    assert all(h["decode_tok_s"] > 0 and h["num_steps"] == 3 for h in row["hetserve"])
    assert 0 < row["keys_touched_frac"] < 1  # the sampled layers sampled
    assert row["gpu_only"]["batch"] == 2 and row["gpu_only"]["decode_tok_s"] > 0
    assert row["ratio"] == max(h["decode_tok_s"] for h in row["hetserve"]) / row["gpu_only"]["decode_tok_s"]


def test_gpu_prefill_fills_the_store_as_the_cpu_prefill_does(tmp_path):
    """The benchmark's device prefill (SDPA, K/V appended layer by layer) leaves the same KV in the
    store and samples the same first token as the backend's own prefill step."""
    from benchmarks import bench_gpu_offload as bench
    from benchmarks.e2e.decode_only import prefill_one
    from cpu_attn.magicpig import LshConfig

    model = bench.random_model(bench.SHAPES["tiny"], "cpu", torch.float32)
    thresholds = tmp_path / "thr.json"
    windows = np.random.default_rng(0).integers(0, 2048, (2, 256)).tolist()
    bench.calibrate(model, windows, context_tokens=2048, progress=False).save(thresholds)
    prompt = np.random.default_rng(1).integers(0, 2048, 1200).tolist()
    blocks = tuple(range(75))
    stores, firsts = [], []
    for prefill in (prefill_one, bench.gpu_prefill):
        backend = bench.hetserve_backend(model, thresholds, 1200, 4, 1, LshConfig())
        firsts.append(prefill(backend, prompt, blocks))
        stores.append(backend.attn_worker.store)
    assert firsts[0] == firsts[1]
    for layer in range(model.cfg.num_layers):
        (k1, v1), (k2, v2) = (s.gather(layer, blocks, 1200) for s in stores)
        if layer == 0:  # the same inputs: the same codes
            assert np.array_equal(k1, k2) and np.array_equal(v1, v2)
        # later layers see SDPA's rounding instead of the CPU prefill's: a rare value lands one
        # quantization step away
        assert np.mean(np.abs(k1 - k2) > 1e-3) < 0.01 and np.mean(np.abs(v1 - v2) > 1e-3) < 0.01


@pytest.mark.slow  # tests/test_offload.py runs the backend itself in the default suite
@pytest.mark.parametrize("gpu_kv_dtype", ["auto", "fp8"])
def test_gpu_offload_benchmark_offload_mode_smoke_run_on_cpu(tmp_path, gpu_kv_dtype):
    """The partial-offload cells: GPU-only at the batch each accelerator KV budget holds, and hetserve with that
    budget (fp8: more sequences in it) plus host sequences (Oaken + MagicPIG), on the CPU at a tiny shape."""
    from benchmarks import bench_gpu_offload as bench

    out = tmp_path / "offload.json"
    result = bench.main(["--shape", "tiny", "--device", "cpu", "--context", "1536", "--modes", "offload",
                         "--gpu-kv-gb", "0.008", "0.0001", "--host-extra", "0", "2", "--steps", "3",
                         "--calibration-windows", "2", "--max-gpu-batch", "4", "--gpu-kv-dtype", gpu_kv_dtype,
                         "--out", str(out)])
    assert result["rows"] == [] and out.with_name("offload_offload.png").stat().st_size > 0
    (cell,) = result["offload"]
    fits, too_small = cell["budgets"]
    assert "no room" in too_small["note"]
    assert fits["gpu_only"]["batch"] == 1 and [r["host_seqs"] for r in fits["offload"]] == [0, 2]
    for r in fits["offload"]:
        assert r["gpu_seqs"] == 1 if gpu_kv_dtype == "auto" else r["gpu_seqs"] > 1  # fp8: a quarter of fp32's bytes
        assert r["decode_tok_s"] > 0 and r["parts_ms"]["gpu_attn"] > 0
        assert (r["parts_ms"]["cpu_attn"] > 0) == (r["host_seqs"] > 0)
    assert fits["chosen_host_seqs"] in (0, 2) and fits["ratio"] > 0
    if gpu_kv_dtype == "fp8":  # hetserve's own pool in the model's dtype at GPU-only's batch
        assert fits["own_pool"]["gpu_seqs"] == 1 and fits["own_pool"]["host_seqs"] == 0 and fits["ratio_own_pool"] > 0
    else:
        assert fits["own_pool"] is None and fits["ratio_own_pool"] is None
