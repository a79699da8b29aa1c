"""`hetserve loadgen replay|synth|compare`: drive any OpenAI-compatible endpoint and report."""
from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from loadgen.arrivals import LENGTH_DISTS, LengthDist, clip_lengths, rescale, synth_requests
from loadgen.client import APIS, Endpoint
from loadgen.compare import RunDirError, compare
from loadgen.metrics import parse_slo, summarize
from loadgen.server_metrics import read_counters, speculation_summary
from loadgen.prompts import DEFAULT_TEXT, PromptBuilder, PromptError, TargetTokenizer
from loadgen.report import format_summary, write_report
from loadgen.runner import make_specs, run_requests, served_model
from loadgen.traces import TRACE_FORMATS, TraceFilter, TraceFormatError, TraceRequest, apply_filter, read_trace

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_USAGE = 0, 1, 2


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api", choices=APIS, default="completions",
                   help="completions (/v1/completions) or chat (/v1/chat/completions) (default: completions)")
    p.add_argument("--model", help="the request's model field (default: the first id of GET /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--tokenizer", help="tokenizer or model directory, or .gguf file, of the served model; prompts get "
                                       "exactly the trace's token counts with it (default: hetserve's bundled model)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="text the prompts are cut from (default: WikiText-2 test)")
    p.add_argument("--max-prompt-tokens", type=int, help="clip prompt lengths to this (e.g. the model's context)")
    p.add_argument("--max-output-tokens", type=int, help="clip output lengths (max_tokens) to this")
    p.add_argument("--max-concurrency", type=int, 
                   help="at most N requests in flight; later arrivals wait in the client")
    p.add_argument("--slo", help="goodput SLOs in ms, e.g. ttft_ms=500,tpot_ms=50 (also e2el_ms)")
    p.add_argument("--out", help="directory for summary.json, requests.csv and PNG plots")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject it); outputs may then end early")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per-request limit in s (default: 3600)")
    p.add_argument("--seed", type=int, default=0, help="seed for prompt text positions and synthetic draws")
    p.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="every prompt longer than this starts with the same this many tokens of text (a shared "
                        "system prompt or document, for servers' prefix caches); lengths still include it (default: 0)")


def register(sub) -> None:
    """Add `loadgen` with its subcommands to `hetserve`'s subparsers."""
    p = sub.add_parser("loadgen", help="replay traces or synthetic load against an OpenAI-compatible server",
                       description="Load generator: open-loop trace replay and synthetic workloads against any "
                                   "OpenAI-compatible server, with vLLM bench-serve metrics, goodput and plots.")
    lsub = p.add_subparsers(dest="loadgen_command", required=True)
    rp = lsub.add_parser("replay", help="replay an Azure or BurstGPT trace at its own timestamps")
    rp.add_argument("trace", metavar="FILE", help="trace CSV")
    rp.add_argument("--trace-format", choices=TRACE_FORMATS, required=True, help="azure or burstgpt column layout")
    rp.add_argument("--trace-model", help="BurstGPT: keep rows of this Model (e.g. ChatGPT, GPT-4)")
    rp.add_argument("--log-type", help="BurstGPT: keep rows whose Log Type contains this (e.g. api, conversation)")
    rp.add_argument("--start-s", type=float, help="keep rows from this many s after the trace's first row")
    rp.add_argument("--end-s", type=float, help="keep rows before this many s after the trace's first row")
    rp.add_argument("--max-requests", type=int, help="keep the first N rows (after the other filters)")
    rp.add_argument("--time-scale", type=float, default=1.0, help="multiply inter-arrival gaps by X (0.1: 10x faster)")
    rp.add_argument("--rate", type=float, help="instead of --time-scale: rescale gaps to a mean of R requests/s")
    rp.add_argument("--show-bad-rows", type=int, default=10, help="print at most N skipped rows (default: 10)")
    _add_run_arguments(rp)
    rp.set_defaults(func=replay_command)
    sp = lsub.add_parser("synth", help="synthetic workload: Poisson/gamma arrivals, Zipf/uniform/fixed lengths")
    sp.add_argument("--num-requests", type=int, default=100, help="requests to send (default: 100)")
    sp.add_argument("--rate", type=float, default=math.inf, help="mean requests/s; inf sends all at once (default)")
    sp.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps: 1 Poisson, < 1 burstier, > 1 more regular (default: 1)")
    sp.add_argument("--prompt-dist", choices=LENGTH_DISTS, default="zipf", help="prompt lengths (default: zipf)")
    sp.add_argument("--prompt-tokens", type=int, nargs=2, default=[32, 1024], metavar=("MIN", "MAX"))
    sp.add_argument("--prompt-zipf-s", type=float, default=1.0, help="Zipf exponent of prompt lengths (default: 1)")
    sp.add_argument("--output-dist", choices=LENGTH_DISTS, default="zipf", help="output lengths (default: zipf)")
    sp.add_argument("--output-tokens", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"))
    sp.add_argument("--output-zipf-s", type=float, default=1.0, help="Zipf exponent of output lengths (default: 1)")
    _add_run_arguments(sp)
    sp.set_defaults(func=synth_command)
    cp = lsub.add_parser("compare", help="runs side by side: a table and a CDF plot")
    cp.add_argument("dirs", nargs="+", metavar="DIR", help="--out directories of earlier runs")
    cp.add_argument("--plot", default="loadgen_compare.png", help="PNG to write (default: loadgen_compare.png)")
    cp.add_argument("--json", help="also write the table's numbers as JSON here")
    cp.set_defaults(func=compare_command)


def _fail(msg: str) -> int:
    print(f"hetserve loadgen: {msg}", file=sys.stderr)
    return EXIT_USAGE


def run_workload(args: argparse.Namespace, requests: tuple[TraceRequest, ...], rate: float | None,
                 burstiness: float | None) -> int:
    """Build exact-length prompts, send everything, print and save the report. Returns the exit code."""
    slo = parse_slo(args.slo)
    if args.shared_prefix_tokens < 0:
        raise PromptError("--shared-prefix-tokens must be >= 0")
    requests = clip_lengths(requests, args.max_prompt_tokens, args.max_output_tokens)
    text = Path(args.text)
    if not text.is_file():
        raise PromptError(f"prompt text {text} not found; pass one with --text")
    tok = TargetTokenizer.load(args.tokenizer)
    builder = PromptBuilder(tok, text.read_text(encoding="utf-8"), chat=args.api == "chat", seed=args.seed,
                            shared_prefix_tokens=args.shared_prefix_tokens)
    prompts = builder.build_all([r.num_prompt_tokens for r in requests], progress=not args.no_progress)
    if builder.prefix:
        shared = sum(p.text.startswith(builder.prefix) for p in prompts)
        short = f" (the other {len(prompts) - shared} are too short for it)" if shared < len(prompts) else ""
        print(f"{shared} of {len(prompts)} prompts start with the shared prefix{short}", file=sys.stderr)
    num_raised = sum(p.num_tokens != r.num_prompt_tokens for p, r in zip(prompts, requests))
    if num_raised:
        print(f"note: {num_raised} prompts were shorter than the chat template's {builder.min_tokens} tokens and "
              "were sent at that length", file=sys.stderr)
    listed, max_model_len = asyncio.run(served_model(args.endpoint, args.api_key))
    model = args.model or listed
    too_long = sum(p.num_tokens + r.num_output_tokens > max_model_len for p, r in zip(prompts, requests)) \
        if max_model_len else 0
    if too_long:
        print(f"warning: {too_long} requests need more than the model's {max_model_len} tokens of context and "
              "will fail; clip them with --max-prompt-tokens / --max-output-tokens", file=sys.stderr)
    ep = Endpoint(args.endpoint, args.api, model, args.api_key, args.timeout_s, not args.no_ignore_eos,
                  args.temperature)
    print(f"sending {len(requests)} requests to {ep.url} (model {model or '-'}), "
          f"max concurrency {args.max_concurrency or 'unlimited'}", file=sys.stderr)
    counters = read_counters(args.endpoint, args.api_key)
    result = asyncio.run(run_requests(make_specs(prompts, requests), ep, args.max_concurrency,
                                      show_progress=not args.no_progress, count_output=tok.count_output))
    summary = summarize(result, slo, rate, burstiness)
    summary.update(speculation_summary(counters, read_counters(args.endpoint, args.api_key)))
    print(format_summary(summary))
    if args.out:
        config = {k: "inf" if isinstance(v, float) and math.isinf(v) else v
                  for k, v in vars(args).items() if k != "func"}
        config.update(model=model, url=ep.url, num_prompts_raised_to_template_min=num_raised)
        paths = write_report(Path(args.out), summary, result.records, config, is_plotting=not args.no_plots)
        print("wrote " + ", ".join(str(p) for p in paths))
    return EXIT_OK if summary["failed"] == 0 else EXIT_FAILED_REQUESTS


def replay_command(args: argparse.Namespace) -> int:
    try:
        trace = read_trace(args.trace, args.trace_format)
        for bad in trace.bad_rows[:max(args.show_bad_rows, 0)]:
            print(f"skipped {bad}", file=sys.stderr)
        if trace.bad_rows:
            print(f"{len(trace.bad_rows)} bad rows skipped, {len(trace.requests)} read", file=sys.stderr)
        flt = TraceFilter(args.trace_model, args.log_type, args.start_s, args.end_s, args.max_requests)
        requests = apply_filter(trace.requests, flt)
        if not requests:
            return _fail(f"{args.trace}: no request left after the filters")
        rate = args.rate
        requests = rescale(requests, args.time_scale, rate)
        return run_workload(args, requests, rate, None)
    except (TraceFormatError, PromptError, ValueError) as exc:
        return _fail(str(exc))


def synth_command(args: argparse.Namespace) -> int:
    try:
        prompt = LengthDist(args.prompt_dist, *args.prompt_tokens, zipf_s=args.prompt_zipf_s)
        output = LengthDist(args.output_dist, *args.output_tokens, zipf_s=args.output_zipf_s)
        requests = synth_requests(args.num_requests, args.rate, args.burstiness, prompt, output, args.seed)
        return run_workload(args, requests, args.rate, args.burstiness)
    except (PromptError, ValueError) as exc:
        return _fail(str(exc))


def compare_command(args: argparse.Namespace) -> int:
    try:
        print(compare([Path(d) for d in args.dirs], Path(args.plot), Path(args.json) if args.json else None))
    except RunDirError as exc:
        return _fail(str(exc))
    print(f"wrote {args.plot}" + (f", {args.json}" if args.json else ""))
    return EXIT_OK
