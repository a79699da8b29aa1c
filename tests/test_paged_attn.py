"""The accelerator's paged decode kernel (gpu_model/paged_attn.py) against plain NumPy attention, run by Triton's
interpreter on the CPU, compiled where CUDA is (the same kernel source)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # Triton's interpreter runs the kernels on CPU tensors; read when triton loads
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was loaded before TRITON_INTERPRET could be set", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import gpu_model.paged_attn as paged  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    """Plain attention in float64: row r over positions 0 .. lens[r] - 1 of its blocks."""
    rows, hq, d = q.shape
    group = hq // k_cache.shape[0]
    out = np.zeros((rows, hq, d))
    for r in range(rows):
        pos = np.arange(lens[r])
        slots = tables[r][pos // block_size] * block_size + pos % block_size
        for h in range(hq):
            k, v = k_cache[h // group, slots], v_cache[h // group, slots]
            s = k @ q[r, h] * scale
            p = np.exp(s - s.max())
            out[r, h] = p @ v / p.sum()
    return out.reshape(rows, hq * d)


def case(rng, rows_lens, hq, hkv, d, block_size, store):
    """Random q and a paged cache with each row's blocks shuffled among all blocks; store: float32, bf16 or fp8
    (uint8 bytes of float8 e4m3) -> the kernel's inputs and their float64 values."""
    blocks = [-(-n // block_size) for n in rows_lens]
    perm = rng.permutation(sum(blocks) + 3)
    tables = np.zeros((len(rows_lens), max(blocks)), np.int32)
    at = 0
    for r, b in enumerate(blocks):
        tables[r, :b] = perm[at:at + b]
        at += b
    slots = (sum(blocks) + 3) * block_size
    k = torch.from_numpy(rng.normal(0, 1, (hkv, slots, d)).astype(np.float32))
    v = torch.from_numpy(rng.normal(0, 1, (hkv, slots, d)).astype(np.float32))
    q = torch.from_numpy(rng.normal(0, 1, (len(rows_lens), hq, d)).astype(np.float32))
    if store == "fp8":
        k, v = (x.to(torch.float8_e4m3fn) for x in (k, v))
        values = [x.float().double().numpy() for x in (q, k, v)]
        k, v = k.view(torch.uint8), v.view(torch.uint8)
        q = q.to(torch.bfloat16)
        values[0] = q.double().numpy()
    elif store == "bf16":
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        values = [x.double().numpy() for x in (q, k, v)]
    else:
        values = [x.double().numpy() for x in (q, k, v)]
    return (q, k, v, torch.from_numpy(tables), torch.tensor(rows_lens, dtype=torch.int32)), values, tables


@pytest.mark.parametrize("rows_lens, hq, hkv, d, block_size, splits, store, tol", [
    ([1, 37, 200], 4, 2, 64, 16, 1, "float32", 1e-5),
    ([1, 37, 200], 4, 2, 64, 16, 3, "float32", 1e-5),   # the first row's later splits hold nothing
    ([130, 5], 8, 2, 128, 32, 2, "float32", 1e-5),       # GQA group 4, head dim 128
    ([70, 64, 65], 2, 2, 32, 1, 4, "float32", 1e-5),     # one token a block, no GQA
    ([90, 300], 4, 1, 64, 16, 3, "bf16", 2e-2),
    ([90, 300], 4, 1, 64, 16, 3, "fp8", 2e-2),
])
def test_paged_decode_matches_numpy_attention(rows_lens, hq, hkv, d, block_size, splits, store, tol):
    rng = np.random.default_rng(len(rows_lens) * 100 + d + splits)
    args, (qv, kv, vv), tables = case(rng, rows_lens, hq, hkv, d, block_size, store)
    scale = d**-0.5
    args = [x.to(DEV) for x in args]
    out = paged.paged_decode(*args, max_len=max(rows_lens), block_size=block_size, scale=scale, splits=splits).cpu()
    assert out.dtype == args[0].dtype and out.shape == (len(rows_lens), hq * d)
    ref = reference(qv, kv, vv, tables, rows_lens, block_size, scale)
    assert np.abs(out.double().numpy() - ref).max() < tol


def test_paged_decode_refuses_what_it_cannot_take():
    q = torch.zeros((1, 4, 48))
    cache = torch.zeros((2, 16, 48))
    q, cache = q.to(DEV), cache.to(DEV)
    with pytest.raises(ValueError, match="head dims"):
        paged.paged_decode(q, cache, cache, torch.zeros((1, 1), dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                           1, 16, 1.0, 1)


@pytest.mark.parametrize("store", ["float32", "fp8"])
def test_device_worker_with_the_kernel_matches_the_cpu_worker(store):
    """DeviceAttentionWorker with decode_kernel: decode rows by the kernel, a prompt chunk beside them by SDPA, in
    the same steps as the worker test of tests/test_offload.py, against the CPU worker over the same values."""
    from gpu_model.device_attn import FP8, DeviceAttentionWorker
    from tests.test_offload import BLOCKS, BS, D, HKV, HQ, LAYERS, compare_with_cpu_worker

    dtype = FP8 if store == "fp8" else torch.float32
    dev = DeviceAttentionWorker(LAYERS, HKV, D, BS, BLOCKS, DEV, dtype, decode_kernel=True)
    rounded = (lambda x: x.clamp(-448, 448).to(FP8).float()) if store == "fp8" else (lambda x: x)
    compare_with_cpu_worker(dev, HQ, (7, 6), 5, 5, 1e-5, 1e-5, stored=rounded)
