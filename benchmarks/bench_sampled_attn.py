"""MagicPIG sampled attention per decode step against exact attention over the same Oaken store
and torch SDPA on fp32 KV, side by side in one run.

    python -m benchmarks.bench_sampled_attn [--batch 1 8 16] [--context 4096 8192 16384 32768]

One layer of SmolLM2-135M (9/3 heads, head_dim 64; `--shape llama-3.1-8b`: 32/8 of 128), keys with a
heavy channel and values from a Gaussian, written through the store; SimHash codes (K bits, L tables)
of the centered keys and the queries from cpu_attn.simhash; 4 sink tokens and a 64-token exact window.
Queries are drawn near a few stored keys (as real attention is peaked), so retrieval finds what it should.
Reports ms, the share of keys sampled beyond the exact part, and sampled / exact-Oaken time, for
each query head retrieving its keys (MagicPIG's "head" retrieval as the paper: L = --lsh-l 150, >= 2
collisions) and, with `group` in --retrieval, for a GQA group sharing the retrieval of its mean query
(`--lsh-retrieval group`, L = --group-lsh-l 300, >= --group-min-collisions 3: the serving default).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.bench_decode_attn import BLOCK, SHAPES, best_of, fill, served_oaken
from benchmarks.common import machine, print_table, write_json
from cpu_attn import lsh
from cpu_attn.simhash import simhash, simhash_matrix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--lsh-k", type=int, default=10)
    ap.add_argument("--lsh-l", type=int, default=150, help="tables with head retrieval")
    ap.add_argument("--group-lsh-l", type=int, default=300, help="tables with group retrieval")
    ap.add_argument("--min-collisions", type=int, default=2, help="tables a key must share with the query, head retrieval")
    ap.add_argument("--group-min-collisions", type=int, default=3, help="the same, group retrieval")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--retrieval", nargs="+", choices=["head", "group"], default=["head", "group"])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="one layer of this model's heads")
    ap.add_argument("--out", default="sampled_attn.json")
    args = ap.parse_args()
    heads, kv_heads, head_dim = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    tables_of = {"head": args.lsh_l, "group": args.group_lsh_l}
    hits_of = {"head": args.min_collisions, "group": args.group_min_collisions}
    scale = head_dim**-0.5
    rows = []
    for context in args.context:
        for batch in args.batch:
            num_blocks = batch * -(-context // BLOCK)
            store = served_oaken(num_blocks, rng, kv_heads, head_dim)
            tables = fill(store, rng, batch, context)
            lens = np.full(batch, context, np.int32)
            keys = [store.gather(0, t, context) for t in tables]
            mu = np.stack([k.mean(0) for k, _ in keys]).astype(np.float32)  # [B, Hkv, D]
            # queries: a stored key of the head's kv-head, scaled up, plus noise
            picks = rng.integers(0, context, (batch, heads))
            q = np.stack([[keys[b][0][picks[b, h], h * kv_heads // heads] * 0.6 + rng.standard_normal(head_dim) * 0.3
                           for h in range(heads)] for b in range(batch)]).astype(np.float32)
            indexed = context - args.window
            first = np.arange(batch * kv_heads, dtype=np.int32).reshape(batch, kv_heads)
            hashed = {"head": q, "group": q.reshape(batch, kv_heads, -1, head_dim).mean(2)}
            row = {"context": context, "batch": batch}
            eligible = context - args.sinks - args.window
            for mode in args.retrieval:
                w = simhash_matrix(head_dim, args.lsh_k, tables_of[mode])
                log_u = lsh.log_u_table(args.lsh_k, tables_of[mode], hits_of[mode])
                sets = [lsh.table_set(simhash(torch.from_numpy(keys[b][0][:indexed, h] - mu[b, h]), w,
                                              args.lsh_k).numpy(), args.lsh_k)
                        for b in range(batch) for h in range(kv_heads)]
                norms = np.stack([np.linalg.norm(keys[b][0][:indexed, h] - mu[b, h], axis=1)
                                  for b in range(batch) for h in range(kv_heads)]).astype(np.float32)
                table_sets = (np.stack([first, first + 1], -1), np.full(batch * kv_heads, indexed, np.int32),
                              np.stack([s[0] for s in sets]), np.stack([s[1] for s in sets]), norms)
                del sets
                q_codes = simhash(torch.from_numpy(hashed[mode]), w, args.lsh_k).numpy()

                def sampled():
                    return store.sampled_decode_attention(0, q, q_codes, tables, lens, scale, table_sets, mu, log_u,
                                                          args.sinks, args.window, hits_of[mode])

                suffix = "" if mode == "head" else "_group"
                row["sampled" + suffix + "_ms"] = best_of(sampled, budget_s=3.0, most=30) * 1e3  # latency-bound
                row["keys_sampled" + suffix + "_frac"] = float(sampled()[2].mean() / eligible)
                row["table_bytes_per_key" + suffix] = float(table_sets[3][0].nbytes + table_sets[2][0].nbytes) / indexed
            t_exact = best_of(lambda: store.decode_attention(0, q, tables, lens, scale))
            k, v = (torch.from_numpy(np.stack([kv[i] for kv in keys]).transpose(0, 2, 1, 3).copy()) for i in (0, 1))
            with torch.inference_mode():
                t_sdpa = best_of(lambda: F.scaled_dot_product_attention(torch.from_numpy(q)[:, :, None], k, v,
                                                                         enable_gqa=True))
            del k, v, keys
            row.update(exact_oaken_ms=t_exact * 1e3, sdpa_fp32_ms=t_sdpa * 1e3)
            for suffix in ("", "_group"):
                if "sampled" + suffix + "_ms" in row:
                    row["sampled" + suffix + "_vs_exact"] = row["sampled" + suffix + "_ms"] / row["exact_oaken_ms"]
            rows.append(row)
            print(f"context {context} batch {batch}: " + ", ".join(f"{key} {val:.4g}" for key, val in row.items()
                                                                  if key not in ("context", "batch")), flush=True)
    print(f"\none layer of {args.shape} (heads {heads}/{kv_heads}, head_dim {head_dim}); K={args.lsh_k}, "
          f"L={args.lsh_l} (head) / {args.group_lsh_l} (group), >= {args.min_collisions} / {args.group_min_collisions} "
          f"collisions, {args.sinks} sinks, "
          f"{args.window}-token window")
    print_table(rows, list(rows[0]))
    print(f"wrote {write_json(args.out, {'machine': machine(), 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
