"""Speculative decoding against none, through HTTP, as a user runs it: one `hetserve serve` (the default
configuration) per method, all running at once, the same requests sent to each in turn.

    python -m benchmarks.bench_speculative                      # the standard grid, ~15 min on 2 cores
    python -m benchmarks.bench_speculative --contexts 256 --concurrency 1

Cells: text kind (chat: answers to chat questions; grounded: rewriting a given WikiText passage, which
the answer quotes; wikitext: plain continuation) x context (prompt tokens; chat prompts are their own
length) x streams x temperature. Each cell sends `concurrency` requests at once, `--rounds` times, every
request with its own prompt; each round's batch goes to every method's server in turn (the order rotating
by round), the others idle meanwhile, so that the machine's drift (a busy neighbour) falls on all alike.
A request streams up to `--output-tokens` tokens (wikitext: exactly that many, ignore_eos); with
--cached-prompts every server has seen the cell's prompts before it is timed (prefix cache). Per cell:
output tok/s over the cell's wall time, decode tok/s per stream (tokens after the first over the time
after the first), TTFT p50, and the drafts' acceptance from the server's /metrics.
Table, JSON and PNG in benchmarks/results/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.common import RESULTS, WIKITEXT, machine, print_table, start_hetserve, write_json
from loadgen.server_metrics import read_counters, speculation_summary

CHAT_QUESTIONS = [
    "What are three good habits for staying healthy? Explain each briefly.",
    "Explain how a bicycle works to a ten-year-old.",
    "Write a short story about a cat who learns to swim.",
    "What is the difference between weather and climate?",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Answer in a few sentences.",
    "List some tips for learning a new language.",
    "Describe the water cycle step by step.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a computer program is.",
    "Write a polite email asking a colleague for help with a report.",
    "How do plants make their food?",
    "What are the planets of the solar system? Say one thing about each.",
    "Give advice to someone starting their first job.",
    "Summarize the story of Little Red Riding Hood.",
    "How can I save money on groceries?",
]
GROUNDED = "Rewrite the following text, keeping its wording but fixing any mistakes.\n\nText: {passage}\n\nRewritten text:"


def passages(tokenizer, n: int, num_tokens: int) -> list[str]:
    """n WikiText-2 test windows of about num_tokens tokens, as text."""
    ids = tokenizer.encode(WIKITEXT.read_text()[:2_000_000])
    step = max(num_tokens, (len(ids) - num_tokens) // n)
    return [tokenizer.decode(ids[i * step:i * step + num_tokens]) for i in range(n)]


def requests_for(kind: str, context: int, n: int, tokenizer, output_tokens: int, temperature: float) -> list[tuple]:
    """[(path, body)] of n distinct requests of a cell."""
    common = {"max_tokens": output_tokens, "temperature": temperature, "stream": True, "seed": 0,
              "stream_options": {"include_usage": True}}
    if kind == "chat":
        return [("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": q}]})
                for q in (CHAT_QUESTIONS * (n // len(CHAT_QUESTIONS) + 1))[:n]]
    if kind == "grounded":
        texts = passages(tokenizer, n, context - 40)
        return [("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": GROUNDED.format(passage=t)}]})
                for t in texts]
    texts = passages(tokenizer, n, context)
    return [("/v1/completions", {**common, "prompt": t, "ignore_eos": True}) for t in texts]


async def one(client: httpx.AsyncClient, url: str, path: str, body: dict) -> dict:
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            if first is None and (choice.get("text") or choice.get("delta", {}).get("content")):
                first = time.perf_counter()  # the first token (chat's first chunk only names the role)
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "decode_s": end - (first or end), "tokens": tokens}


async def run_cell(url: str, reqs: list[tuple], concurrency: int) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(timeout=1800) as client:
        t0 = time.perf_counter()
        done = []
        for i in range(0, len(reqs), concurrency):
            done += await asyncio.gather(*(one(client, url, p, b) for p, b in reqs[i:i + concurrency]))
        return done, time.perf_counter() - t0


def cell_metrics(done: list[dict], wall_s: float) -> dict:
    decode = [(d["tokens"] - 1) / d["decode_s"] for d in done if d["tokens"] > 1 and d["decode_s"] > 0]
    return {"output_tok_s": sum(d["tokens"] for d in done) / wall_s,
            "decode_tok_s_per_stream": statistics.median(decode) if decode else None,
            "ttft_p50_ms": 1e3 * statistics.median(d["ttft_s"] for d in done),
            "mean_output_tokens": statistics.mean(d["tokens"] for d in done), "wall_s": wall_s}


def cells(args) -> list[tuple[str, int, int, float]]:
    out = []
    for kind in args.kinds:
        for context in ([min(args.contexts)] if kind == "chat" else args.contexts):
            for c in args.concurrency:
                if context > 1024 and c > 1 and not args.long_batches:
                    continue  # prefilling several long prompts takes minutes on 2 cores: --long-batches
                for t in args.temperatures:
                    out.append((kind, context, c, t))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="off,ngram,self-sparse", type=lambda s: s.split(","))
    ap.add_argument("--kinds", default="chat,grounded,wikitext", type=lambda s: s.split(","))
    ap.add_argument("--contexts", default="256,4096", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--concurrency", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--temperatures", default="0,0.7", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="batches of `concurrency` requests per cell")
    ap.add_argument("--long-batches", action="store_true", help="also run contexts > 1024 at concurrency > 1")
    ap.add_argument("--cached-prompts", action="store_true",
                    help="before a cell is timed, send each server its requests with max_tokens 1, so that the timed "
                         "ones find their prompts in the prefix cache: the cell measures decoding (documents a "
                         "server has seen before); the KV cache must hold the cell's prompts")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--serve-args", default="", help="extra `hetserve serve` flags for every method")
    ap.add_argument("--speculative-model", help="method draft-model: the model that drafts (--speculative-model)")
    ap.add_argument("--name", default="bench_speculative", help="results file names (JSON, PNG) without suffix")
    args = ap.parse_args()

    from gpu_model.loader import resolve_model_dir
    from gpu_model.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model_dir(None, Path("~/.cache/hetserve/models").expanduser()), ())
    grid = cells(args)
    results, servers = [], {}
    try:
        for j, method in enumerate(args.methods):
            draft = ("--speculative-model", args.speculative_model) if method == "draft-model" else ()
            proc, ready_s = start_hetserve(args.port + j, "--speculative-method", method, *draft,
                                           *args.serve_args.split())
            servers[method] = (proc, f"http://127.0.0.1:{args.port + j}")
            print(f"{method}: ready in {ready_s:.0f} s", flush=True)
        for i, (kind, context, c, t) in enumerate(grid):
            reqs = requests_for(kind, context, c * args.rounds, tokenizer, args.output_tokens, t)
            if args.cached_prompts:
                for _, url in servers.values():
                    asyncio.run(run_cell(url, [(p, {**b, "max_tokens": 1}) for p, b in reqs], c))
            before = {m: read_counters(url) for m, (_, url) in servers.items()}
            done, wall = {m: [] for m in servers}, dict.fromkeys(servers, 0.0)
            for r in range(args.rounds):
                first = r % len(args.methods)
                for m in args.methods[first:] + args.methods[:first]:
                    got, seconds = asyncio.run(run_cell(servers[m][1], reqs[r * c:(r + 1) * c], c))
                    done[m] += got
                    wall[m] += seconds
            cell = []
            for m, (_, url) in servers.items():
                spec = speculation_summary(before[m], read_counters(url))
                cell.append({"method": m, "kind": kind, "context": context, "streams": c, "temperature": t,
                             **cell_metrics(done[m], wall[m]), "acceptance": spec.get("spec_decode_acceptance_rate"),
                             "accept_len": spec.get("spec_decode_mean_acceptance_length")})
            results += cell
            print(f"  [{i + 1}/{len(grid)}] {kind} {context} x{c} T={t}: "
                  + ", ".join(f"{r['method']} {r['output_tok_s']:.1f}" for r in cell) + " tok/s", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    base = {(r["kind"], r["context"], r["streams"], r["temperature"]): r for r in results if r["method"] == "off"}
    for r in results:
        b = base.get((r["kind"], r["context"], r["streams"], r["temperature"]))
        r["speedup"] = r["output_tok_s"] / b["output_tok_s"] if b else None
    cols = ["method", "kind", "context", "streams", "temperature", "output_tok_s", "decode_tok_s_per_stream",
            "ttft_p50_ms", "mean_output_tokens", "acceptance", "accept_len", "speedup"]
    print_table(results, cols)
    info = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "args": {k: v for k, v in vars(args).items()},
            "rows": results}
    path = write_json(f"{args.name}.json", info)
    plot(results, RESULTS / f"{args.name}.png")
    print(f"wrote {path} and {RESULTS / (args.name + '.png')}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in rows if r["method"] != "off" and r["speedup"] is not None]
    if not spec:
        return
    labels = [f"{r['kind']}\n{r['context']} x{r['streams']}\nT={r['temperature']:g}" for r in spec]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(spec)), 4))
    ax.bar(range(len(spec)), [r["speedup"] for r in spec], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(range(len(spec)), labels, fontsize=7)
    ax.set_ylabel("output tok/s vs speculation off")
    ax.set_title("Speculative decoding (" + ", ".join(sorted({r["method"] for r in spec})) + "), through HTTP")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
