"""Long-context decode with the linears on a GPU and Oaken KV + MagicPIG on the host CPUs
(hetserve's split) against GPU-only attention: bf16 KV on the GPU, torch SDPA, at the largest
batch that fits (needs a CUDA device, never runs in CI).

    python -m benchmarks.bench_gpu_offload --context 32768 65536 98304 --batch 4 8 16 --steps 16 \
        --gpu-kv-gb 0 48 24 --host-extra 0 4 8

Two modes (`--modes`). all-host: every sequence's attention on the host CPUs (`--batch` sequences).
offload: partial offload (`--gpu-kv-cache-bytes`, server/offload.py): per accelerator KV budget
(`--gpu-kv-gb`; 0 = what is free, smaller ones emulate a smaller GPU, as MagicPIG did), GPU-only at the
batch that budget holds, against hetserve with the same budget plus `--host-extra` sequences on the
host; the split the backend's guard keeps open with the most tok/s is the one it would choose, and its
ratio to GPU-only is the cell's result. Step parts: gpu_attn (the accelerator's attention as the host
saw it), cpu_attn (host attention, overlapped), accelerator (everything outside the waits).

The model is Llama-3.1-8B-shaped with random weights (`--shape tiny` is a small shape for a CPU
smoke run). GPU-only decode costs the same whatever the weights and KV hold (dense attention reads
every key), so its cache is filled with random values. hetserve's does depend on the data: the
share of keys MagicPIG samples follows the keys' geometry, so it is reported (`keys_touched_frac`;
SmolLM2 on real text: ~6.4 % at 8k, README) and random weights are not a claim about a trained
model's sampling rate.

Per context: the Oaken thresholds are calibrated on the random model, one prompt of random tokens
is prefilled on the GPU (SDPA, causal) and its K, V and key codes go to hetserve's CPU store and
tables, then every batch size decodes from per-sequence copies of them
(`benchmarks.e2e.decode_only.run --distinct`). A batch size whose KV and tables would not fit in
host memory is skipped, with a note. The GPU-only side then takes the largest batch whose bf16
KV fits beside the weights (`--gpu-reserve-gb` kept free for activations).
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS, machine, print_table
from benchmarks.e2e.decode_only import run as decode_run
from cpu_attn.calibrate import calibrate
from cpu_attn.kv_store import OakenKVStore
from cpu_attn.magicpig import LshConfig
from cpu_attn.worker import ChunkLayout
from gpu_model.config import ModelConfig
from gpu_model.device_attn import DeviceAttentionWorker, store_dtype
from gpu_model.model import LlamaModel, rope_inv_freq
from hetcore.backend import SamplingParams, SeqChunk, StepInput
from server.hetero import kv_capacity_for

SHAPES = {
    "llama-3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                                rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                              ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
                                max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
                                eos_token_ids=(128001, 128008, 128009)),
    "tiny": ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=64, max_position_embeddings=131072),
}
BLOCK_SIZE = 16


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    """A LlamaModel of shape `cfg` with N(0, 0.02) weights and unit norms, made on `device` in `dtype`."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        model.inv_freq.copy_(rope_inv_freq(cfg))
    return model.eval().requires_grad_(False)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """q [B, Hq, T, D], k, v [B, Hkv, S, D] -> [B, T, Hq * D] with SDPA. Decode (not causal) reads
    the cache as it is (enable_gqa: FlashAttention on CUDA); the causal prefill repeats the kv-heads
    once per prompt instead, which every fused backend takes (one that does not take GQA would fall
    back to materializing the S x S scores)."""
    if is_causal:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return o.transpose(1, 2).flatten(2)


@torch.inference_mode()
def gpu_prefill(backend, prompt: list[int], blocks: tuple[int, ...]) -> int:
    """decode_only's `prefill`: sequence 0's prompt through the model on its device with SDPA; each
    layer's K, V and key codes are appended to the backend's CPU store and MagicPIG tables (no
    attention on the CPU: a 64k-token causal prefill there would take tens of minutes)."""
    model, coder, attn = backend.model, backend.model_worker.lsh, backend.attn_worker
    dev, n = model.device, len(prompt)
    attn.begin_step([ChunkLayout(n, 0, blocks, 0)])
    x = model.embed(torch.tensor(prompt, device=dev))
    cos, sin = model.rope(torch.arange(n, device=dev))
    t0, num_layers = time.perf_counter(), model.cfg.num_layers
    for i in range(num_layers):
        q, k, v = model.pre_attention(i, x, cos, sin)
        codes = None if coder is None else coder.codes(i, q, k, [(0, 0, n, 0)])
        attn.append(i, k.float().cpu(), v.float().cpu(), None if codes is None else codes[1])
        o = _attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], True)[0]
        x = model.post_attention(i, x, o)
        if (i + 1) % 8 == 0 or i + 1 == num_layers:  # a 64k prompt takes minutes: say how far it is
            print(f"prefill of {n} tokens: {i + 1}/{num_layers} layers in {time.perf_counter() - t0:.0f} s", flush=True)
    return int(model.logits(x[-1:]).argmax(-1).item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def gpu_only_decode(model: LlamaModel, batch: int, context: int, steps: int, warmup: int = 2) -> dict:
    """`batch` sequences decoding at `context` tokens with the whole KV in the model's dtype on its
    device ([layers, batch, Hkv, context + steps, D], random values) and SDPA -> tok/s."""
    cfg, dev = model.cfg, model.device
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, context + steps + warmup, cfg.head_dim)
    cache_k = torch.empty(shape, dtype=model.dtype, device=dev).normal_()
    cache_v = torch.empty(shape, dtype=model.dtype, device=dev).normal_()
    tokens = torch.randint(0, cfg.vocab_size, (batch,), device=dev)
    times = []
    for step in range(steps + warmup):
        pos = context + step
        _sync(dev)
        t0 = time.perf_counter()
        x = model.embed(tokens)
        cos, sin = model.rope(torch.full((batch,), pos, device=dev))
        for i in range(cfg.num_layers):
            q, k, v = model.pre_attention(i, x, cos, sin)
            cache_k[i, :, :, pos], cache_v[i, :, :, pos] = k, v
            o = _attention(q[:, :, None], cache_k[i, :, :, :pos + 1], cache_v[i, :, :, :pos + 1], False)
            x = model.post_attention(i, x, o[:, 0])
        tokens = model.logits(x).argmax(-1)
        _sync(dev)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    del cache_k, cache_v
    step_s = float(np.mean(times))
    return {"batch": batch, "decode_tok_s": batch / step_s, "mean_step_ms": 1e3 * step_s}


def gpu_only_max_batch(cfg: ModelConfig, context: int, steps: int, dtype: torch.dtype, device: torch.device,
                       reserve_bytes: float, limit: int) -> int:
    """Largest batch whose KV cache fits in the device's free memory less `reserve_bytes`."""
    per_seq = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (context + steps + 2) * dtype.itemsize
    if device.type != "cuda":
        return limit
    free, _ = torch.cuda.mem_get_info(device)
    return min(limit, int((free - reserve_bytes) // per_seq))


def host_bytes_per_seq(cfg: ModelConfig, lsh: LshConfig, context: int) -> int:
    """Oaken KV plus the most MagicPIG's state can hold (magicpig.host_bytes) for one sequence."""
    return kv_capacity_for(cfg, "oaken", BLOCK_SIZE, 1, context, lsh) - OakenKVStore.tail_bytes(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, 0)


def hetserve_backend(model: LlamaModel, thresholds: Path, context: int, steps: int, max_batch: int, lsh: LshConfig):
    from server.backend_config import BackendConfig
    from server.hetero import HeteroBackend

    seqs = max_batch + 1  # the prompt's own sequence too
    capacity = kv_capacity_for(model.cfg, "oaken", BLOCK_SIZE, seqs, context + steps + 3 + 2 * BLOCK_SIZE, lsh,
                               recent_blocks=seqs)
    config = BackendConfig(device=model.device.type, dtype=str(model.dtype).removeprefix("torch."), kv_format="oaken",
                           kv_capacity_bytes=capacity, block_size=BLOCK_SIZE, oaken_thresholds_path=str(thresholds),
                           oaken_recent_blocks=seqs, lsh=lsh, max_num_seqs=seqs)
    return HeteroBackend(None, config, model=model)


def device_bytes_per_seq(cfg: ModelConfig, context: int, steps: int, dtype: torch.dtype) -> int:
    """The accelerator's paged KV of one sequence decoding `steps` (+ warm-up) past `context` tokens."""
    blocks = -(-(context + steps + 3) // BLOCK_SIZE)
    return blocks * DeviceAttentionWorker.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE,
                                                          dtype)


@torch.inference_mode()
def offload_decode(model: LlamaModel, thresholds: Path, context: int, num_device: int, num_host: int, steps: int,
                   lsh: LshConfig, warmup: int = 2, gpu_kv_dtype: str = "auto") -> dict:
    """hetserve with --gpu-kv-cache-bytes room for `num_device` sequences at this context (server/offload.py; values
    as --gpu-kv-dtype says) and `num_host` more on the host (Oaken + MagicPIG): one random prompt is prefilled on
    the device (SDPA), its K, V copied into every sequence's blocks (the accelerator's pool for the first
    num_device, the host's store and tables for the rest). The accelerator's sequences decode `warmup` steps alone
    first (as in serving, where the pool fills before the host takes sequences: the guard's reference), then all
    decode `warmup` + `steps` steps through the backend -> tok/s, step parts, the guard."""
    from server.backend_config import BackendConfig
    from server.offload import OffloadBackend

    cfg, dev, bs = model.cfg, model.device, BLOCK_SIZE
    n = context // bs * bs
    alone_steps = warmup if num_host and num_device else 0
    decode_steps = alone_steps + warmup + steps
    own = -(-(n + decode_steps + 1) // bs)
    host_seqs = num_host + 1
    capacity = kv_capacity_for(cfg, "oaken", bs, host_seqs, n + decode_steps + 3 + 2 * bs, lsh,
                               recent_blocks=host_seqs)
    per_seq = device_bytes_per_seq(cfg, n, decode_steps, store_dtype(gpu_kv_dtype, model.dtype))
    config = BackendConfig(device=dev.type, dtype=str(model.dtype).removeprefix("torch."), kv_format="oaken",
                           kv_capacity_bytes=capacity, block_size=bs, oaken_thresholds_path=str(thresholds),
                           oaken_recent_blocks=host_seqs, lsh=lsh, max_num_seqs=num_device + host_seqs,
                           gpu_kv_cache_bytes=max(1, num_device) * per_seq, gpu_kv_dtype=gpu_kv_dtype)
    backend = OffloadBackend(None, config, model=model)
    nd = backend.num_device_blocks
    tables = [tuple(range(j * own, (j + 1) * own)) for j in range(num_device)]
    tables += [tuple(range(nd + j * own, nd + (j + 1) * own)) for j in range(num_host)]
    host_ids = list(range(num_device, num_device + num_host))
    attn, coder = backend.attn_worker, backend.model_worker.lsh
    attn.begin_step([ChunkLayout(n, 0, tuple(b - nd for b in tables[s][: n // bs]), s) for s in host_ids])
    x = model.embed(torch.tensor(np.random.default_rng(context).integers(0, cfg.vocab_size, n).tolist(), device=dev))
    cos, sin = model.rope(torch.arange(n, device=dev))
    for i in range(cfg.num_layers):
        q, k, v = model.pre_attention(i, x, cos, sin)
        for s in range(num_device):
            backend.device_attn.load(i, tables[s], k, v)
        if num_host:
            kr, vr, qr = (t.repeat(num_host, 1, 1) for t in (k, v, q))
            spans = [(s, 0, n, 0) for s in host_ids]
            codes = None if coder is None else coder.codes(i, qr, kr, spans)
            attn.append(i, kr.float().cpu(), vr.float().cpu(), None if codes is None else codes[1])
        o = _attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], True)[0]
        x = model.post_attention(i, x, o)
    first = int(model.logits(x[-1:]).argmax(-1).item())
    seqs = list(range(num_device)) + host_ids
    last, done, times, parts = {s: first for s in seqs}, {s: 0 for s in seqs}, [], {}
    greedy = SamplingParams(temperature=0.0)
    for step in range(decode_steps):
        active = seqs if step >= alone_steps else seqs[:num_device]
        chunks = tuple(SeqChunk(s, (last[s],), n + done[s], tables[s][: (n + done[s]) // bs + 1], greedy, done[s])
                       for s in active)
        t0 = time.perf_counter()
        out = backend.step(StepInput(chunks))
        _sync(dev)
        if step >= alone_steps + warmup:
            times.append(time.perf_counter() - t0)
            for key, val in out.timings.parts().items():
                parts.setdefault(key, []).append(val)
        last.update(out.sampled)
        for s in active:
            done[s] += 1
    guard_open = backend.guard.is_open
    backend.close()
    del backend
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    step_s = float(np.mean(times))
    return {"gpu_seqs": num_device, "host_seqs": num_host, "decode_tok_s": len(seqs) / step_s,
            "mean_step_ms": 1e3 * step_s, "parts_ms": {k: round(1e3 * float(np.mean(v)), 2) for k, v in parts.items()},
            "host_shard_open": guard_open}


def run_offload(model: LlamaModel, thresholds: Path, context: int, budgets_gb: list[float], host_extra: list[int],
                steps: int, lsh: LshConfig, reserve_bytes: float, max_gpu_batch: int,
                gpu_kv_dtype: str = "auto") -> list[dict]:
    """Per accelerator KV budget (0: what is free less the reserve): GPU-only at the batch that budget holds (the
    model's dtype), and hetserve's partial offload with that budget (its sequences in --gpu-kv-dtype: fp8 holds
    twice bf16's) plus each number of host sequences; the split the guard keeps open with the most tok/s is the one
    it would choose. With fp8, hetserve's pool in the model's dtype at GPU-only's batch runs too (`own_pool`,
    `ratio_own_pool`: what fp8 alone gives)."""
    cfg, dev = model.cfg, model.device
    per_seq = device_bytes_per_seq(cfg, context, steps + 2, model.dtype)
    per_seq_offload = device_bytes_per_seq(cfg, context, steps + 2, store_dtype(gpu_kv_dtype, model.dtype))
    rows = []
    for gb in budgets_gb:
        budget = gb * 2**30 if gb else (torch.cuda.mem_get_info(dev)[0] - reserve_bytes if dev.type == "cuda"
                                        else max_gpu_batch * per_seq)
        fit = min(max_gpu_batch, int(budget // per_seq))
        fit_offload = min(max_gpu_batch, int(budget // per_seq_offload))
        if fit < 1:
            rows.append({"gpu_kv_gb": gb, "note": f"no room for one {context}-token sequence ({per_seq / 2**30:.1f} GiB)"})
            continue
        print(f"context {context}, accelerator KV {gb or 'free'} GiB: GPU-only at batch {fit}, then offload with "
              f"{fit_offload} ({gpu_kv_dtype}) +{host_extra} host sequences", flush=True)
        gpu_only = gpu_only_decode(model, fit, context, steps)
        print(json.dumps({"context": context, "gpu_kv_gb": gb, "gpu_only": gpu_only}), flush=True)
        # a second baseline: hetserve's own pool in the model's dtype at GPU-only's batch (the paged kernel,
        # no host sequences), so the ratio over it is what --gpu-kv-dtype alone gives
        own = None
        if gpu_kv_dtype != "auto":
            own = offload_decode(model, thresholds, context, fit, 0, steps, lsh)
            print(json.dumps({"context": context, "gpu_kv_gb": gb, "own_pool": own}), flush=True)
        runs = []
        for h in host_extra:  # each cell is printed as it ends: a run stopped by its time box keeps the rest
            runs.append(offload_decode(model, thresholds, context, fit_offload, h, steps, lsh,
                                       gpu_kv_dtype=gpu_kv_dtype))
            print(json.dumps({"context": context, "gpu_kv_gb": gb, "gpu_kv_dtype": gpu_kv_dtype, **runs[-1]}),
                  flush=True)
        chosen = max((r for r in runs if r["host_shard_open"]), key=lambda r: r["decode_tok_s"], default=None)
        rows.append({"gpu_kv_gb": gb, "gpu_kv_dtype": gpu_kv_dtype, "gpu_only": gpu_only, "own_pool": own,
                     "offload": runs, "chosen_host_seqs": None if chosen is None else chosen["host_seqs"],
                     "ratio": None if chosen is None else chosen["decode_tok_s"] / gpu_only["decode_tok_s"],
                     "ratio_own_pool": None if chosen is None or own is None
                     else chosen["decode_tok_s"] / own["decode_tok_s"]})
    return rows


def run_context(model: LlamaModel, thresholds: Path, context: int, batches: list[int], steps: int, lsh: LshConfig,
                reserve_bytes: float, max_gpu_batch: int) -> dict:
    import psutil

    cfg, rng = model.cfg, np.random.default_rng(context)
    per_seq = host_bytes_per_seq(cfg, lsh, context)
    room = int(0.85 * psutil.virtual_memory().available // per_seq) - 1  # the prompt's own copy too
    fit = [b for b in batches if b <= room]
    row = {"context": context, "host_bytes_per_seq": per_seq, "skipped_batches": [b for b in batches if b > room],
           "hetserve": []}
    if fit:
        backend = hetserve_backend(model, thresholds, context, steps, max(fit), lsh)
        prompt = rng.integers(0, cfg.vocab_size, context // BLOCK_SIZE * BLOCK_SIZE).tolist()
        row["hetserve"] = decode_run(backend, prompt, fit, steps + 2, is_distinct=True, prefill=gpu_prefill)
        touched, eligible = backend.attn_worker.sparse.take_stats()
        row["keys_touched_frac"] = touched / max(eligible, 1)
        del backend
        gc.collect()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    gpu_batch = gpu_only_max_batch(cfg, context, steps, model.dtype, model.device, reserve_bytes, max_gpu_batch)
    row["gpu_only"] = None
    while gpu_batch >= 1 and row["gpu_only"] is None:
        try:
            row["gpu_only"] = gpu_only_decode(model, gpu_batch, context, steps)
        except torch.cuda.OutOfMemoryError:  # activations took more than the reserve: one sequence fewer
            gpu_batch -= 1
            torch.cuda.empty_cache()
    best = max((r["decode_tok_s"] for r in row["hetserve"]), default=None)
    if best is not None and row["gpu_only"]:
        row["ratio"] = best / row["gpu_only"]["decode_tok_s"]
    return row


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        gpu = r["gpu_only"] or {}
        for h in r["hetserve"] or [{}]:
            out.append({"context": r["context"], "hetserve_batch": h.get("concurrency"),
                        "hetserve_tok_s": h.get("decode_tok_s"), "hetserve_step_ms": h.get("mean_step_ms"),
                        "cpu_attn_ms": h.get("parts_ms", {}).get("cpu_attn"),
                        "exact_layers_ms": h.get("parts_ms", {}).get("cpu_attn_dense"),
                        "keys_touched": r.get("keys_touched_frac"), "gpu_only_batch": gpu.get("batch"),
                        "gpu_only_tok_s": gpu.get("decode_tok_s"),
                        "ratio": h["decode_tok_s"] / gpu["decode_tok_s"] if h and gpu else None})
    return out


def offload_rows(offload: list[dict]) -> list[dict]:
    out = []
    for c in offload:
        for b in c["budgets"]:
            gpu = b.get("gpu_only") or {}
            for r in b.get("offload", []):
                p = r["parts_ms"]
                out.append({"context": c["context"], "gpu_kv_gb": b["gpu_kv_gb"] or "free", "gpu_seqs": r["gpu_seqs"],
                            "host_seqs": r["host_seqs"], "tok_s": r["decode_tok_s"], "step_ms": r["mean_step_ms"],
                            "gpu_attn_ms": p.get("gpu_attn"), "cpu_attn_ms": p.get("cpu_attn"),
                            "accelerator_ms": p.get("accelerator"), "host_shard_open": r["host_shard_open"],
                            "gpu_only_tok_s": gpu.get("decode_tok_s"),
                            "own_pool_tok_s": (b.get("own_pool") or {}).get("decode_tok_s"),
                            "ratio": r["decode_tok_s"] / gpu["decode_tok_s"] if gpu else None})
    return out


def plot_offload(offload: list[dict], path: Path) -> Path:
    """Per (context, budget): the offload split the guard chose, over GPU-only at that budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(c["context"], b) for c in offload for b in c["budgets"] if b.get("ratio") is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = np.arange(len(cells))
    ax.bar(xs, [b["ratio"] for _, b in cells], color="tab:blue")
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(xs, [f"{ctx // 1024}k, {b['gpu_kv_gb'] or 'free'} GiB\n+{b['chosen_host_seqs']} host"
                       for ctx, b in cells], fontsize=8)
    ax.set_ylabel("decode tok/s over GPU-only")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = np.arange(len(rows))
    batches = sorted({h["concurrency"] for r in rows for h in r["hetserve"]})
    width = 0.8 / (len(batches) + 1)
    for j, b in enumerate(batches):
        ys = [next((h["decode_tok_s"] for h in r["hetserve"] if h["concurrency"] == b), 0) for r in rows]
        ax.bar(xs + j * width, ys, width, label=f"hetserve, batch {b}")
    ys = [(r["gpu_only"] or {}).get("decode_tok_s", 0) for r in rows]
    labels = [(r["gpu_only"] or {}).get("batch", 0) for r in rows]
    bars = ax.bar(xs + len(batches) * width, ys, width, label="GPU-only SDPA, largest batch", color="k")
    for bar, b in zip(bars, labels):
        ax.annotate(f"b={b}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(xs + len(batches) * width / 2, [f"{r['context'] // 1024}k" for r in rows])
    ax.set_xlabel("context tokens")
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--context", type=int, nargs="+", default=[32768, 65536, 98304])
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 8, 16], help="hetserve batch sizes")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps (2 more warm up)")
    ap.add_argument("--device", default="cuda", help="where the linears (and GPU-only attention) run")
    ap.add_argument("--gpu-reserve-gb", type=float, default=4.0, help="device memory left for activations")
    ap.add_argument("--max-gpu-batch", type=int, default=256)
    ap.add_argument("--calibration-windows", type=int, default=8)
    ap.add_argument("--lsh-l", type=int, default=LshConfig.l)
    ap.add_argument("--lsh-min-collisions", type=int, default=LshConfig.min_collisions)
    ap.add_argument("--modes", nargs="+", choices=["all-host", "offload"], default=["all-host", "offload"],
                    help="all-host: every sequence's attention on the host (--batch); offload: --gpu-kv-cache-bytes")
    ap.add_argument("--gpu-kv-gb", type=float, nargs="+", default=[0, 48, 24],
                    help="offload: accelerator KV budgets in GiB (0: what is free less --gpu-reserve-gb)")
    ap.add_argument("--host-extra", type=int, nargs="+", default=[0, 4, 8],
                    help="offload: sequences on the host beside those the budget holds")
    ap.add_argument("--gpu-kv-dtype", choices=["auto", "fp8"], default="auto",
                    help="offload mode: the accelerator pool's values (fp8 holds twice the sequences of bf16)")
    ap.add_argument("--out", default=str(RESULTS / "gpu_offload.json"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu_offload needs a CUDA device (--device cpu --shape tiny is a smoke run)")
    cfg = SHAPES[args.shape]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = random_model(cfg, args.device, dtype)
    lsh = LshConfig(l=args.lsh_l, min_collisions=args.lsh_min_collisions)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    thresholds = out.with_name(out.stem + "_thresholds.json")
    windows = np.random.default_rng(1).integers(0, cfg.vocab_size, (args.calibration_windows, 512)).tolist()
    calibrate(model, windows, context_tokens=max(args.context)).save(thresholds)
    rows, offload = [], []
    for context in args.context:
        if "all-host" in args.modes:
            print(f"context {context}: prefill on {args.device}, then hetserve batches {args.batch}, then GPU-only",
                  flush=True)
            rows.append(run_context(model, thresholds, context, args.batch, args.steps, lsh,
                                    args.gpu_reserve_gb * 2**30, args.max_gpu_batch))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "hetserve"}), flush=True)
        if "offload" in args.modes:
            offload.append({"context": context, "budgets": run_offload(
                model, thresholds, context, args.gpu_kv_gb, args.host_extra, args.steps, lsh,
                args.gpu_reserve_gb * 2**30, args.max_gpu_batch, args.gpu_kv_dtype)})
    if rows:
        print_table(table_rows(rows), ["context", "hetserve_batch", "hetserve_tok_s", "hetserve_step_ms", "cpu_attn_ms",
                                       "exact_layers_ms", "keys_touched", "gpu_only_batch", "gpu_only_tok_s", "ratio"])
    if offload_rows(offload):
        print_table(offload_rows(offload), ["context", "gpu_kv_gb", "gpu_seqs", "host_seqs", "tok_s", "step_ms",
                                            "gpu_attn_ms", "cpu_attn_ms", "accelerator_ms", "host_shard_open",
                                            "gpu_only_tok_s", "own_pool_tok_s", "ratio"])
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"shape": args.shape, "device": device, "machine": machine(), "torch": torch.__version__,
              "steps": args.steps, "lsh_l": args.lsh_l, "lsh_min_collisions": args.lsh_min_collisions, "rows": rows,
              "offload": offload}
    out.write_text(json.dumps(result, indent=1))
    plots = ([plot(rows, out.with_suffix(".png"))] if rows else []) + (
        [plot_offload(offload, out.with_name(out.stem + "_offload.png"))] if offload else [])
    print(f"wrote {out} and {', '.join(map(str, plots))}")
    return result


if __name__ == "__main__":
    main()
