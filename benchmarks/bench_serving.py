"""Decode throughput and time per output token: hetserve (real server, streaming HTTP) against
HF transformers `generate` on the same machine, model and prompts, in one run.

    python -m benchmarks.bench_serving [--concurrency 1 8 32] [--output-tokens 128]

Each concurrency level c sends max(c, 4) requests, c at a time, with prompts of 128-1024
tokens of WikiText-2 and exactly --output-tokens output tokens (ignore_eos). HF serves c
requests as one left-padded `generate` batch, the way a transformers user would. hetserve runs
as a real server with a streaming HTTP client on the same machine; HF runs in-process, by default
with the matmul precision hetserve's linears use (bf16 on CPUs with native bf16, else fp32).
Also times `hetserve serve` to a ready /health on a second start (weights cached).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np
import torch

from benchmarks.common import machine, print_table, start_hetserve, token_prompts, write_json
from server.config import CPU_LINEAR_DTYPES


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, sem: asyncio.Semaphore) -> dict:
    async with sem:
        t0 = time.perf_counter()
        stamps = []
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
        e2e = time.perf_counter() - t0
        ttft = stamps[0] - t0
        return {"ttft_s": ttft, "tpot_s": (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), "e2e_s": e2e}


async def run_hetserve(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, p, max_tokens, sem) for p in prompts))
        wall = time.perf_counter() - t0
    return {"output_tok_s": len(prompts) * max_tokens / wall, "tpot_ms": 1e3 * np.mean([r["tpot_s"] for r in results]),
            "ttft_ms": 1e3 * np.mean([r["ttft_s"] for r in results]), "wall_s": wall}


def run_hf(model, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    def generate(batch, n):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    wall, decode_s = 0.0, []
    for i in range(0, len(prompts), concurrency):
        batch = prompts[i:i + concurrency]
        prefill = generate(batch, 1)
        full = generate(batch, max_tokens)
        wall += full
        decode_s.append((full - prefill) / (max_tokens - 1))
    return {"output_tok_s": len(prompts) * max_tokens / wall, "tpot_ms": 1e3 * float(np.mean(decode_s)), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[128, 1024], metavar=("MIN", "MAX"))
    ap.add_argument("--repeats", type=int, default=2,
                    help="hetserve/HF pairs per level, run back to back; the median pair is reported")
    ap.add_argument("--hf-dtype", choices=CPU_LINEAR_DTYPES, default="auto",
                    help="HF's model dtype (default: hetserve's `cpu_linear_dtype` auto, bfloat16 on CPUs with native bf16)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", default="serving.json", help="file name under benchmarks/results/")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from gpu_model.loader import resolve_linear_dtype, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer

    model_dir = resolve_model_dir(None)
    tok = Tokenizer(model_dir, (2,))
    rng = np.random.default_rng(0)
    workloads = {c: token_prompts(tok, rng.integers(args.prompt_tokens[0], args.prompt_tokens[1] + 1, max(c, 4)).tolist())
                 for c in args.concurrency}
    hf_dtype = resolve_linear_dtype(args.hf_dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=hf_dtype).eval()
    print(f"HF in {hf_dtype}", flush=True)

    url = f"http://127.0.0.1:{args.port}"
    first, first_s = start_hetserve(args.port)
    first.terminate(), first.wait()
    proc, ready_s = start_hetserve(args.port, "--prefix-caching", "off")  # the levels reuse windows; HF recomputes them
    print(f"hetserve ready in {first_s:.1f} s (first start), {ready_s:.1f} s (second start)", flush=True)
    rows = []
    try:
        for c, prompts in workloads.items():
            pairs = []
            # the machine's speed drifts (shared memory bandwidth): pair each run with its baseline
            for _ in range(args.repeats):
                ours = asyncio.run(run_hetserve(url, prompts, c, args.output_tokens))
                base = run_hf(hf, prompts, c, args.output_tokens)
                pairs.append((ours["output_tok_s"] / base["output_tok_s"], ours, base))
                print(f"c={c}: hetserve {ours['output_tok_s']:.1f} tok/s, HF {base['output_tok_s']:.1f} tok/s", flush=True)
            ratio, ours, base = sorted(pairs, key=lambda p: p[0])[(len(pairs) - 1) // 2]
            rows.append({"concurrency": c, "requests": len(prompts),
                         "hetserve_tok_s": ours["output_tok_s"], "hf_tok_s": base["output_tok_s"], "speedup": ratio,
                         "hetserve_tpot_ms": ours["tpot_ms"], "hf_tpot_ms": base["tpot_ms"],
                         "hetserve_ttft_ms": ours["ttft_ms"], "all_speedups": [round(p[0], 3) for p in pairs]})
    finally:
        proc.terminate(), proc.wait()
    print()
    print_table(rows, [k for k in rows[0] if k != "all_speedups"])
    result = {"machine": machine(), "args": vars(args), "hf_dtype": str(hf_dtype), "startup_s": {"first": first_s, "second": ready_s}, "rows": rows}
    print(f"\nwrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
