"""HF transformers baseline for the long-context workload, run in its own process so its peak RSS is its own:

    python -m benchmarks.e2e.hf --prompt-tokens 3840 --output-tokens 256 --concurrency 4 --out hf.json

The same prompts as loadgen sends (its PromptBuilder, seed 0, prompt i from position (0, i)), as token ids.
`benchmarks.bench_serving.run_hf` serves each group of `concurrency` requests as one `generate` batch
(fp32, the model's default attention), once with 1 new token (prefill) and once with all of them; TPOT is
(full - prefill) / (output tokens - 1), TTFT is the full time less the decode steps (the prefill of the batch).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, required=True)
    ap.add_argument("--output-tokens", type=int, required=True)
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--num-requests", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from benchmarks.bench_serving import run_hf
    from gpu_model.loader import resolve_model_dir
    from loadgen.prompts import DEFAULT_TEXT, PromptBuilder, TargetTokenizer

    tok = TargetTokenizer.load(None)
    builder = PromptBuilder(tok, Path(DEFAULT_TEXT).read_text(encoding="utf-8"), seed=0)
    prompts = [tok._tok.encode(p.text, add_special_tokens=True)
               for p in builder.build_all([args.prompt_tokens] * args.num_requests)]
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.float32).eval()
    t0 = time.perf_counter()
    with torch.inference_mode():
        r = run_hf(model, prompts, args.concurrency, args.output_tokens)
    num_batches = -(-len(prompts) // args.concurrency)
    # each batch's full generate = prefill + (n - 1) decode steps, so its prefill (the batch's TTFT) is the rest
    prefill_s = r["wall_s"] / num_batches - (args.output_tokens - 1) * r["tpot_ms"] / 1e3
    out = {"completed": len(prompts), "failed": 0, "duration": time.perf_counter() - t0,
           "output_throughput": r["output_tok_s"], "median_tpot_ms": r["tpot_ms"], "p99_tpot_ms": None,
           "mean_ttft_ms": 1e3 * prefill_s, "decode_tok_s": args.concurrency * 1e3 / r["tpot_ms"],
           "num_prompt_tokens": [len(p) for p in prompts]}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
