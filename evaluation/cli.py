"""`hetserve calibrate` (Oaken thresholds for a model) and `hetserve eval` (perplexity, fidelity
and long-context tasks of KV formats through the serving path): the offline subcommands."""
from __future__ import annotations

import argparse
from pathlib import Path

from server import logs
from server.config import (CPU_LINEAR_DTYPES, KV_FORMATS, WEIGHT_FORMATS, WEIGHT_ROTATIONS, flag_type, parse_layers,
                           parse_switch)


def register(sub) -> None:
    """Add `calibrate` and `eval` to the `hetserve` subparsers `sub`. They load a model, so they set
    `run`, not `func`: hetserve.cli.main runs them under its one-line model errors, as it does serve."""
    p_cal = sub.add_parser("calibrate", help="profile Oaken KV quantization thresholds (or attention entropy) for a "
                                             "model",
                           description="Run windows of text through the model and save per-layer Oaken "
                                       "thresholds for K and V next to the model cache; with --attention-profile, "
                                       "each layer's attention entropy, from which layered KV sparsity picks the "
                                       "layers that keep every token.")
    add_calibrate_arguments(p_cal)
    p_cal.set_defaults(run=_logged(calibrate_command))
    p_eval = sub.add_parser("eval", help="perplexity and fidelity of KV formats through the serving path",
                            description="Prefill and decode windows of text through the KV store in each format, "
                                        "against exact fp32 KV in lockstep: perplexity, KL, top-1 agreement, bits.")
    add_eval_arguments(p_eval)
    p_eval.set_defaults(run=_logged(eval_command))


def _logged(command):
    """`command` with info-level text logs (their progress, and an Oaken calibration when thresholds are missing)."""
    def run(args: argparse.Namespace) -> None:
        logs.configure("info", "text")
        command(args)
    return run


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF file or safetensors directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--model-cache-dir", default="~/.cache/hetserve/models", help="where dequantized GGUF weights are cached")
    from cpu_attn.attention_profile import PROFILE_WINDOW_TOKENS, PROFILE_WINDOWS
    from cpu_attn.calibrate import CALIBRATION_WINDOW_TOKENS, CALIBRATION_WINDOWS, DEFAULT_TEXT, INNER_RATIO, OUTER_RATIO

    p.add_argument("--text", default=str(DEFAULT_TEXT),
                   help="text file to calibrate on (default: WikiText-2 valid; never the test split used for scoring)")
    p.add_argument("--num-windows", type=int,
                   help=f"windows of text to run (default: {CALIBRATION_WINDOWS}; {PROFILE_WINDOWS} with "
                        "--attention-profile)")
    p.add_argument("--window-tokens", type=int,
                   help=f"tokens per window (default: {CALIBRATION_WINDOW_TOKENS}; {PROFILE_WINDOW_TOKENS} with "
                        "--attention-profile)")
    p.add_argument("--attention-profile", action="store_true",
                   help="measure each layer's attention entropy instead, and write attention_profile.json, from "
                        "which layered KV sparsity chooses --kv-full-layers (docs/kv-policy.md)")
    p.add_argument("--outer-ratio", type=float, default=OUTER_RATIO,
                   help=f"share of values in the outer group (default: {OUTER_RATIO})")
    p.add_argument("--inner-ratio", type=float, default=INNER_RATIO,
                   help=f"share of values in the inner group (default: {INNER_RATIO})")
    p.add_argument("--key-smoothing", type=float, default=0.0,
                   help="alpha of the per-channel key smoothing, 0 (off) to 1 (default: 0; it hurts with the rotation)")
    p.add_argument("--no-key-centering", dest="key_centering", action="store_false",
                   help="do not subtract each key channel's mean before quantizing (default: subtract it)")
    p.add_argument("--value-smoothing", type=float, default=0.0,
                   help="alpha of the per-channel value smoothing, 0 (off) to 1 (default: 0)")
    p.add_argument("--no-rotation", dest="rotate", action="store_false",
                   help="do not turn each head's stored K and V by a Hadamard rotation (default: turn them)")
    p.add_argument("--context-tokens", type=int,
                   help="spread the windows over positions up to this context (default: the model's maximum)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the linear layers' dtype while profiling: the one the server will run (default: float32)")
    add_cpu_linear_dtype(p)
    p.add_argument("--out", help="output JSON (default: oaken_thresholds.json in the model's cache directory; "
                                 "oaken_thresholds_bfloat16.json with --dtype bfloat16; attention_profile.json with "
                                 "--attention-profile)")


def add_cpu_linear_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu-linear-dtype", choices=CPU_LINEAR_DTYPES, default="auto",
                   help="with --dtype float32, the linear layers' weights and matmuls, as `hetserve serve` runs them "
                        "(default: auto, bfloat16 where the CPU has AVX512-BF16 or AMX)")


def calibrate_command(args: argparse.Namespace) -> None:
    import torch

    from cpu_attn.calibrate import (CALIBRATION_WINDOW_TOKENS, CALIBRATION_WINDOWS, calibrate, text_windows,
                                    thresholds_file)
    from gpu_model.loader import load_model, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer

    text = Path(args.text)
    if not text.is_file():
        raise SystemExit(f"hetserve calibrate: text file {text} not found; pass one with --text")
    model_dir = resolve_model_dir(args.model, Path(args.model_cache_dir).expanduser())
    model = load_model(model_dir, dtype=getattr(torch, args.dtype), cpu_linear_dtype=args.cpu_linear_dtype)
    ids = Tokenizer(model_dir, model.cfg.eos_token_ids).encode(text.read_text())
    if args.attention_profile:
        _attention_profile_command(args, model, model_dir, ids)
        return
    args.num_windows = args.num_windows or CALIBRATION_WINDOWS
    args.window_tokens = args.window_tokens or CALIBRATION_WINDOW_TOKENS
    windows = text_windows(ids, args.num_windows, args.window_tokens)
    result = calibrate(model, windows, args.outer_ratio, args.inner_ratio, args.key_smoothing, args.key_centering,
                       args.value_smoothing, args.context_tokens, rotate=args.rotate)
    out = Path(args.out) if args.out else model_dir / thresholds_file(model.linear_dtype)
    result.save(out)
    v = result.values
    print(f"{len(windows)} windows x {args.window_tokens} tokens of {text.name} at positions up to "
          f"{result.context_tokens}; thresholds written to {out}")
    print("layer  K: outer_lo inner_lo inner_hi outer_hi   V: outer_lo inner_lo inner_hi outer_hi")
    for layer in range(v.shape[0]):
        print(f"{layer:5d}  " + "  ".join(" ".join(f"{t:8.3f}" for t in v[layer, kv]) for kv in (0, 1)))


def _attention_profile_command(args: argparse.Namespace, model, model_dir: Path, ids: list[int]) -> None:
    import numpy as np

    from cpu_attn.attention_profile import (BROAD, PROFILE_FILE, PROFILE_OBSERVE, PROFILE_WINDOW_TOKENS,
                                            PROFILE_WINDOWS, full_layers_from_entropy, measure_profile)

    out = Path(args.out) if args.out else model_dir / PROFILE_FILE
    entropy = measure_profile(model, ids, out, args.num_windows or PROFILE_WINDOWS,
                              args.window_tokens or PROFILE_WINDOW_TOKENS)
    count, median = full_layers_from_entropy(entropy), float(np.median(entropy))
    print(f"{Path(args.text).name}, the last {PROFILE_OBSERVE} queries of each window; attention entropy per layer "
          f"(nats), median {median:.2f}, broad from {BROAD * median:.2f}:")
    for layer, e in enumerate(entropy):
        print(f"{layer:5d}  {e:6.3f}  {'broad' if e >= BROAD * median else ''}")
    print(f"--kv-full-layers {count} (the leading broad layers); profile written to {out}")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    from cpu_attn.calibrate import DEFAULT_TEXT, SPARSE_FRACTION
    from hetcore.kv_policy import add_kv_policy_arguments

    p.add_argument("--model", help="GGUF file or safetensors directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--model-cache-dir", default="~/.cache/hetserve/models", help="where dequantized GGUF weights are cached")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the linear layers' dtype, for every variant and the reference (default: float32)")
    add_cpu_linear_dtype(p)
    add_weight_format_arguments(p)
    p.add_argument("--activation-bits", type=int, choices=(8, 16), default=16,
                   help="what the integer-dot linears round activations to, as `hetserve serve --activation-bits`; 8 "
                        "scores that rounding: the reference keeps 16 (default: 16)")
    p.add_argument("--reference-linears", choices=CPU_LINEAR_DTYPES,
                   help="the exact fp32-KV reference's --cpu-linear-dtype (default: the same as the variants'); "
                        "`--kv-format fp32 --reference-linears float32` scores bf16 linears themselves")
    p.add_argument("--kv-format", default="oaken",
                   help=f"KV format(s) to score, comma-separated, from {', '.join(KV_FORMATS)} (default: oaken)")
    p.add_argument("--text", default=str(DEFAULT_TEXT.with_name("test.txt")), help="text file (default: WikiText-2 test)")
    p.add_argument("--num-windows", type=int, default=20, help="windows of text (default: 20)")
    p.add_argument("--window-tokens", type=int, default=512, help="tokens per window (default: 512)")
    p.add_argument("--prefill-tokens", type=int, default=128,
                   help="tokens of each window run as the prompt; the rest are decoded one by one and scored (default: 128)")
    p.add_argument("--cached-prefix-tokens", type=int, default=0,
                   help="of the prompt, tokens an earlier sequence computes and the window's takes from it, as the "
                        "prefix cache gives them (default: 0)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=0,
                   help="prefill each prompt this many tokens a step, as `serve` splits a prompt longer than its "
                        "--max-num-batched-tokens (default: 0, the whole prompt in one step)")
    p.add_argument("--batch-windows", type=int, default=16, help="windows decoded together (default: 16)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--oaken-thresholds", help="thresholds JSON (default: the model cache's, calibrated when missing)")
    p.add_argument("--oaken-sparse-fraction", type=float, default=SPARSE_FRACTION,
                   help=f"sparse budget per block (default: {SPARSE_FRACTION})")
    p.add_argument("--oaken-recent", choices=["exact", "quantized"], default="exact",
                   help="each window's filling KV block in full precision until it is full (default: exact)")
    p.add_argument("--attention", choices=["exact", "magicpig", "topk"], default="exact",
                   help="magicpig: also score each (oaken) format with LSH-sampled decode attention; topk: with "
                        "MagicPIG and with TopK at --topk-frac (default: exact)")
    p.add_argument("--topk-frac", type=float, default=0.03,
                   help="TopK: share of the keys outside sinks and window kept (default: 0.03)")
    p.add_argument("--lsh-k", type=int, default=10, help="MagicPIG bits per table (default: 10)")
    p.add_argument("--lsh-l", type=int, default=300,
                   help="MagicPIG tables (default: 300; the paper's 150, with --lsh-retrieval head --lsh-min-collisions 2)")
    p.add_argument("--lsh-min-collisions", type=int, default=3,
                   help="MagicPIG: tables a key must share with the query to be sampled (default: 3; the paper's 2)")
    p.add_argument("--lsh-sinks", type=int, default=4, help="MagicPIG exact sink tokens (default: 4)")
    p.add_argument("--lsh-window", type=int, default=128, help="MagicPIG exact local window (default: 128)")
    p.add_argument("--lsh-min-context", type=int, default=1024, help="MagicPIG: shorter contexts stay exact (default: 1024)")
    p.add_argument("--lsh-retrieval", choices=["head", "group"], default="group",
                   help="MagicPIG: a GQA group shares its mean query's retrieval (group, default) or each query head "
                        "retrieves its keys (head)")
    p.add_argument("--lsh-dense-layers", help="MagicPIG: comma-separated layers kept exact (default: 0 and the middle one)")
    p.add_argument("--lsh-recenter", type=flag_type(parse_switch), default=True,
                   help="MagicPIG, on or off: a prompt prefilled in several chunks is centered on all its keys at a "
                        "decode step, not on its first chunk (default: on)")
    add_kv_policy_arguments(p)
    p.add_argument("--task", choices=["passkey", "niah", "cwe"],
                   help="score a long-context task instead of perplexity: passkey retrieval, multi-key needle in a "
                        "haystack, common-words extraction (evaluation/tasks.py)")
    p.add_argument("--context-tokens", default="2048,4096,8192", help="--task: prompt lengths, comma-separated; at most "
                   "the model's context less 64 tokens for the answer (default: 2048,4096,8192)")
    p.add_argument("--num-samples", type=int, default=10, help="--task: prompts per length (default: 10)")
    p.add_argument("--batch-samples", type=int, default=4, help="--task: prompts run together (default: 4)")
    p.add_argument("--json", help="write the results here as JSON")


def add_weight_format_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weight-format", default="auto",
                   help=f"the linear layers' weights, one of {', '.join(WEIGHT_FORMATS)} (default: auto, as `hetserve "
                        "serve`). Another scores the weights alone: the reference runs dense fp32 weights with the "
                        "same KV format and exact attention, and the linears' dense path runs float32 unless "
                        "--cpu-linear-dtype says otherwise")
    p.add_argument("--weight-rotation", default="none",
                   help=f"MX weight formats: {' or '.join(WEIGHT_ROTATIONS)} (block Hadamard rotation of the input "
                        "dimension; default: none)")
    p.add_argument("--weight-format-head", default="same",
                   help="MX weight formats: same (the LM head takes the format too) or dense (default: same)")


def _load_models(args, model_dir: Path, formats: list[str]):
    """(model, reference model or None): with --weight-format, the reference holds dense fp32 weights."""
    import torch

    from gpu_model.loader import ModelLoadError, load_model
    from gpu_model.weight_format import WeightFormat, WeightFormatError

    try:
        wf = WeightFormat(args.weight_format, args.weight_rotation, args.weight_format_head)
    except WeightFormatError as exc:
        raise SystemExit(f"hetserve eval: {exc}")
    dtype = getattr(torch, args.dtype)
    if wf.name == "auto":
        try:
            model = load_model(model_dir, dtype=dtype, cpu_linear_dtype=args.cpu_linear_dtype,
                               activation_bits=args.activation_bits)
        except ModelLoadError as exc:
            raise SystemExit(f"hetserve eval: {exc}")
        if args.activation_bits == 16:
            return model, None
        return model, load_model(model_dir, dtype=dtype, cpu_linear_dtype=args.cpu_linear_dtype)
    if args.activation_bits != 16:
        raise SystemExit("hetserve eval: --activation-bits 8 takes --weight-format auto (the GGUF's blocks)")
    if len(formats) != 1 or args.attention != "exact" or args.task:
        raise SystemExit("hetserve eval: --weight-format scores perplexity with one --kv-format and exact attention")
    linear = "float32" if args.cpu_linear_dtype == "auto" else args.cpu_linear_dtype
    model = load_model(model_dir, dtype=dtype, cpu_linear_dtype=linear, weight_format=wf,
                       cache_dir=Path(args.model_cache_dir).expanduser())
    return model, load_model(model_dir, dtype=dtype, weight_format=WeightFormat("fp32"))


def _task_command(args, model, tok, formats, cal, lsh, kv_policy) -> list[dict]:
    from evaluation.tasks import evaluate_task, sentences

    longest = model.cfg.max_position_embeddings
    lengths = [int(n) for n in args.context_tokens.split(",") if n.strip()]
    if not lengths or min(lengths) < 256 or max(lengths) > longest:
        raise ValueError(f"--context-tokens must lie in [256, {longest}]")
    lengths = [min(n, longest - 64) for n in lengths]  # room for the answer
    rows = evaluate_task(model, tok, args.task, lengths, args.num_samples, formats, haystack=sentences(Path(args.text).read_text()),
                         oaken_cal=cal, lsh=lsh, topk_frac=args.topk_frac if args.attention == "topk" else None,
                         block_size=args.block_size, sparse_fraction=args.oaken_sparse_fraction,
                         batch_samples=args.batch_samples, kv_policy=kv_policy)
    print(f"{args.task}: {args.num_samples} prompts per length; accuracy with fp32 KV in 'ref'")
    print(f"{'context':>7} {'kv_format':10} {'attention':9} {'policy':7} {'accuracy':>8} {'ref':>6} {'keys':>6}")
    for r in rows:
        keys = f"{r['keys_touched_frac']:6.2%}" if "keys_touched_frac" in r else "     -"
        print(f"{r['context_tokens']:7d} {r['kv_format']:10} {r['attention']:9} {r['kv_policy']:7} "
              f"{r['task_accuracy']:8.1%} "
              f"{r['task_accuracy_ref']:6.1%} {keys}")
    return rows


def eval_command(args: argparse.Namespace) -> None:
    import json

    import torch

    from cpu_attn.calibrate import text_windows
    from gpu_model.loader import load_model, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer
    from cpu_attn.magicpig import LshConfig
    from evaluation.evaluate import evaluate
    from hetcore.kv_policy import kv_policy_from_args
    from server.hetero import kv_full_layers, oaken_thresholds

    formats = [f.strip() for f in args.kv_format.split(",") if f.strip()]
    unknown = [f for f in formats if f not in KV_FORMATS]
    if unknown or not formats:
        raise SystemExit(f"hetserve eval: unknown --kv-format {','.join(unknown)}; choose from {', '.join(KV_FORMATS)}")
    text = Path(args.text)
    if not text.is_file():
        raise SystemExit(f"hetserve eval: text file {text} not found; pass one with --text")
    try:
        dense = parse_layers(args.lsh_dense_layers, "--lsh-dense-layers")
    except ValueError as exc:
        raise SystemExit(f"hetserve eval: {exc}")
    model_dir = resolve_model_dir(args.model, Path(args.model_cache_dir).expanduser())
    model, weights_ref = _load_models(args, model_dir, formats)
    cal = oaken_thresholds(model, model_dir, args.oaken_thresholds) if "oaken" in formats else None
    tok = Tokenizer(model_dir, model.cfg.eos_token_ids)
    try:
        kv_policy = kv_policy_from_args(args)
        if kv_policy.is_layered and kv_policy.full_layers is None:
            kv_policy = kv_policy.with_full_layers(kv_full_layers(model, model_dir))
        lsh = None if args.attention == "exact" else LshConfig(args.lsh_k, args.lsh_l, args.lsh_sinks, args.lsh_window,
                                                               dense, args.lsh_min_context, retrieval=args.lsh_retrieval,
                                                               min_collisions=args.lsh_min_collisions,
                                                               recenter=args.lsh_recenter)
        if args.task:
            results = _task_command(args, model, tok, formats, cal, lsh, kv_policy)
            if args.json:
                Path(args.json).write_text(json.dumps({**results[0], "results": results}, indent=1))
                print(f"wrote {args.json}")
            return
        windows = text_windows(tok.encode(text.read_text()), args.num_windows, args.window_tokens)
        ref_model = weights_ref
        if weights_ref is None and args.reference_linears not in (None, args.cpu_linear_dtype):
            ref_model = load_model(model_dir, dtype=getattr(torch, args.dtype), cpu_linear_dtype=args.reference_linears)
        results = evaluate(model, windows, formats, prefill_tokens=args.prefill_tokens, batch_windows=args.batch_windows,
                           block_size=args.block_size, oaken_cal=cal, sparse_fraction=args.oaken_sparse_fraction,
                           exact_recent=args.oaken_recent == "exact", lsh=lsh,
                           topk_frac=args.topk_frac if args.attention == "topk" else None, ref_model=ref_model,
                           cached_prefix_tokens=args.cached_prefix_tokens,
                           prefill_chunk_tokens=args.prefill_chunk_tokens,
                           ref_kv_format="fp32" if weights_ref is None else formats[0], kv_policy=kv_policy)
    except ValueError as exc:
        raise SystemExit(f"hetserve eval: {exc}")
    from gpu_model.weight_format import weight_bits

    for r in results:
        r["weight_format"], r["weight_bits"] = args.weight_format, weight_bits(model)
        r["weight_rotation"], r["weight_format_head"] = args.weight_rotation, args.weight_format_head
        r["activation_bits"] = args.activation_bits
        other = "16-bit activations" if args.activation_bits == 8 else "dense fp32 weights"
        r["reference"] = "fp32 KV" if weights_ref is None else f"{other}, {formats[0]} KV"
    print(f"{len(windows)} windows x {args.window_tokens} tokens of {text.name}, first {args.prefill_tokens} as prompt"
          f"{f' ({args.cached_prefix_tokens} from the cache)' if args.cached_prefix_tokens else ''}"
          f"{f' in chunks of {args.prefill_chunk_tokens}' if args.prefill_chunk_tokens else ''}; "
          f"{results[0]['reference']} perplexity {results[0]['ppl_ref']:.4f}; weights {args.weight_format} "
          f"({results[0]['weight_bits']:.2f} bits)")
    print(f"{'kv_format':10} {'attention':9} {'policy':7} {'kept':>6} {'bits':>6} {'ppl':>9} {'change':>8} "
          f"{'KL mean':>9} {'top-1':>7} {'keys':>6}  groups outer/middle/inner")
    for r in results:
        g = r.get("group_fractions")
        groups = f"{g['outer']:.2%} / {g['middle']:.2%} / {g['inner']:.2%}" if g else "-"
        keys = f"{r['keys_touched_frac']:6.2%}" if "keys_touched_frac" in r else "     -"
        print(f"{r['kv_format']:10} {r['attention']:9} {r['kv_policy']:7} {r['kv_kept_frac']:6.1%} "
              f"{r['effective_bits']:6.2f} {r['ppl']:9.4f} "
              f"{r['ppl_change_pct']:+7.2f}% {r['kl_mean']:9.5f} {r['top1_agreement']:7.2%} {keys}  {groups}")
    for r in results:
        if "ppl_vs_full_pct" in r:
            print(f"{r['kv_format']} layered against {r['kv_format']} full: ppl {r['ppl']:.4f} vs {r['ppl_full']:.4f} "
                  f"({r['ppl_vs_full_pct']:+.2f}%), KV kept {r['kv_kept_frac']:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({**results[0], "results": results}, indent=1))
        print(f"wrote {args.json}")
