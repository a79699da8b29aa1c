"""Prefix caching: time to first token with the prefix cache on against off, same requests, in one run.

    PYTHONPATH=. python -m benchmarks.bench_prefix_cache [--doc-tokens 768] [--questions 6] [--turns 6]
    PYTHONPATH=. python -m benchmarks.bench_prefix_cache --doc-tokens 2048 --workloads shared-doc,concurrent \
        --server-args "--kv-format oaken --attention magicpig --kv-cache-bytes 3GiB"   # past MagicPIG's min context

Three workloads where a production server sees the same prompt prefix again:
- shared-doc: requests that share one long document (RAG context, a long system prompt), each with
  its own question after it (completions, token ids), one at a time;
- multi-turn: one chat whose every turn sends the whole conversation so far, the assistant's
  earlier answers included (chat completions);
- concurrent: as shared-doc with another document, all requests sent at once.
Each runs on a fresh server with `--prefix-caching on` and one with `off` (the rest of the flags from
--server-args), alternated --rounds times. Requests are streamed, greedy, --max-tokens each.
Reports TTFT per request, their sum, last and max, the ratio of the sums off / on, the share of
prompt tokens the server took from its cache (usage.prompt_tokens_details.cached_tokens), and
whether the two servers' texts agree. Prints a table, writes JSON and a PNG of TTFT per request.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.bench_loadgen import free_port
from benchmarks.common import RESULTS, WIKITEXT, machine, print_table, start_hetserve, write_json


def stream(url: str, path: str, body: dict) -> dict:
    """One streamed request: seconds to its first text, its text and its usage."""
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                piece = c["delta"].get("content") if "delta" in c else c.get("text")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
    return {"ttft_s": ttft, "text": "".join(text), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def shared_doc(url: str, doc: list[int], questions: list[list[int]], max_tokens: int,
               at_once: bool = False) -> list[dict]:
    def ask(q: list[int]) -> dict:
        return stream(url, "/v1/completions", {"prompt": doc + q, "max_tokens": max_tokens})

    if not at_once:
        return [ask(q) for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(ask, questions))


def multi_turn(url: str, messages: list[str], max_tokens: int) -> list[dict]:
    chat, out = [], []
    for m in messages:
        chat.append({"role": "user", "content": m})
        r = stream(url, "/v1/chat/completions", {"messages": chat, "max_tokens": max_tokens})
        chat.append({"role": "assistant", "content": r["text"]})
        out.append(r)
    return out


def run_server(caching: str, work: dict, args) -> dict:
    port = free_port()
    proc, _ = start_hetserve(port, "--prefix-caching", caching, *args.server_args.split())
    url = f"http://127.0.0.1:{port}"
    runs = {"shared-doc": lambda: shared_doc(url, work["doc"], work["questions"], args.max_tokens),
            "multi-turn": lambda: multi_turn(url, work["messages"], args.max_tokens),
            "concurrent": lambda: shared_doc(url, work["doc2"], work["questions2"], args.max_tokens, at_once=True)}
    try:
        return {name: runs[name]() for name in args.workloads.split(",")}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def plot(best: dict[str, dict[str, list[float]]], path: Path) -> None:
    """best: workload -> {"off", "on"} -> each request's best TTFT over the rounds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(best), figsize=(4.5 * len(best), 3.6), squeeze=False)
    for ax, (name, ttfts) in zip(axes[0], best.items()):
        for caching, style in (("off", "o-"), ("on", "s-")):
            ax.plot(range(1, len(ttfts[caching]) + 1), ttfts[caching], style, label=f"prefix cache {caching}")
        ax.set(title=name, xlabel="request", ylabel="time to first token (s)", ylim=(0, None))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doc-tokens", type=int, default=768, help="shared-doc: tokens of the shared document")
    p.add_argument("--questions", type=int, default=6, help="shared-doc: requests, each with its own question")
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--turns", type=int, default=6, help="multi-turn: user messages")
    p.add_argument("--turn-tokens", type=int, default=96, help="multi-turn: tokens of each user message")
    p.add_argument("--concurrent", type=int, default=8, help="concurrent: requests sent at once")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--workloads", default="shared-doc,multi-turn,concurrent", help="comma-separated, of those three")
    p.add_argument("--rounds", type=int, default=1, help="servers of each kind, alternated; TTFTs are the best")
    p.add_argument("--text", type=Path, default=WIKITEXT)
    p.add_argument("--server-args", default="--kv-cache-bytes 512MiB", help="more `hetserve serve` options")
    p.add_argument("--out", default="prefix_cache.json")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from gpu_model.loader import resolve_model_dir
    from server.config import ServeConfig

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(ServeConfig().model))
    ids = tok.encode(args.text.read_text()[:500_000])
    cuts = iter(range(0, len(ids), 1000))  # each piece of text from its own place

    def piece(n: int) -> list[int]:
        start = next(cuts)
        return ids[start:start + n]

    work = {"doc": piece(args.doc_tokens), "questions": [piece(args.question_tokens) for _ in range(args.questions)],
            "messages": [tok.decode(piece(args.turn_tokens)) for _ in range(args.turns)],
            "doc2": piece(args.doc_tokens), "questions2": [piece(args.question_tokens) for _ in range(args.concurrent)]}
    runs = {"on": {}, "off": {}}
    for i in range(args.rounds):
        for caching in ("off", "on"):
            print(f"round {i + 1}/{args.rounds}: prefix cache {caching} ...", flush=True)
            for name, results in run_server(caching, work, args).items():
                runs[caching].setdefault(name, []).append(results)
    rows, bests = [], {}
    for name in runs["on"]:
        on, off = runs["on"][name], runs["off"][name]
        best = bests[name] = {k: [min(r[i]["ttft_s"] for r in v) for i in range(len(v[0]))]
                              for k, v in (("on", on), ("off", off))}
        prompt = sum(r["prompt_tokens"] for r in on[0])
        rows.append({"workload": name, "requests": len(on[0]), "prompt_tokens": prompt,
                     "cached_share": sum(r["cached_tokens"] for r in on[0]) / prompt,
                     "ttft_sum_off_s": sum(best["off"]), "ttft_sum_on_s": sum(best["on"]),
                     "off_vs_on": sum(best["off"]) / sum(best["on"]),
                     "last_ttft_off_s": best["off"][-1], "last_ttft_on_s": best["on"][-1],
                     "max_ttft_off_s": max(best["off"]), "max_ttft_on_s": max(best["on"]),
                     "texts_equal": sum(a["text"] == b["text"] for a, b in zip(on[0], off[0])),
                     "cached_when_off": sum(r["cached_tokens"] for r in off[0])})
    print_table(rows, ["workload", "requests", "prompt_tokens", "cached_share", "ttft_sum_off_s", "ttft_sum_on_s",
                       "off_vs_on", "last_ttft_off_s", "last_ttft_on_s", "max_ttft_off_s", "max_ttft_on_s",
                       "texts_equal"])
    path = write_json(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                 "rows": rows, "runs": runs})
    png = RESULTS / Path(args.out).with_suffix(".png").name
    plot(bests, png)
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
