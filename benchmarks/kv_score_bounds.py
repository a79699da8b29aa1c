"""What a sparse layer's kept set could give at best, and how well the prompt's own attention predicts it.

Layered KV sparsity (docs/kv-policy.md) keeps, in every layer past the full ones, the sinks, a recent
window and `budget - window - sinks` prompt tokens chosen at the prompt's end. This runs the bundled
model over WikiText-2 windows with plain torch (dense float32 linears, exact attention; no paged
store): the prompt exactly, then the last `--decode-tokens` of each window teacher-forced, with the
sparse layers' decode queries restricted to a kept set, and reports the perplexity of those tokens
against the full cache's:

  oracle       each decode query its own best `budget` keys (top of its attention pooled over the kv-head's
               query heads): no set chosen in advance does better
  hindsight    one set of prompt tokens for all decode queries, ranked by what those queries attended with
               the full cache (+ sinks + window): the best fixed choice
  last A       ranked by the attention of the prompt's last A queries (--kv-observe A)
  mean         ranked by the mean attention each token received from the prompt queries after it

Kept sets are per layer and kv-head, as the layered worker keeps them; the window moves with each
decode query. Table, JSON and PNG (kv_score_bounds.*).
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS, WIKITEXT, machine, print_table, write_json
from cpu_attn.calibrate import text_windows
from gpu_model.loader import load_model, resolve_model_dir
from gpu_model.tokenizer import Tokenizer

CHUNK = 512  # prompt queries a matmul


class Bounds:
    def __init__(self, model, prompt: int, decode: int, full_layers: int, budget: int, window: int, sinks: int):
        self.model, self.cfg = model, model.cfg
        self.P, self.D, self.full, self.budget, self.window, self.sinks = (prompt, decode, full_layers, budget,
                                                                           window, sinks)
        self.Hk = self.cfg.num_kv_heads
        self.G = self.cfg.num_heads // self.Hk

    def prompt(self, ids: list[int], observe: list[int]) -> tuple[list, list[dict]]:
        """Exact prompt pass -> per layer (K, V) [Hkv, P, D] and the prompt-side scores [Hkv, P] by name."""
        m, P, Hk, G, Dh = self.model, self.P, self.Hk, self.G, self.cfg.head_dim
        x = m.embed(torch.tensor(ids[:P]))
        cos, sin = m.rope(torch.arange(P))
        kv, scores = [], []
        for i in range(self.cfg.num_layers):
            q, k, v = m.pre_attention(i, x, cos, sin)
            qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            ke, ve = kh.repeat_interleave(G, 0), vh.repeat_interleave(G, 0)
            kv.append((kh.clone(), vh.clone()))
            got = {f"last {a}": torch.zeros(Hk, P) for a in observe} | {"mean": torch.zeros(Hk, P)}
            outs = []
            for c0 in range(0, P, CHUNK):
                c1 = min(P, c0 + CHUNK)
                s = (qh[:, c0:c1] @ ke.transpose(1, 2)) / math.sqrt(Dh)
                p = s.masked_fill(torch.arange(P)[None, :] > torch.arange(c0, c1)[:, None], float("-inf")).softmax(-1)
                outs.append(p @ ve)
                pk = p.view(Hk, G, c1 - c0, P).sum(1)  # [Hk, queries, P]
                got["mean"] += pk.sum(1)
                for a in observe:
                    lo = max(c0, P - a)
                    if lo < c1:
                        got[f"last {a}"] += pk[:, lo - c0:].sum(1)
            got["mean"] /= (P - torch.arange(P)).float()
            scores.append(got)
            x = m.post_attention(i, x, torch.cat(outs, 1).transpose(0, 1).reshape(P, -1))
        return kv, scores

    def decode(self, ids: list[int], kv: list, sets: str | list | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Teacher-forced decode of the last D tokens; the sparse layers' queries see the sinks, their window
        and `sets`: None every row, "oracle" each query's best keys, else per layer the kept prompt rows
        [Hkv, P] bool. -> log-probs [D - 1, vocab] and, per layer, the attention the decode queries give the
        prompt's rows before any restriction [Hkv, P] (the hindsight ranking, from the full cache's pass)."""
        m, P, D, Hk, G, Dh = self.model, self.P, self.D, self.Hk, self.G, self.cfg.head_dim
        T = P + D
        x = m.embed(torch.tensor(ids[P:T]))
        cos, sin = m.rope(torch.arange(P, T))
        pos, qpos = torch.arange(T), P + torch.arange(D)
        causal = pos[None, :] <= qpos[:, None]  # [D, T]
        recent = causal & ((pos[None, :] > qpos[:, None] - self.window) | (pos[None, :] < self.sinks))
        attended = []
        for i in range(self.cfg.num_layers):
            q, k, v = m.pre_attention(i, x, cos, sin)
            ke = torch.cat([kv[i][0], k.transpose(0, 1)], 1).repeat_interleave(G, 0)
            ve = torch.cat([kv[i][1], v.transpose(0, 1)], 1).repeat_interleave(G, 0)
            s = (q.transpose(0, 1) @ ke.transpose(1, 2)) / math.sqrt(Dh)  # [Hq, D, T]
            s = s.masked_fill(~causal, float("-inf"))
            p = s.softmax(-1)
            pooled = p.view(Hk, G, D, T).sum(1)  # [Hk, D, T]
            attended.append(pooled.sum(1)[:, :P])
            if sets is not None and i >= self.full:
                if sets == "oracle":  # each query's own top keys, sinks and window first
                    rank = pooled.masked_fill(recent[None], float("inf")).masked_fill(~causal[None], float("-inf"))
                    allowed = torch.zeros_like(pooled, dtype=torch.bool)
                    allowed.scatter_(-1, rank.topk(min(self.budget, T), -1).indices, True)
                    allowed &= causal[None]
                else:
                    prompt_rows = torch.cat([sets[i], torch.zeros(Hk, D, dtype=torch.bool)], 1)
                    allowed = recent[None] | (prompt_rows[:, None, :] & causal[None])
                p = s.masked_fill(~allowed.repeat_interleave(G, 0), float("-inf")).softmax(-1)
            x = m.post_attention(i, x, (p @ ve).transpose(0, 1).reshape(D, -1))
        return F.log_softmax(m.logits(x[:-1]), -1), attended

    def chosen(self, score: torch.Tensor) -> torch.Tensor:
        """The prompt rows a fixed set keeps besides the sinks and the window: the best `budget - window -
        sinks` by score, per kv-head -> [Hkv, P] bool."""
        rank = score.clone()
        rank[:, :self.sinks] = float("-inf")
        keep = torch.zeros(self.Hk, self.P, dtype=torch.bool)
        keep.scatter_(-1, rank.topk(self.budget - self.window - self.sinks, -1).indices, True)
        return keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-tokens", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=512)
    ap.add_argument("--num-windows", type=int, default=2)
    ap.add_argument("--budget", type=int, default=1344, help="rows a sparse layer keeps (sinks and window included)")
    ap.add_argument("--full-layers", type=int, default=3)
    ap.add_argument("--kv-window", type=int, default=512)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--observe", type=int, nargs="+", default=[32, 512, 1024, 2048])
    ap.add_argument("--text", type=Path, default=WIKITEXT)
    ap.add_argument("--name", default="kv_score_bounds")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model_dir = resolve_model_dir(None)
    model = load_model(model_dir, gguf_blocks_max_tokens=0)
    windows = text_windows(Tokenizer(model_dir, ()).encode(args.text.read_text()), args.num_windows,
                           args.window_tokens)
    b = Bounds(model, args.window_tokens - args.decode_tokens, args.decode_tokens, args.full_layers, args.budget,
               args.kv_window, args.sinks)
    names = ["oracle", "hindsight", *(f"last {a}" for a in args.observe), "mean"]
    nll = dict.fromkeys(["full", *names], 0.0)
    kl = dict.fromkeys(names, 0.0)
    for n, w in enumerate(windows):
        t0 = time.perf_counter()
        kv, scores = b.prompt(w, args.observe)
        ref, attended = b.decode(w, kv, None)
        target = torch.tensor(w[b.P + 1:])
        rows = torch.arange(len(target))
        nll["full"] -= ref[rows, target].sum().item()
        for name in names:
            if name == "oracle":
                sets = "oracle"
            else:
                src = attended if name == "hindsight" else [s[name] for s in scores]
                sets = [None if i < b.full else b.chosen(src[i]) for i in range(len(src))]
            lp, _ = b.decode(w, kv, sets)
            nll[name] -= lp[rows, target].sum().item()
            kl[name] += (ref.exp() * (ref - lp)).sum().item()
        print(f"window {n + 1}/{len(windows)}: {time.perf_counter() - t0:.0f} s", flush=True)
    count = len(windows) * (args.decode_tokens - 1)
    full = math.exp(nll["full"] / count)
    table = [{"kept set": "full cache", "ppl": full, "vs_full_pct": 0.0, "kl": 0.0}]
    for name in names:
        ppl = math.exp(nll[name] / count)
        table.append({"kept set": name, "ppl": ppl, "vs_full_pct": 100 * (ppl / full - 1), "kl": kl[name] / count})
    print_table(table, ["kept set", "ppl", "vs_full_pct", "kl"])
    path = write_json(f"{args.name}.json", {"machine": machine(), "args": {**vars(args), "text": str(args.text)},
                                            "rows": table})
    plot(table, RESULTS / f"{args.name}.png", args)
    print(f"wrote {path} and {args.name}.png")


def plot(rows: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["kept set"] for r in rows[1:]]
    ax.bar(names, [r["vs_full_pct"] for r in rows[1:]], color="tab:blue")
    ax.axhline(3.0, color="tab:red", linestyle="--", label="+3 %")
    ax.set_ylabel("perplexity vs full cache (%)")
    ax.set_title(f"{args.window_tokens}-token windows, budget {args.budget}, window {args.kv_window}, "
                 f"{args.full_layers} full layers", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
