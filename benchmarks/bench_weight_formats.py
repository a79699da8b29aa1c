"""Weight formats of the linear layers on the bundled model, in one run: bits per weight, bytes,
WikiText-2 perplexity and KL against dense fp32 weights, decode step time at 1 / 8 / 32 sequences,
and the 1-sequence matmuls' bytes/s against the machine's measured read bandwidth: through every
linear as a step calls them (per-call costs included), and the kernel alone on all layers' gate_up
weights stacked into one call.

    python -m benchmarks.bench_weight_formats [--formats gguf mxfp4 ...] [--num-windows 16]
        [--window-tokens 1024] [--batches 1 8 32] [--repeats 15]

Perplexity: each window is prefilled in one pass (causal attention in torch), so every matmul runs
the dense copy, which holds the format's own values (gpu_model/weight_format.py); the dense linears
run float32, so only the weights differ from the reference. Speed: each format as `hetserve serve
--weight-format F` runs it (`--cpu-linear-dtype auto`: beside bf16 linears on AMX CPUs, where GGUF and
MX blocks multiply with integer dots). A decode step is the served backend's own (`serve`'s default
configuration with `--weight-format F`): a batch of single tokens after `--context` cached ones each,
embeddings, every layer with its KV write and paged attention (one call for all layers where the
format has integer-dot kernels), the LM head and greedy sampling. The formats' backends take turns
step by step, so the machine's drift falls on all of them alike; `step_1_vs_gguf` is the median
over rounds of each round's ratio. Prints a table; writes
benchmarks/results/weight_formats.json and weight_formats.png.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS, machine, print_table, times_ms, write_json
from gpu_model.loader import load_model, resolve_model_dir
from gpu_model.mx_weight import MXWeight
from gpu_model.quant import QuantWeight
from gpu_model.quant_vnni import VnniWeight
from gpu_model.weight_format import WeightFormat, weight_bits
from cpu_attn.calibrate import text_windows
from gpu_model.tokenizer import Tokenizer
from hetcore.data import WIKITEXT2_TEST

FORMATS = ["fp32", "bf16", "gguf", "mxint8", "mxfp8", "mxfp6", "mxfp4", "mxfp4+hadamard"]


def parse_format(label: str) -> WeightFormat:
    name, _, rotation = label.partition("+")
    return WeightFormat(name, rotation or "none")


def window_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """ids: [T] -> log-probabilities of each next token [T, vocab], one causal pass."""
    cfg, n = model.cfg, len(ids)
    x = model.embed(ids)
    cos, sin = model.rope(torch.arange(n))
    group = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        q, k, v = model.pre_attention(i, x, cos, sin)  # [T, H, D], [T, Hkv, D]
        k, v = (t.repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
        x = model.post_attention(i, x, o.transpose(0, 1).reshape(n, -1))
    return torch.log_softmax(model.logits(x).float(), -1)


def quality(model, ref_logps: list[torch.Tensor] | None, windows: list[torch.Tensor]) -> tuple[dict, list]:
    """Perplexity and mean KL(ref || model) per position, and the model's log-probabilities."""
    nll = kl = count = 0.0
    logps = []
    for i, ids in enumerate(windows):
        logp = window_logprobs(model, ids)[:-1]
        nll -= logp.gather(1, ids[1:, None]).sum().item()
        if ref_logps is not None:
            kl += (ref_logps[i].exp() * (ref_logps[i] - logp)).sum().item()
        count += len(ids) - 1
        logps.append(logp)
    return {"ppl": float(np.exp(nll / count)), "kl_mean": kl / count}, logps


def serving_backend(label: str, model: str | None, max_seqs: int, context: int):
    """The backend `hetserve serve --weight-format F` builds (its default configuration otherwise: local executor,
    fp16 KV, exact attention), with a KV cache for max_seqs sequences of context + 1 tokens."""
    from server.config import ServeConfig
    from server.launch import build_engine

    wf = parse_format(label)
    kv_bytes = max(64 << 20, max_seqs * (context + 64) * 64 << 10)  # >= 64 KiB a token: any KV format of this model
    engine, _, _ = build_engine(ServeConfig(model=model, weight_format=wf.name, weight_rotation=wf.rotation,
                                            kv_cache_bytes=kv_bytes, max_num_seqs=max_seqs))
    return engine.backend


def decode_steps_ms(backends: dict, batches: list[int], context: int, repeats: int) -> dict[tuple[str, int], list]:
    """Each backend's decode step (every sequence one token after `context` cached ones: embeddings, every layer
    with its KV write and paged attention, the head, greedy sampling) for each batch size, the backends taking
    turns step by step (the first of a round moving on each round), so that the machine's drift falls on all alike.
    -> {(label, batch): [ms a round]}."""
    from hetcore.backend import SamplingParams, SeqChunk, StepInput

    greedy, num_seqs = SamplingParams(temperature=0.0), max(batches)
    prompt, bs = tuple(range(1000, 1000 + context)), next(iter(backends.values())).kv_spec.block_size
    per_seq = (context + bs) // bs  # blocks of context + 1 tokens
    tables = {i: tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)}
    for backend in backends.values():  # one model and block size, several weight formats
        for i in range(num_seqs):  # prompts one at a time: a step of 32 x 256 tokens would need a large scratch
            backend.step(StepInput((SeqChunk(i, prompt, 0, tables[i][:(context + bs - 1) // bs], greedy),)))
    steps = {b: StepInput(tuple(SeqChunk(i, (7,), context, tables[i], greedy, 1) for i in range(b))) for b in batches}
    labels = list(backends)
    times: dict[tuple[str, int], list] = {(label, b): [] for label in labels for b in batches}
    for r in range(repeats + 2):  # two rounds to warm up
        for b in batches:
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                t0 = time.perf_counter()
                backends[label].step(steps[b])
                if r >= 2:
                    times[label, b].append(1e3 * (time.perf_counter() - t0))
    return times


def matmul_bytes(model) -> int:
    """Bytes a 1-token step's matmuls read: the block copies where the model has them, else dense."""
    total = 0
    for key, w in model.matmul_weights().items():
        q = model.quant.get(key) if model.quant_max_tokens > 0 else None
        if isinstance(q, MXWeight):
            total += q.nbytes
        elif q is not None:  # GGUF blocks, in whichever layout the loader keeps them
            total += sum(a.nbytes for a in vars(q).values() if isinstance(a, np.ndarray))
        else:
            total += w.numel() * w.element_size()
    return total


def matmuls_ms(model, repeats: int) -> float:
    """Best time of one token through every matmul (linears and head)."""
    mats = list(model.matmul_weights().items())
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for _, w in mats}
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for key, w in mats:
            model._linear(key, w, xs[w.shape[1]])
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def stacked_weight(model):
    """Every layer's gate_up matmul as one weight (rows stacked), in the kernel a 1-token step uses for it, and its
    bytes: one call reads it all, so per-call costs vanish and the kernel's own read rate shows."""
    keys = [f"layers.{i}.gate_up" for i in range(model.cfg.num_layers)]
    parts = [model.quant.get(k) if model.quant_max_tokens > 0 else None for k in keys]
    first = parts[0]
    if isinstance(first, VnniWeight):
        w = VnniWeight(first.kind, np.concatenate([p.scales for p in parts]), np.concatenate([p.qs for p in parts]))
    elif isinstance(first, MXWeight):
        w = MXWeight.concat(parts)
    elif first is not None:
        w = QuantWeight.concat(parts)
    else:
        dense = torch.cat([model.matmul_weights()[k] for k in keys])
        return (lambda x: torch.nn.functional.linear(x.to(dense.dtype), dense)), dense.numel() * dense.element_size()
    return w.matmul, w.nbytes


def kernel_gb_s(model, repeats: int) -> float:
    """GB/s of one token through stacked_weight, best of `repeats` calls."""
    matmul, num_bytes = stacked_weight(model)
    x = torch.randn(1, model.cfg.hidden_size)
    return num_bytes / 1e9 / (min(times_ms(lambda: matmul(x), repeats)) / 1e3)


def numba_read_gb_s(num_bytes: int = 2**30) -> float:
    """Read bandwidth of a parallel Numba sum over a large float32 array (all threads), best of 3."""
    from numba import njit, prange

    @njit(parallel=True, fastmath=True)
    def total(a):
        s = np.float32(0.0)
        for i in prange(a.shape[0]):
            s += a[i]
        return s

    a = np.ones(num_bytes // 4, np.float32)
    total(a[:1024])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        total(a)
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best / 1e9


def plot(rows: list[dict], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r["format"] for r in rows]
    width = 0.8 / len(batches)
    for j, b in enumerate(batches):
        left.bar(np.arange(len(rows)) + j * width, [r[f"step_ms_{b}"] for r in rows], width, label=f"{b} seq")
    left.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, labels, rotation=30)
    left.set_ylabel("decode step, ms (median)")
    left.legend()
    right.bar(labels, [r["ppl_change_pct"] for r in rows])
    right.set_ylabel("perplexity vs dense fp32 weights, %")
    right.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=FORMATS, help="weight formats; +hadamard for the rotation")
    p.add_argument("--num-windows", type=int, default=16)
    p.add_argument("--window-tokens", type=int, default=1024)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=256, help="cached tokens per sequence in a decode step")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--model", help="GGUF file or safetensors directory (default: the bundled model)")
    p.add_argument("--threads", type=int, help="torch and Numba threads (default: theirs, one per core)")
    p.add_argument("--out", default="weight_formats", help="name of the JSON and PNG in benchmarks/results/")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:
        import numba

        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model, Path("~/.cache/hetserve/models").expanduser())
    mach = {**machine(), "numba_read_gb_s": round(numba_read_gb_s(), 2)}
    dense = load_model(model_dir, weight_format=WeightFormat("fp32"))
    tok = Tokenizer(model_dir, dense.cfg.eos_token_ids)
    windows = [torch.tensor(w) for w in text_windows(tok.encode(WIKITEXT2_TEST.read_text()), args.num_windows,
                                                     args.window_tokens)]
    dense_quality, ref = quality(dense, None, windows)
    rows = []
    for label in args.formats:
        wf = parse_format(label)
        # quality beside float32 dense linears, so that only the weights differ from the reference; speed as
        # `serve --weight-format F` runs it (bf16 linears beside the blocks on AMX CPUs: integer-dot kernels)
        linear = {"bf16": "bfloat16", "fp32": "float32"}.get(wf.name, "auto")
        model = load_model(model_dir, cpu_linear_dtype=linear, weight_format=wf)
        # fp32 and gguf hold the dense weights' very values in every matmul: the reference itself
        same = wf.name in ("fp32", "gguf")
        scored = dense_quality if same else quality(
            model if linear != "auto" else load_model(model_dir, cpu_linear_dtype="float32", weight_format=wf),
            ref, windows)[0]
        row = {"format": label, "weight_bits": weight_bits(model), "matmul_mb": matmul_bytes(model) / 1e6, **scored}
        row["matmuls_1_ms"] = matmuls_ms(model, args.repeats)
        row["matmul_gb_s"] = row["matmul_mb"] / row["matmuls_1_ms"]
        row["of_numba_read"] = row["matmul_gb_s"] / mach["numba_read_gb_s"]
        row["kernel_gb_s"] = kernel_gb_s(model, 4 * args.repeats)
        row["kernel_of_read"] = row["kernel_gb_s"] / mach["numba_read_gb_s"]
        rows.append(row)
        del model
        print(f"{label}: quality and kernels done", flush=True)
    backends = {label: serving_backend(label, args.model, max(args.batches), args.context) for label in args.formats}
    print(f"decode steps: {len(backends)} backends taking turns, {args.repeats} rounds", flush=True)
    times = decode_steps_ms(backends, args.batches, args.context, args.repeats)
    for backend in backends.values():
        backend.close()
    base = dense_quality["ppl"]
    for r in rows:
        r["ppl_change_pct"] = 100 * (r["ppl"] / base - 1)
        for b in args.batches:
            ms = times[r["format"], b]
            r[f"step_ms_{b}"], r[f"step_min_ms_{b}"] = float(np.median(ms)), min(ms)
        if "gguf" in backends:  # the median over rounds of the ratio within a round: the drift between rounds cancels
            r["step_1_vs_gguf"] = float(np.median(np.divide(times[r["format"], 1], times["gguf", 1])))
    print(f"{len(windows)} x {args.window_tokens} tokens of WikiText-2 test; dense fp32 perplexity {base:.4f}; "
          f"read bandwidth: numpy {mach['memory_read_gb_s']} GB/s, numba {mach['numba_read_gb_s']} GB/s")
    steps = [f"step_ms_{b}" for b in args.batches]
    print_table(rows, ["format", "weight_bits", "matmul_mb", "ppl", "ppl_change_pct", "kl_mean", *steps,
                       "step_1_vs_gguf", "matmuls_1_ms", "matmul_gb_s", "of_numba_read", "kernel_gb_s",
                       "kernel_of_read"])
    path = write_json(f"{args.out}.json", {"machine": mach, "num_windows": len(windows), "threads": args.threads,
                                           "window_tokens": args.window_tokens, "context": args.context,
                                           "ppl_dense": base, "rows": rows})
    plot(rows, args.batches, RESULTS / f"{args.out}.png")
    print(f"wrote {path} and {args.out}.png")


if __name__ == "__main__":
    main()
