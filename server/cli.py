"""`hetserve` command line: `hetserve serve` starts the daemon."""
from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

from server.config import ServeConfig, add_arguments, from_args

log = logging.getLogger("hetserve")


def build_engine(cfg: ServeConfig):
    """Load the model and KV store; returns (engine, served model name, max model length)."""
    from gpu_model.loader import default_model_path, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer
    from server.engine import Engine
    from server.hetero import HeteroBackend
    from server.scheduler import SchedulerConfig

    model_dir = resolve_model_dir(cfg.model, Path(cfg.model_cache_dir).expanduser())
    backend = HeteroBackend(model_dir, device=cfg.device, dtype=cfg.dtype, kv_format=cfg.kv_format,
                            kv_capacity_bytes=cfg.kv_capacity_bytes(), block_size=cfg.block_size,
                            max_model_len=cfg.max_model_len, gguf_blocks_max_tokens=cfg.gguf_blocks_max_tokens)
    tokenizer = Tokenizer(model_dir, backend.model.cfg.eos_token_ids)
    engine = Engine(backend, tokenizer, SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens))
    name = cfg.served_model_name or Path(cfg.model or default_model_path()).name.split(".")[0]
    return engine, name, backend.max_model_len


def warm_up(engine) -> None:
    """Run one tiny request so kernels are compiled (or loaded from Numba's cache) before /health is ok."""
    from server.backend import SamplingParams
    from server.engine import EngineRequest

    done = threading.Event()
    # a prompt long enough to take the prefill path's larger kernels, then decode steps
    engine.submit(EngineRequest("warmup", list(range(1, 129)), SamplingParams(temperature=0.0), 4,
                                on_event=lambda ev: ev.finish_reason and done.set()))
    if not done.wait(timeout=300):
        raise RuntimeError("warm-up request did not finish in 300 s")


def serve(cfg: ServeConfig) -> None:
    import uvicorn

    from server.api import ServerState, create_app

    engine, name, max_model_len = build_engine(cfg)
    engine.start()
    warm_up(engine)
    log.info("serving %s on http://%s:%d (max_model_len %d)", name, cfg.host, cfg.port, max_model_len)
    try:
        uvicorn.run(create_app(ServerState(engine, name, max_model_len)), host=cfg.host, port=cfg.port,
                    log_level=cfg.log_level)
    finally:
        engine.stop()


DEFAULT_CALIBRATION_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "valid.txt"


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF file or safetensors directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--model-cache-dir", default="~/.cache/hetserve/models", help="where dequantized GGUF weights are cached")
    p.add_argument("--text", default=str(DEFAULT_CALIBRATION_TEXT),
                   help="text file to calibrate on (default: WikiText-2 valid; never the test split used for scoring)")
    p.add_argument("--num-windows", type=int, default=100, help="windows of text to run (default: 100)")
    p.add_argument("--window-tokens", type=int, default=512, help="tokens per window (default: 512)")
    p.add_argument("--outer-ratio", type=float, default=0.04, help="share of values in the outer group (default: 0.04)")
    p.add_argument("--inner-ratio", type=float, default=0.06, help="share of values in the inner group (default: 0.06)")
    p.add_argument("--out", help="output JSON (default: oaken_thresholds.json in the model's cache directory)")


def calibrate_command(args: argparse.Namespace) -> None:
    from cpu_attn.calibrate import THRESHOLDS_FILE, calibrate, text_windows
    from gpu_model.loader import load_model, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer

    text = Path(args.text)
    if not text.is_file():
        raise SystemExit(f"hetserve calibrate: text file {text} not found; pass one with --text")
    model_dir = resolve_model_dir(args.model, Path(args.model_cache_dir).expanduser())
    model = load_model(model_dir)
    ids = Tokenizer(model_dir, model.cfg.eos_token_ids).encode(text.read_text())
    windows = text_windows(ids, args.num_windows, args.window_tokens)
    result = calibrate(model, windows, args.outer_ratio, args.inner_ratio)
    out = Path(args.out) if args.out else model_dir / THRESHOLDS_FILE
    result.save(out)
    v = result.values
    print(f"{len(windows)} windows x {args.window_tokens} tokens of {text.name}; thresholds written to {out}")
    print("layer  K: outer_lo inner_lo inner_hi outer_hi   V: outer_lo inner_lo inner_hi outer_hi")
    for layer in range(v.shape[0]):
        print(f"{layer:5d}  " + "  ".join(" ".join(f"{t:8.3f}" for t in v[layer, kv]) for kv in (0, 1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetserve", description="Heterogeneous LLM serving daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                             description="Start the OpenAI-compatible HTTP server. Options may also come from "
                                         "a YAML file (--config); flags override the file.")
    add_arguments(p_serve)
    p_cal = sub.add_parser("calibrate", help="profile Oaken KV quantization thresholds for a model",
                           description="Run windows of text through the model and save per-layer Oaken "
                                       "thresholds for K and V next to the model cache.")
    add_calibrate_arguments(p_cal)
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        calibrate_command(args)
        return 0
    try:
        cfg = from_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
