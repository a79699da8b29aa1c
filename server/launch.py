"""Start the daemon: build the backend and engine, warm the kernels up, serve HTTP until SIGTERM."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from pathlib import Path

from server import logs
from server.config import ServeConfig

log = logging.getLogger("hetserve")


def build_engine(cfg: ServeConfig):
    """Load the model and KV store; returns (engine, served model name, max model length)."""
    from gpu_model.loader import default_model_path, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer
    from hetcore.backend import Backend
    from server.backend_config import BackendConfig, RayConfig
    from server.engine import Engine
    from server.scheduler import SchedulerConfig

    model_dir = resolve_model_dir(cfg.model, Path(cfg.model_cache_dir).expanduser())
    config = BackendConfig.from_serve_config(cfg)
    if cfg.executor == "ray":
        from server.ray_executor import RayBackend

        backend: Backend = RayBackend(model_dir, config, RayConfig.from_serve_config(cfg))
    else:
        from server.offload import build_backend

        backend = build_backend(model_dir, config)
    if cfg.backend == "sim":
        from accel_sim.backend import SimBackend

        backend = SimBackend.build(backend, cfg.sim_device, cfg.sim_model, weight_format=cfg.weight_format)
    tokenizer = Tokenizer(model_dir, backend.model_cfg.eos_token_ids)
    engine = Engine(backend, tokenizer, SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefix_caching,
                                                        cfg.speculative_config()))
    name = cfg.served_model_name or Path(cfg.model or default_model_path()).name.split(".")[0]
    return engine, name, backend.max_model_len


def start_engine(cfg: ServeConfig):
    """build_engine on a new thread that then runs the engine's loop; returns what build_engine does.

    The steps' torch and Numba parallel regions (OpenMP) must run on the thread that ran the
    start-up's (model load, calibration): started from a second thread each region paid ~35 us
    more (the first thread's idle OpenMP pools make the second's workers sleep instead of spin),
    and a decode step at 4k x 1 took ~40 instead of ~30 ms."""
    built: Future = Future()

    def run() -> None:
        try:
            engine = build_engine(cfg)
        except BaseException as exc:  # raised again by built.result() in the caller
            built.set_exception(exc)
            return
        engine[0].run(on_started=lambda: built.set_result(engine))

    threading.Thread(target=run, name="hetserve-engine", daemon=True).start()
    return built.result()


BATCH_WARM_UP = 5
"""Requests the warm-up runs at once (decode steps of up to this many rows)."""


def warm_up(engine, lsh=None) -> None:
    """Run one small request per KV shard so kernels are compiled (or loaded from Numba's cache) before
    /health is ok. With MagicPIG (`lsh`, an LshConfig) the prompt is long enough for its hash tables,
    so that its sampled kernel is compiled too: otherwise the first long request after an install
    waited ~60-75 s for it (2 Zen 3 cores). Under layered KV with a budget in tokens it is long enough
    that every sparse layer evicts (KVLayout.evicting_prompt), so the compaction kernels are compiled too."""
    from hetcore.backend import SamplingParams
    from server.request import EngineRequest

    tokens = 128  # long enough to take the prefill path's larger kernels
    if lsh is not None:  # past min_context, with a first merge's worth of keys before the window
        tokens = max(tokens, lsh.min_context, lsh.window + lsh.merge_every) + 16
    layout = engine.blocks.spec.kv_layout
    if layout is not None:
        tokens = max(tokens, layout.evicting_prompt())
    tokens = min(tokens, engine.backend.max_model_len - 5, engine.blocks.max_seq_tokens - 5)
    greedy = SamplingParams(temperature=0.0)

    def run(requests: list[tuple[str, list[int], int]], ignore_eos: bool = False) -> None:
        """(name, prompt, max_tokens) submitted at once; returns once all have finished."""
        done = threading.Semaphore(0)
        for name, prompt, max_tokens in requests:
            engine.submit(EngineRequest(name, prompt, greedy, max_tokens, ignore_eos=ignore_eos,
                                        on_event=lambda ev: ev.finish_reason and done.release()))
        if not all(done.acquire(timeout=300) for _ in requests):
            raise RuntimeError(f"warm-up requests ({requests[0][0]}, ...) did not finish in 300 s")

    # one per KV shard, then decode steps (each its own tokens: the prefix cache would put the same
    # prompt on the first one's shard)
    run([(f"warmup-{i}", list(range(1 + i, tokens + 1 + i)), 4) for i in range(engine.blocks.num_shards)])
    # short requests at once, ending one step apart: decode steps of 1 to BATCH_WARM_UP rows, so each multi-row
    # linear kernel (integer dots for a few rows, AMX tiles from four) is compiled or loaded before a client's
    # step meets it (a first call took ~20 ms from the cache, ~18 s to compile)
    run([(f"warmup-batch-{i}", [3 + i] * 8, 2 + i) for i in range(BATCH_WARM_UP)])
    if engine.scheduler.cfg.speculative.enabled:
        # text that repeats itself (a model continues the pattern, so n-grams find drafts), drafts priced as free:
        # its decode steps send drafts, so the verification kernel is compiled (or loaded: ~18 ms) now, not in a
        # client's request
        engine.scheduler.policy.assume_free_drafts()
        run([("warmup-spec", engine.tokenizer.encode("one two three four, " * 8), 12)], ignore_eos=True)
    engine.reset_stats()


def serve(cfg: ServeConfig) -> None:
    import uvicorn

    from server.api import ServerState, create_app
    from server.lifecycle import DrainingServer

    logs.configure(cfg.log_level, cfg.log_format)
    engine, name, max_model_len = start_engine(cfg)
    warm_up(engine, cfg.lsh_config())
    state = ServerState(engine, name, max_model_len, cfg=cfg)
    app = create_app(state)
    key = "from $" + cfg.api_key_env if cfg.api_key() else "none"
    caching = "on" if engine.scheduler.cfg.prefix_caching else "off"
    log.info("serving %s on http://%s:%d (max_model_len %d, prefix caching %s, API key %s)", name, cfg.host, cfg.port,
             max_model_len, caching, key)
    server = DrainingServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                           log_config=None, access_log=False, timeout_graceful_shutdown=5),
                            state, cfg.shutdown_grace_s)
    try:
        server.run()
    finally:
        engine.stop()
    log.info("stopped")
