"""Structured outputs through HTTP: valid-against-schema rate, TPOT with and without a grammar, compile time.

    PYTHONPATH=. python -m benchmarks.bench_structured [--requests 200] [--concurrency 1,8] [--chunk 40]

20 JSON schemas (flat, nested, arrays, enums, string patterns), --requests chat requests cycling through
them, streamed, temperature 0.7 with a seed per request. Each chunk of requests runs constrained
(response_format json_schema), then again unconstrained with the same prompts, seeds and as many
tokens (max_tokens = the constrained one's completion tokens, ignore_eos), so both see the same batch
sizes and sequence lengths; chunks alternate so that a machine's drift hits both alike.
TPOT is a request's (last token - first token) / (tokens - 1), averaged over requests. Compile times
(cold: the first request of a schema; cached: the rest) and mask time per step come from the server's
/metrics. Prints a table, writes benchmarks/results/structured.json and structured.png.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema

from benchmarks.bench_loadgen import free_port
from benchmarks.common import RESULTS, machine, print_table, start_hetserve, write_json


def _obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required if required is not None else list(props),
            "additionalProperties": False}


S = {"type": "string", "maxLength": 24}
I = {"type": "integer", "minimum": 0, "maximum": 10000}
SCHEMAS = [
    _obj({"name": S, "age": I}),
    _obj({"title": S, "year": I, "rating": {"type": "number", "minimum": 0, "maximum": 10}}),
    _obj({"city": S, "country": S, "population": I}),
    _obj({"is_open": {"type": "boolean"}, "hours": S}),
    _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "price": I}),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{3,10}@[a-z]{3,8}\\.(com|org)$"}, "name": S}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}, "event": S}),
    _obj({"color": {"enum": ["red", "green", "blue", "yellow"]}, "size": {"enum": ["S", "M", "L"]}}),
    _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": I}),
    _obj({"status": {"enum": ["todo", "doing", "done"]}, "task": S, "priority": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 5}}),
    _obj({"tags": {"type": "array", "items": S, "maxItems": 4}}),
    _obj({"scores": {"type": "array", "items": I, "minItems": 1, "maxItems": 5}, "player": S}),
    _obj({"steps": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 2, "maxItems": 4}}),
    _obj({"people": {"type": "array", "items": _obj({"name": S, "age": I}), "maxItems": 3}}),
    _obj({"author": _obj({"first": S, "last": S}), "book": S}),
    _obj({"address": _obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}), "name": S}),
    _obj({"order": _obj({"id": I, "items": {"type": "array", "items": _obj({"sku": S, "qty": I}), "maxItems": 3}})}),
    _obj({"a": _obj({"b": _obj({"c": _obj({"d": S})})})}),
    _obj({"name": S, "nickname": S, "age": I}, required=["name"]),
    _obj({"kind": {"enum": ["cat", "dog"]}, "owner": _obj({"name": S, "phone": {"type": "string",
                                                                                 "pattern": "^[0-9]{3}-[0-9]{4}$"}})}),
]
TOPICS = ["a person", "a movie", "a city", "a shop", "a product", "a contact", "an event", "a t-shirt", "a review",
          "a task", "a blog post", "a game", "a recipe", "a team", "a book", "a customer", "an order", "a tree",
          "a friend", "a pet"]


def run(url: str, body: dict) -> dict:
    """One streamed chat request: its text, completion tokens, and seconds from its first to its last token."""
    first = last = None
    text = []
    usage = {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                if c["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(c["delta"]["content"])
    n = usage.get("completion_tokens", 0)
    return {"text": "".join(text), "tokens": n, "tpot_s": (last - first) / (n - 1) if first and n > 1 else None}


def requests(n: int) -> list[dict]:
    out = []
    for i in range(n):
        k = i % len(SCHEMAS)
        out.append({"schema": k, "body": {
            "messages": [{"role": "user", "content": f"Describe {TOPICS[k]} as JSON."}], "max_tokens": 300,
            "temperature": 0.7, "seed": i}})
    return out


def constrained(req: dict) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{req['schema']}", "schema": SCHEMAS[req["schema"]]}}
    return {**req["body"], "response_format": fmt}


def is_valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def bench(url: str, reqs: list[dict], concurrency: int, chunk: int) -> dict:
    """Each chunk constrained, then unconstrained; the ratio of their TPOTs per chunk too (its median is what a
    machine shared with other work changes least)."""
    with_g, without, ratios = [], [], []
    with ThreadPoolExecutor(concurrency) as pool:
        for start in range(0, len(reqs), chunk):
            part = reqs[start:start + chunk]
            got = list(pool.map(lambda r: run(url, constrained(r)), part))
            free = [{**r["body"], "max_tokens": max(1, g["tokens"]), "ignore_eos": True} for r, g in zip(part, got)]
            with_g += [{**g, "valid": is_valid(g["text"], SCHEMAS[r["schema"]])} for r, g in zip(part, got)]
            plain = list(pool.map(lambda b: run(url, b), free))
            without += plain
            ratios.append(_mean([g["tpot_s"] for g in got]) / _mean([f["tpot_s"] for f in plain]))
    tpot_g, tpot_f = _mean([g["tpot_s"] for g in with_g]), _mean([f["tpot_s"] for f in without])
    return {"concurrency": concurrency, "requests": len(reqs), "valid_rate": _mean([g["valid"] for g in with_g]),
            "tokens_mean": _mean([g["tokens"] for g in with_g]), "tpot_constrained_ms": tpot_g * 1e3,
            "tpot_unconstrained_ms": tpot_f * 1e3, "tpot_ratio": tpot_g / tpot_f,
            "tpot_ratio_chunk_median": sorted(ratios)[len(ratios) // 2], "chunk_ratios": ratios,
            "invalid": [g["text"] for g in with_g if not g["valid"]][:5]}


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["tpot_unconstrained_ms"] for r in rows], 0.4, label="unconstrained")
    ax.bar([x + 0.2 for x in xs], [r["tpot_constrained_ms"] for r in rows], 0.4, label="JSON schema (cached)")
    ax.set_xticks(list(xs), [f"concurrency {r['concurrency']}\nvalid {r['valid_rate']:.0%}" for r in rows])
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("Structured outputs: time per output token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--chunk", type=int, default=40, help="requests per alternation of constrained / unconstrained")
    ap.add_argument("--server-args", default="", help="more `hetserve serve` flags")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, _ = start_hetserve(port, *args.server_args.split())
    try:
        rows = [bench(url, requests(args.requests), int(c), args.chunk) for c in args.concurrency.split(",")]
        p = "hetserve:grammar_compile_seconds"
        compile_ms = {kind: 1e3 * metric(url, f'{p}_sum{{cached="{kind}"}}') /
                      max(1.0, metric(url, f'{p}_count{{cached="{kind}"}}')) for kind in ("false", "true")}
        mask_ms = 1e3 * metric(url, "hetserve:grammar_mask_seconds_sum") / max(1.0, metric(
            url, "hetserve:grammar_mask_seconds_count"))
    finally:
        proc.terminate()
        proc.wait(60)
    print_table(rows, ["concurrency", "requests", "valid_rate", "tokens_mean", "tpot_unconstrained_ms",
                       "tpot_constrained_ms", "tpot_ratio", "tpot_ratio_chunk_median"])
    print(f"compile: cold {compile_ms['false']:.2f} ms, cached {compile_ms['true']:.3f} ms; "
          f"masks {mask_ms:.3f} ms per step")
    out = write_json("structured.json", {"machine": machine(), "args": vars(args), "rows": rows,
                                    "compile_cold_ms": compile_ms["false"], "compile_cached_ms": compile_ms["true"],
                                    "mask_ms_per_step": mask_ms, "num_schemas": len(SCHEMAS)})
    plot(rows, RESULTS / "structured.png")
    print(f"wrote {out} and {RESULTS / 'structured.png'}")


if __name__ == "__main__":
    main()
