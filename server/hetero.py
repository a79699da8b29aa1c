"""The hetero backend, local executor: model linears on the accelerator (or CPU), attention and
the whole KV cache on CPU workers, all in this process."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from cpu_attn.calibrate import DEFAULT_TEXT, THRESHOLDS_FILE, OakenThresholds, calibrate, text_windows
from cpu_attn.kv_store import OakenKVStore, bytes_per_block, make_store
from cpu_attn.magicpig import LshConfig, MagicPig
from cpu_attn.worker import AttentionWorker, ChunkLayout
from gpu_model.loader import load_model
from gpu_model.worker import ModelWorker
from server.backend import KVSpec, StepInput, StepOutput

log = logging.getLogger(__name__)



def oaken_thresholds(model, model_dir: Path, path: str | None) -> OakenThresholds:
    """The thresholds at `path`, or the model cache's; calibrated there on first use when missing."""
    if path:
        return OakenThresholds.load(Path(path))
    cached = model_dir / THRESHOLDS_FILE
    if cached.is_file():
        return OakenThresholds.load(cached)
    if not DEFAULT_TEXT.is_file():
        raise RuntimeError(f"no Oaken thresholds in {cached} and no default calibration text at {DEFAULT_TEXT}: "
                           "run `hetserve calibrate --text FILE` first, or pass --oaken-thresholds")
    from gpu_model.tokenizer import Tokenizer

    log.warning("no Oaken thresholds for this model yet: calibrating on 32 windows of %s (once, about a minute)",
                DEFAULT_TEXT)
    ids = Tokenizer(model_dir, model.cfg.eos_token_ids).encode(DEFAULT_TEXT.read_text())
    result = calibrate(model, text_windows(ids, 32, 512))
    result.save(cached)
    log.info("Oaken thresholds saved to %s", cached)
    return result


def pick_device(device: str) -> str:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            log.info("CUDA is not available: the linear layers run on the CPU")
    elif device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
    return device


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


class HeteroBackend:
    def __init__(self, model_dir: Path, *, device: str, dtype: str, kv_format: str,
                 kv_capacity_bytes: int, block_size: int, max_model_len: int | None,
                 gguf_blocks_max_tokens: int = 16, oaken_thresholds_path: str | None = None,
                 oaken_sparse_fraction: float = 0.125, oaken_recent_blocks: int = 0, lsh: LshConfig | None = None):
        device = pick_device(device)
        self.model_dir = model_dir
        self.model = load_model(model_dir, device, pick_dtype(dtype, device), gguf_blocks_max_tokens)
        cfg = self.model.cfg
        geometry = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size)
        per_block = bytes_per_block(kv_format, *geometry, oaken_sparse_fraction)
        recent = oaken_recent_blocks if kv_format == "oaken" else 0
        num_blocks = (kv_capacity_bytes - OakenKVStore.tail_bytes(*geometry, recent)) // per_block
        if num_blocks < 1:
            raise ValueError(f"KV capacity {kv_capacity_bytes} B is below one block ({per_block} B)")
        cal = oaken_thresholds(self.model, model_dir, oaken_thresholds_path) if kv_format == "oaken" else None
        store = make_store(kv_format, *geometry, num_blocks, cal, oaken_sparse_fraction, recent)
        self.kv_spec = KVSpec(block_size=block_size, num_blocks=num_blocks, bytes_per_block=per_block)
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        magicpig = None if lsh is None else MagicPig(lsh, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        self.model_worker = ModelWorker(self.model, None if magicpig is None else magicpig.coder(device))
        self.attn_worker = AttentionWorker(store, cfg.head_dim, magicpig)
        log.info("KV store: %d blocks of %d tokens, %.1f MiB, %s on %s", num_blocks, block_size,
                 num_blocks * per_block / 2**20, kv_format, device)

    def step(self, inp: StepInput) -> StepOutput:
        t0 = time.perf_counter()
        token_ids, positions, sample_rows, params, output_indices = [], [], [], [], []
        for c in inp.chunks:
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + len(c.token_ids)))
            if c.sampling is not None:
                sample_rows.append(len(token_ids) - 1)
                params.append(c.sampling)
                output_indices.append(c.output_index)
        self.model_worker.free(inp.freed_seq_ids)
        self.attn_worker.free(inp.freed_seq_ids)
        self.attn_worker.begin_step([ChunkLayout(len(c.token_ids), c.start_pos, c.block_table, c.seq_id)
                                     for c in inp.chunks])
        if not token_ids:
            return StepOutput(sampled={})
        tokens, accel_s = self.model_worker.step(token_ids, positions, sample_rows, params, output_indices,
                                                 self.attn_worker.attend,
                                                 [(c.seq_id, c.start_pos, len(c.token_ids)) for c in inp.chunks])
        sampled_ids = [c.seq_id for c in inp.chunks if c.sampling is not None]
        return StepOutput(
            sampled=dict(zip(sampled_ids, tokens)),
            timings_s={"accelerator": accel_s, "cpu_attn": self.attn_worker.take_busy_s(),
                       "step": time.perf_counter() - t0},
        )

    def close(self) -> None:
        pass
