"""How far n-gram speculation can go on this machine: the default backend's greedy outputs replayed under
draft policies, priced by the measured cost of each step size.

    python -m benchmarks.spec_replay --num-prompts 16 --output-tokens 256

1. Costs: the default `hetserve serve` backend, built in this process, decodes one sequence at `--context`
   tokens with 0..15 draft tokens a step (medians of `--repeats` steps, sizes interleaved): what a row of
   verification adds to a step.
2. Outputs: each prompt's greedy continuation without speculation (bench_speculative's chat, grounded and
   wikitext prompts), up to `--output-tokens` tokens.
3. Replay: the server's NgramDrafter proposes after every step; a draft is accepted while it matches the
   output (greedy verification accepts exactly that); a step costs the measured time of its size. Policies:
   `policy K` = the server's SpecPolicy sizing drafts of at most K (fed the measured costs), `fixed K` =
   every proposal sent up to K, `oracle` = exactly the drafts that will be accepted (the bound of any
   policy over these drafts).

Speed-up = emitted tokens x the 1-token step's cost / the replayed time: decode steps only (no prefill,
scheduler, HTTP). Table, JSON and PNG in benchmarks/results/.
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.bench_speculative import requests_for
from benchmarks.common import RESULTS, machine, print_table, write_json

SIZES = (1, 2, 3, 4, 5, 7, 9, 13, 16)
"""Step sizes (tokens: one plus the drafts) whose cost is measured; the others are interpolated."""


def step_costs(backend, prompt: list[int], repeats: int) -> dict[int, float]:
    """Seconds of a one-sequence decode step with n - 1 drafts after `prompt`, for n in SIZES."""
    from hetcore.backend import SamplingParams, SeqChunk, StepInput

    greedy, bs, ctx = SamplingParams(temperature=0.0), backend.kv_spec.block_size, len(prompt)
    table = tuple(range((ctx + max(SIZES)) // bs + 1))
    first = backend.step(StepInput((SeqChunk(0, tuple(prompt), 0, table, greedy),))).sampled[0]
    samples: dict[int, list[float]] = {n: [] for n in SIZES}
    for rep in range(repeats + 2):  # two warm-up rounds
        for n in SIZES:
            tokens = (first, *prompt[1:n])
            chunk = SeqChunk(0, tokens, ctx, table[:(ctx + n - 1) // bs + 1], greedy, 0, num_draft=n - 1)
            t0 = time.perf_counter()
            backend.step(StepInput((chunk,)))
            if rep >= 2:
                samples[n].append(time.perf_counter() - t0)
    backend.step(StepInput((), freed_seq_ids=(0,)))
    return {n: statistics.median(v) for n, v in samples.items()}


def greedy_output(backend, seq_id: int, prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
    from hetcore.backend import SamplingParams, SeqChunk, StepInput

    greedy, bs = SamplingParams(temperature=0.0), backend.kv_spec.block_size
    table = tuple(range((len(prompt) + max_tokens) // bs + 1))
    out = [backend.step(StepInput((SeqChunk(seq_id, tuple(prompt), 0, table, greedy),))).sampled[seq_id]]
    while len(out) < max_tokens and out[-1] != eos:
        pos = len(prompt) + len(out) - 1
        step = StepInput((SeqChunk(seq_id, (out[-1],), pos, table[:pos // bs + 1], greedy, len(out)),))
        out.append(backend.step(step).sampled[seq_id])
    backend.step(StepInput((), freed_seq_ids=(seq_id,)))
    return out


def interpolate(costs: dict[int, float], n: int) -> float:
    if n in costs:
        return costs[n]
    below, above = max(k for k in costs if k < n), min((k for k in costs if k > n), default=None)
    if above is None:
        return costs[below] + (costs[below] - costs[1]) / (below - 1) * (n - below)
    return costs[below] + (costs[above] - costs[below]) * (n - below) / (above - below)


def replay(prompt: list[int], output: list[int], costs: dict[int, float], policy: str, k: int) -> tuple[float, float]:
    """-> (seconds of the replayed steps, tokens a step) for one output under `policy` (module docstring)."""
    from server.speculative import NgramDrafter, SpecPolicy

    drafter, sizer = NgramDrafter(2, 4), SpecPolicy(max_tokens=k)
    sizer.step_s.update({n: interpolate(costs, n) for n in range(1, k + 2)})
    tokens, done, seconds, steps = list(prompt), 0, 0.0, 0
    while done < len(output):
        proposal = drafter.propose(0, tokens, k)
        matched = next((i for i, t in enumerate(proposal) if done + i >= len(output) or t != output[done + i]),
                       len(proposal))
        if policy == "oracle":
            send = matched
        elif policy == "fixed":
            send = len(proposal)
        else:
            send = sizer.plan(1, 1, [(sizer.rate(0), len(proposal))], k)[0] if proposal else 0
        accepted = min(matched, send)
        if send:
            sizer.observe_drafts(0, send, accepted)
        elif proposal:
            sizer.observe_drafts(0, 1, int(matched > 0))
        emitted = min(accepted + 1, len(output) - done)
        tokens += output[done:done + emitted]
        done += emitted
        seconds += interpolate(costs, 1 + send)
        steps += 1
    return seconds, len(output) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts of each kind")
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens (grounded, wikitext) and the costs' context")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--name", default="spec_replay")
    args = ap.parse_args()

    from loadgen.prompts import TargetTokenizer
    from server.config import ServeConfig
    from server.launch import build_engine

    engine, _, _ = build_engine(ServeConfig(max_num_seqs=4))  # the default configuration; the thread not started
    backend, hf = engine.backend, TargetTokenizer.load(None)._tok

    class Words:  # what bench_speculative's prompt builders call
        encode = staticmethod(lambda s: hf.encode(s, add_special_tokens=False))
        decode = staticmethod(hf.decode)

    outputs = []
    for kind in ("chat", "grounded", "wikitext"):
        for i, (_, body) in enumerate(requests_for(kind, args.context, args.num_prompts, Words, args.output_tokens, 0)):
            if "messages" in body:
                text = hf.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
                prompt = hf.encode(text, add_special_tokens=False)  # as the server's chat route
            else:
                prompt = hf.encode(body["prompt"])
            eos = None if kind == "wikitext" else hf.eos_token_id
            outputs.append((kind, prompt, greedy_output(backend, 1 + i, prompt, args.output_tokens, eos)))
        print(f"{kind}: {args.num_prompts} greedy outputs", flush=True)
    costs = step_costs(backend, outputs[-1][1][:args.context], args.repeats)
    print("step ms by tokens: " + ", ".join(f"{n}: {1e3 * s:.2f}" for n, s in costs.items()), flush=True)

    rows = []
    for kind in ("chat", "grounded", "wikitext"):
        mine = [(p, o) for k, p, o in outputs if k == kind]
        num_tokens = sum(len(o) for _, o in mine)
        for policy, k in (("policy", 4), ("policy", 8), ("policy", 16), ("fixed", 4), ("fixed", 8),
                          ("oracle", 8), ("oracle", 16)):
            runs = [replay(p, o, costs, policy, k) for p, o in mine]
            rows.append({"kind": kind, "policy": policy, "k": k, "output_tokens": num_tokens,
                         "speedup": num_tokens * costs[1] / sum(s for s, _ in runs),
                         "tokens_per_step": statistics.mean(t for _, t in runs)})
    print_table(rows, ["kind", "policy", "k", "output_tokens", "speedup", "tokens_per_step"])
    path = write_json(args.name + ".json", {"machine": machine(), "args": vars(args),
                                  "step_ms": {n: 1e3 * s for n, s in costs.items()}, "rows": rows})
    plot(rows, costs, RESULTS / (args.name + ".png"))
    print(f"wrote {path} and {RESULTS / (args.name + '.png')}")


def plot(rows: list[dict], costs: dict[int, float], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = sorted(costs)
    left.plot(sizes, [1e3 * costs[n] for n in sizes], marker="o")
    left.set_xlabel("tokens in the step (1 + drafts)")
    left.set_ylabel("decode step ms")
    left.set_title("Cost of a step by its size")
    labels = [f"{r['policy']} {r['k']}" for r in rows if r["kind"] == "chat"]
    width = 0.27
    for j, kind in enumerate(("chat", "grounded", "wikitext")):
        vals = [r["speedup"] for r in rows if r["kind"] == kind]
        right.bar([i + (j - 1) * width for i in range(len(vals))], vals, width, label=kind)
    right.axhline(1.0, color="gray", lw=1)
    right.set_xticks(range(len(labels)), labels, fontsize=7)
    right.set_ylabel("decode speed-up (replayed)")
    right.set_title("n-gram drafts replayed over greedy outputs")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
