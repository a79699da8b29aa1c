"""Decode speed of hetserve's backend at `concurrency` sequences of a long shared context, without paying
`concurrency` prefills (16 x 8k prompts take over an hour to prefill on 2 busy cores).

    python -m benchmarks.e2e.decode_only --context-tokens 7936 --concurrency 1 4 16 --steps 48 \
        -- --kv-format oaken --attention magicpig

The server's own backend (built by `server.launch.build_engine` from the `hetserve serve` options after
`--`) prefills one prompt once (one chunk, exact SDPA), then every decoding sequence gets that prompt's
KV blocks in its block table (shared read-only, as a prefix cache would) plus blocks of its own for the
tokens it decodes, and copies of the per-sequence MagicPIG state (LSH key centers and hash tables). Each
sequence therefore reads a full-length context every step: the work of the decode kernels is that of
`concurrency` distinct contexts; only the bytes are shared (cache effects: see the README). The
counterpart for llama.cpp is `llama-batched-bench -pps` (shared prompt), which does the same.

With the local executor each row also gives the step's read bound: the bytes of linear weights a step of
that many tokens reads (LlamaModel.step_weight_bytes) over the memory read bandwidth measured after the
runs (benchmarks.common.memory_read_gb_s), and the p50 step over it.

KV block layout of each concurrency's group of sequences (the next group reuses the blocks; block_size
16, prompt of P = 496 blocks):

    prefix blocks   [0 .. P)                      shared by every sequence
    seq j's own     [P + j*D .. P + (j+1)*D)      D = ceil(steps / 16) + 1 blocks for decoded tokens
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np


def _clone_seq(backend, src: int, dst: int) -> None:
    """Give sequence `dst` copies of `src`'s per-sequence state (MagicPIG key centers and tables)."""
    lsh = getattr(backend.model_worker, "lsh", None)
    if lsh is not None and src in lsh.centers:
        lsh.centers[dst] = dict(lsh.centers[src])
    sparse = getattr(backend.attn_worker, "sparse", None)
    if sparse is not None:
        sparse.clone(src, dst)


def _copy_blocks(store, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
    """Physically copy KV blocks src -> dst (Oaken: dense codes, scales, counts, sparse entries; else k, v)."""
    s, d = np.asarray(src), np.asarray(dst)
    if hasattr(store, "dense"):  # [layers, 2, num_blocks, ...]; the prompt's blocks are full, so no tail slot
        stale = store.tail_of[:, d]  # a freed sequence's block that was still filling: drop its tail slot
        for layer, j in zip(*np.nonzero(stale >= 0)):
            store.tail_block[layer, stale[layer, j]] = -1
        store.tail_of[:, d] = -1
        for arr in (store.dense, store.scales, store.counts, store.sparse):
            arr[:, :, d] = arr[:, :, s]
    else:  # [layers, num_blocks, ...]
        for arr in (store.k, store.v):
            arr[:, d] = arr[:, s]


def prefill_one(backend, prompt: list[int], blocks: tuple[int, ...]) -> int:
    """The backend's own prefill of `prompt` as sequence 0 -> the first token it samples."""
    from hetcore.backend import SamplingParams, SeqChunk, StepInput

    return backend.step(StepInput((SeqChunk(0, tuple(prompt), 0, blocks, SamplingParams(temperature=0.0)),))).sampled[0]


def run(backend, prompt: list[int], concurrencies: list[int], num_steps: int, warmup_steps: int = 2,
        is_distinct: bool = False, prefill=prefill_one, self_draft: int = 0,
        draft_view: tuple[int, int] = (16, 256)) -> list[dict]:
    """`prefill(backend, prompt, blocks)` fills sequence 0's KV (and MagicPIG state) and returns its
    first token (default: prefill_one). With `self_draft` k every step of every sequence also drafts k
    tokens with the model over its KV view `draft_view` (sinks, window; speculative method self-sparse)
    and verifies them; a sequence advances by the drafts accepted plus one."""
    from hetcore.backend import SamplingParams, SeqChunk, StepInput

    bs = backend.kv_spec.block_size
    greedy = SamplingParams(temperature=0.0)
    num_prefix = math.ceil(len(prompt) / bs)
    assert len(prompt) % bs == 0, "a prompt of whole blocks keeps the decoded tokens out of the shared blocks"
    prefix = tuple(range(num_prefix))
    t0 = time.perf_counter()
    first = prefill(backend, prompt, prefix)
    prefill_s = time.perf_counter() - t0
    per_seq = math.ceil((num_steps * (self_draft + 1) + 1) / bs) + 1
    next_seq, rows = 1, []
    for c in concurrencies:
        next_block = num_prefix  # the blocks of the previous concurrency's sequences, freed, are reused
        seqs = list(range(next_seq, next_seq + c))
        next_seq += c
        own = {}
        tables = {}
        for s in seqs:
            _clone_seq(backend, 0, s)
            own[s] = tuple(range(next_block, next_block + per_seq))
            next_block += per_seq
            tables[s] = prefix
            if is_distinct:  # a physical copy of the prompt's KV per sequence, as distinct prompts would have
                tables[s] = tuple(range(next_block, next_block + num_prefix))
                next_block += num_prefix
                assert next_block <= backend.kv_spec.num_blocks, "raise --kv-cache-bytes"
                _copy_blocks(backend.attn_worker.store, prefix, tables[s])
        assert next_block <= backend.kv_spec.num_blocks, "raise --kv-cache-bytes"
        last = {s: first for s in seqs}
        pos = {s: len(prompt) for s in seqs}
        step_s, parts, emitted, accepted = [], {}, 0, 0
        for i in range(num_steps):
            chunks = tuple(SeqChunk(s, (last[s],), pos[s], (tables[s] + own[s])[:(pos[s] + self_draft) // bs + 1], greedy,
                                    pos[s] - len(prompt), self_draft=self_draft, draft_view=draft_view)
                           for s in seqs)
            t0 = time.perf_counter()
            out = backend.step(StepInput(chunks))
            dt = time.perf_counter() - t0
            last.update(out.sampled)
            for s in seqs:
                n = len(out.accepted.get(s, ()))
                pos[s] += 1 + n
                if i >= warmup_steps:
                    emitted, accepted = emitted + 1 + n, accepted + n
            if i >= warmup_steps:
                step_s.append(dt)
                for k, v in (out.timings.parts() if out.timings else {}).items():
                    parts.setdefault(k, []).append(v)
        backend.step(StepInput((), freed_seq_ids=tuple(seqs)))
        mean_step = float(np.mean(step_s))
        rows.append({"concurrency": c, "context_tokens": len(prompt), "num_steps": len(step_s),
                     "decode_tok_s": emitted / sum(step_s), "mean_step_ms": 1e3 * mean_step,
                     "self_draft": self_draft, "accepted_per_step": accepted / (c * len(step_s)),
                     "p50_step_ms": 1e3 * float(np.median(step_s)), "p99_step_ms": 1e3 * float(np.percentile(step_s, 99)),
                     "parts_ms": {k: round(1e3 * float(np.mean(v)), 2) for k, v in parts.items()},
                     "prefill_one_prompt_s": round(prefill_s, 2), "is_distinct_kv": is_distinct})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context-tokens", type=int, default=7936, help="prompt length (a multiple of 16)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=48, help="decode steps per concurrency (2 more are warm-up)")
    ap.add_argument("--distinct", action="store_true",
                    help="copy the prompt's KV blocks per sequence instead of sharing them (no cache sharing)")
    ap.add_argument("--self-draft", type=int, default=0,
                    help="draft this many tokens a step with the model over a small KV view, then verify them "
                         "(speculative method self-sparse at a fixed K; needs exact attention, fp16/fp32 KV)")
    ap.add_argument("--draft-view", default="16,256", help="--self-draft: sinks,window of the KV view")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: `hetserve serve` options")
    args = ap.parse_args()

    from benchmarks.e2e.servers import SMOLLM2
    from loadgen.prompts import DEFAULT_TEXT, PromptBuilder, TargetTokenizer
    from server.launch import build_engine
    from server.config import add_arguments, from_args
    from benchmarks.common import memory_read_gb_s
    from server.hetero import HeteroBackend, kv_capacity_for

    serve = argparse.ArgumentParser()
    add_arguments(serve)
    serve_args = [a for a in args.serve_args if a != "--"]
    cfg = from_args(serve.parse_args(["--max-num-seqs", str(max(args.concurrency)), *serve_args]))
    if cfg.kv_cache_bytes is None:  # room for the prompt and every sequence at SmolLM2's shape, MagicPIG's state too
        seqs = max(args.concurrency) + 1
        cfg = dataclasses.replace(cfg, kv_cache_bytes=kv_capacity_for(
            SMOLLM2, cfg.kv_format, cfg.block_size, seqs, args.context_tokens + (args.steps + 2) * (args.self_draft + 1)
            + 2 * 16, cfg.lsh_config(),
            recent_blocks=seqs))
    engine, _, _ = build_engine(cfg)  # the engine thread is not started: the backend is driven directly
    tok = TargetTokenizer.load(None)
    text = PromptBuilder(tok, Path(DEFAULT_TEXT).read_text(encoding="utf-8"), seed=0).build(args.context_tokens).text
    prompt = tok._tok.encode(text, add_special_tokens=True)[:args.context_tokens]
    sinks, window = (int(v) for v in args.draft_view.split(","))
    rows = run(engine.backend, prompt, args.concurrency, args.steps + 2, is_distinct=args.distinct,
               self_draft=args.self_draft, draft_view=(sinks, window))
    if isinstance(engine.backend, HeteroBackend):  # the model is in this process: the step's read bound
        gb_s = memory_read_gb_s()
        for r in rows:
            weight_bytes = engine.backend.model.step_weight_bytes(r["concurrency"])
            bound_ms = 1e3 * weight_bytes / 1e9 / gb_s
            r.update(weight_mb=round(weight_bytes / 1e6, 1), memory_read_gb_s=round(gb_s, 2),
                     read_bound_ms=round(bound_ms, 2), p50_step_over_bound=round(r["p50_step_ms"] / bound_ms, 2))
            print(f"{r['concurrency']} sequences: {r['weight_mb']} MB of weights a step at {r['memory_read_gb_s']} GB/s "
                  f"(measured now) = {r['read_bound_ms']} ms; p50 step {r['p50_step_ms']:.1f} ms = "
                  f"{r['p50_step_over_bound']}x that bound", flush=True)
    rows = [{**r, "serve_args": " ".join(serve_args)} for r in rows]
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
