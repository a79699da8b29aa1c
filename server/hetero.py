"""The hetero backend, local executor: model linears on the accelerator (or CPU), attention and
the whole KV cache on CPU workers, all in this process."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from cpu_attn.attention_profile import model_full_layers
from cpu_attn.calibrate import (CALIBRATION_VERSION, CALIBRATION_WINDOW_TOKENS, CALIBRATION_WINDOWS, DEFAULT_TEXT,
                                SPARSE_FRACTION, OakenThresholds, calibrate, text_windows, thresholds_file)
from cpu_attn.kv_store import OakenKVStore, bytes_per_block, make_store
from cpu_attn.magicpig import LshConfig, MagicPig, host_bytes
from cpu_attn.worker import AttentionWorker, ChunkLayout
from gpu_model.model import LlamaModel
from gpu_model.sampler import logprobs, sample
from gpu_model.worker import ModelWorker
from hetcore.backend import Backend, KVCapacityError, KVSpec, StepInput, StepOutput, StepTimings
from server.backend_config import BackendConfig
from server.draft_model import DraftModel, load_draft
from server.self_draft import self_drafts
from server.kv_layout import layered_attention_worker, layered_chunk_layout, layered_kv_spec

log = logging.getLogger(__name__)


def oaken_thresholds(model, model_dir: Path, path: str | None) -> OakenThresholds:
    """The thresholds at `path`, or the model cache's for the model's dtype; calibrated there on
    first use when missing."""
    if path:
        return OakenThresholds.load(Path(path))
    cached = model_dir / thresholds_file(model.linear_dtype)
    found = OakenThresholds.load(cached) if cached.is_file() else None
    if found is not None and found.version >= CALIBRATION_VERSION:
        return found
    if not DEFAULT_TEXT.is_file():
        if found is not None:
            log.warning("%s is from an older calibration (version %d of %d: less accurate, see "
                        "cpu_attn/calibrate.py) and there is no default text to recalibrate on: using it; run "
                        "`hetserve calibrate --text FILE` for better accuracy", cached, found.version,
                        CALIBRATION_VERSION)
            return found
        raise RuntimeError(f"no Oaken thresholds in {cached} and no default calibration text at {DEFAULT_TEXT}: "
                           "run `hetserve calibrate --text FILE` first, or pass --oaken-thresholds")
    from gpu_model.tokenizer import Tokenizer

    log.warning("%s: calibrating Oaken thresholds now, before serving, on %d windows of %s. This runs once per "
                "model and dtype and takes minutes on a CPU (about 1-3 for SmolLM2-135M, more for bigger models). "
                "To avoid it at start-up, run `hetserve calibrate` (same --model and --dtype) beforehand, or pass "
                "--oaken-thresholds FILE",
                "no Oaken thresholds for this model yet" if found is None
                else f"older calibration (version {found.version})", CALIBRATION_WINDOWS, DEFAULT_TEXT)
    ids = Tokenizer(model_dir, model.cfg.eos_token_ids).encode(DEFAULT_TEXT.read_text())
    result = calibrate(model, text_windows(ids, CALIBRATION_WINDOWS, CALIBRATION_WINDOW_TOKENS))
    result.save(cached)
    log.info("Oaken thresholds saved to %s", cached)
    return result


def kv_full_layers(model, model_dir: Path | None) -> int:
    """Layered KV sparsity's full layers for `model`, from its attention profile (cpu_attn/attention_profile.py)."""
    if model_dir is None:
        raise ValueError("kv_policy layered on a model built in memory needs kv_full_layers (no attention profile)")
    from gpu_model.tokenizer import Tokenizer

    count = model_full_layers(model, model_dir, lambda text: Tokenizer(model_dir, model.cfg.eos_token_ids).encode(text))
    log.info("layered KV: the first %d layers keep every token (the model's attention profile)", count)
    return count


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


@dataclass
class FlatBatch:
    """A StepInput laid out as the model worker's flat batch."""

    token_ids: list[int]
    positions: list[int]
    sample_rows: list[int]
    params: list
    output_indices: list[int]
    histories: list[tuple[int, ...]]
    """Each sampled row's request's outputs so far, for penalties (empty without)."""
    sampled_ids: list[int]
    layouts: list[ChunkLayout]
    chunks: list[tuple[int, int, int, int]]  # (seq_id, start_pos, num_tokens, num_draft)
    masks: list = field(default_factory=list)
    """Each sampled row's SeqChunk.allowed_tokens (a TokenMask, or None)."""
    drafts: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    """(seq_id, its draft tokens) of each sampled chunk, in sample-row order: a chunk with k drafts has k + 1
    sample rows, whose sampled tokens decide how many drafts are accepted."""
    scored: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """Prompt rows to score (SeqChunk.prompt_targets): (row, seq_id, position of the target, target, number of
    most likely tokens to list)."""

    @property
    def logit_rows(self) -> list[int]:
        return self.sample_rows + [s[0] for s in self.scored]


def flatten(inp: StepInput) -> FlatBatch:
    b = FlatBatch([], [], [], [], [], [], [], [], [])
    for c in inp.chunks:
        first = len(b.token_ids)
        b.scored.extend((first + i, c.seq_id, c.start_pos + i + 1, t, c.prompt_top)
                        for i, t in enumerate(c.prompt_targets))
        b.token_ids.extend(c.token_ids)
        b.positions.extend(range(c.start_pos, c.start_pos + len(c.token_ids)))
        if c.sampling is not None:
            drafts = c.token_ids[len(c.token_ids) - c.num_draft:] if c.num_draft else ()
            masks = (c.allowed_tokens, *c.draft_masks) if c.allowed_tokens is not None else (None,) * (c.num_draft + 1)
            b.drafts.append((c.seq_id, drafts))
            for i in range(c.num_draft + 1):  # row i samples the token after drafts[:i]
                b.sample_rows.append(len(b.token_ids) - 1 - c.num_draft + i)
                b.params.append(c.sampling)
                b.output_indices.append(c.output_index + i)
                b.histories.append(c.output_token_ids + drafts[:i] if c.sampling.has_penalties else ())
                b.sampled_ids.append(c.seq_id)
                b.masks.append(masks[i])
        b.layouts.append(ChunkLayout(len(c.token_ids), c.start_pos, c.block_table, c.seq_id, c.num_draft))
        if c.kv_view is not None:  # layered KV sparsity: the chunk's rows in the later layer groups too
            b.layouts[-1] = layered_chunk_layout(b.layouts[-1], c)
        b.chunks.append((c.seq_id, c.start_pos, len(c.token_ids), c.num_draft))
    return b


def sample_batches(logits: list[torch.Tensor], batches: list[FlatBatch]) -> StepOutput:
    """Sample every batch's sample rows and score its prompt rows, from the logits of its `logit_rows`."""
    num = [len(b.sample_rows) for b in batches]
    out = StepOutput(sampled={})
    if sum(num):
        rows = torch.cat([x[:n] for x, n in zip(logits, num)])
        params = [p for b in batches for p in b.params]
        masks = [None if m is None else m.words() for b in batches for m in b.masks]  # waits for the mask thread
        tokens = sample(rows, params, [i for b in batches for i in b.output_indices],
                        [h for b in batches for h in b.histories], masks if any(m is not None for m in masks) else ())
        lps = logprobs(rows, tokens, [p.logprobs for p in params])
        accept([d for b in batches for d in b.drafts], tokens, lps, out)
    scored = [s for b in batches for s in b.scored]
    if scored:
        rows = torch.cat([x[n:] for x, n in zip(logits, num)])
        for (_, seq_id, pos, _, _), lp in zip(scored, logprobs(rows, [s[3] for s in scored], [s[4] for s in scored])):
            out.prompt_logprobs.setdefault(seq_id, []).append((pos, lp))
    return out


def accept(drafts: list[tuple[int, tuple[int, ...]]], tokens: list[int], lps: list, out: StepOutput) -> None:
    """Fill out's sampled, logprobs, accepted and accepted_logprobs from the sample rows' `tokens` and `lps`,
    laid out as FlatBatch.drafts says: a sequence's drafts are accepted while each equals the token its row
    before sampled; the token after the last accepted one is its sampled token."""
    row = 0
    for seq_id, draft in drafts:
        n = 0
        while n < len(draft) and tokens[row + n] == draft[n]:
            n += 1
        out.sampled[seq_id] = tokens[row + n]
        if lps[row + n] is not None:
            out.logprobs[seq_id] = lps[row + n]
        if draft:
            out.accepted[seq_id] = draft[:n]
            if lps[row] is not None:
                out.accepted_logprobs[seq_id] = tuple(lps[row:row + n])
        row += len(draft) + 1


def _cache_costs(cfg, kv_format: str, block_size: int, sparse_fraction: float, recent_blocks: int,
                 lsh: LshConfig | None, max_num_seqs: int) -> tuple[int, int, int, float]:
    """(bytes per block, bytes set aside, blocks reserved by a sequence with MagicPIG tables, the
    share of a block's bytes that is its holder's codes) of the KV cache. With MagicPIG its state is
    the cache's too (magicpig.host_bytes): a block pays for its tokens' codes, `max_num_seqs`
    sequences' centers are set aside, and a sequence reserves blocks for its first table set. The reserve is counted against the codes' share of a block alone: the
    reserved blocks' own KV pages may still be in memory from an earlier sequence."""
    geometry = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size)
    per_block = bytes_per_block(kv_format, *geometry, sparse_fraction)
    fixed = OakenKVStore.tail_bytes(*geometry, recent_blocks if kv_format == "oaken" else 0)
    if lsh is None:
        return per_block, fixed, 0, 0.0
    per_token, per_seq, per_tabled = host_bytes(lsh, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    reserve = -(-per_tabled // (block_size * per_token))
    codes = block_size * per_token
    return per_block + codes, fixed + max_num_seqs * per_seq, reserve, codes / (per_block + codes)


def kv_spec(cfg, kv_format: str, capacity_bytes: int, block_size: int, sparse_fraction: float,
            recent_blocks: int, lsh: LshConfig | None = None, max_num_seqs: int = 1) -> KVSpec:
    """The blocks of a cache of `capacity_bytes` in `kv_format`, MagicPIG's state included, so that
    admission by free blocks bounds the hash tables too: a sequence reserves blocks for its first
    table set once it has min_context tokens (when it may get one), and one that takes blocks from
    the prefix cache holds more for its own codes of their tokens (KVSpec.own_share)."""
    per_block, fixed, reserve, own_share = _cache_costs(cfg, kv_format, block_size, sparse_fraction, recent_blocks,
                                                        lsh, max_num_seqs)
    spec = KVSpec(block_size, max(0, capacity_bytes - fixed) // per_block, per_block, reserve_blocks=reserve,
                  reserve_from=lsh.min_context if lsh else 0, own_share=own_share)
    least = spec.blocks_for(lsh.min_context) if lsh else 1
    if spec.num_blocks < least:
        what = (f"a sequence of {lsh.min_context} tokens with its MagicPIG tables ({least} blocks of {per_block} B)"
                if lsh else f"one block of {block_size} tokens ({per_block} B)")
        raise KVCapacityError(f"KV capacity {capacity_bytes / 2**20:.1f} MiB has room for {spec.num_blocks} blocks "
                              f"beside the {fixed / 2**20:.1f} MiB it sets aside, too few for {what}: raise "
                              "--kv-cache-bytes")
    return spec


def reserve_note(spec: KVSpec) -> str:
    return (f"; a sequence of {spec.reserve_from} tokens or more also holds {spec.reserve_blocks} for its MagicPIG "
            "tables" if spec.reserve_blocks else "")


def kv_capacity_for(cfg, kv_format: str, block_size: int, num_seqs: int, tokens_per_seq: int,
                    lsh: LshConfig | None = None, sparse_fraction: float = SPARSE_FRACTION,
                    recent_blocks: int = 0) -> int:
    """A capacity in which kv_spec finds room for `num_seqs` sequences of `tokens_per_seq` tokens, each
    with MagicPIG tables (benchmarks)."""
    per_block, fixed, reserve, _ = _cache_costs(cfg, kv_format, block_size, sparse_fraction, recent_blocks, lsh,
                                                num_seqs)
    return fixed + num_seqs * (reserve + -(-tokens_per_seq // block_size)) * per_block


def attention_worker(cfg, kv_format: str, num_blocks: int, block_size: int, cal, sparse_fraction: float,
                     recent_blocks: int, lsh: LshConfig | None) -> AttentionWorker:
    """A CPU attention worker with its own store (and MagicPIG tables with `lsh`)."""
    recent = recent_blocks if kv_format == "oaken" else 0
    store = make_store(kv_format, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, num_blocks, cal,
                       sparse_fraction, recent)
    magicpig = None if lsh is None else MagicPig(lsh, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    return AttentionWorker(store, cfg.head_dim, magicpig)


def model_worker(model, lsh: LshConfig | None, device: str) -> ModelWorker:
    cfg = model.cfg
    return ModelWorker(model, None if lsh is None else MagicPig(lsh, cfg.num_layers, cfg.num_kv_heads,
                                                                cfg.head_dim).coder(device))


class HeteroBackend(Backend):
    """The model worker and one CPU attention worker in this process, stepped in turn, layer by layer."""

    def __init__(self, model_dir: Path | None, config: BackendConfig, model: LlamaModel | None = None):
        """The model comes from `model_dir`, or is `model` already built (benchmarks on random
        weights: then model_dir is None and Oaken needs `config.oaken_thresholds_path`)."""
        c = self.config = config
        device = pick_device(c.device)
        self.model_dir = model_dir
        self.model = model if model is not None else c.load_model(model_dir, device, pick_dtype(c.dtype, device))
        cfg = self.model_cfg = self.model.cfg
        if c.kv_policy.is_layered and c.kv_policy.full_layers is None:
            c = self.config = replace(c, kv_policy=c.kv_policy.with_full_layers(kv_full_layers(self.model, model_dir)))
        if c.kv_policy.is_layered:
            self.kv_spec = layered_kv_spec(c, cfg)
        else:
            self.kv_spec = kv_spec(cfg, c.kv_format, c.kv_capacity_bytes, c.block_size, c.oaken_sparse_fraction,
                                   c.oaken_recent_blocks, c.lsh, c.max_num_seqs)
        num_blocks, per_block = self.kv_spec.num_blocks, self.kv_spec.bytes_per_block
        cal = oaken_thresholds(self.model, model_dir, c.oaken_thresholds_path) if c.kv_format == "oaken" else None
        self.max_model_len = min(c.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.model_worker = model_worker(self.model, c.lsh, device)
        self.draft_worker = self.model_worker
        """What makes the drafts of chunks with self_draft: the model, or a copy in c.draft_weight_format."""
        if c.draft_weight_format is not None:
            draft = replace(c, weight_format=c.draft_weight_format, activation_bits=16).load_model(
                model_dir, device, pick_dtype(c.dtype, device))
            self.draft_worker = model_worker(draft, None, device)
            log.info("speculative drafts: a copy of the model with %s weights", c.draft_weight_format)
        self.draft_model: DraftModel | None = None
        """speculative draft-model: the separate model that drafts, with its own KV store over the same block ids."""
        if c.draft_model is not None:
            draft = load_draft(c.draft_model, model_dir, cfg, c, device, pick_dtype(c.dtype, device))
            store_dtype = "float32" if c.kv_format == "fp32" else "float16"
            per_block = self.kv_spec.bytes_per_block + DraftModel.bytes_per_block(draft.cfg, c.block_size, store_dtype)
            self.kv_spec = replace(self.kv_spec, num_blocks=c.kv_capacity_bytes // per_block, bytes_per_block=per_block)
            num_blocks = self.kv_spec.num_blocks
            self.draft_model = DraftModel(draft, num_blocks, c.block_size, store_dtype)
            log.info("speculative drafts: %s (%d layers), its KV beside the model's in each block", c.draft_model,
                     draft.cfg.num_layers)
        if c.kv_policy.is_layered:
            self.attn_worker = layered_attention_worker(c, cfg, num_blocks, cal)
        else:
            self.attn_worker = attention_worker(cfg, c.kv_format, num_blocks, c.block_size, cal,
                                                c.oaken_sparse_fraction, c.oaken_recent_blocks, c.lsh)
        log.info("KV store: %d blocks of %d tokens, %.1f MiB, %s on %s%s", num_blocks, c.block_size,
                 num_blocks * per_block / 2**20, c.kv_format, device, reserve_note(self.kv_spec))

    def step(self, inp: StepInput) -> StepOutput:
        t0 = time.perf_counter()
        self.model_worker.free(inp.freed_seq_ids)
        self.attn_worker.free(inp.freed_seq_ids)
        draft_s = 0.0
        if self.draft_model is not None:  # it sees every chunk, to keep its KV store
            inp, draft_s = self.draft_model.draft(inp)
        elif any(c.self_draft for c in inp.chunks):
            inp, draft_s = self_drafts(inp, self.draft_worker, self.attn_worker, self.kv_spec.block_size)
        b = flatten(inp)
        self.attn_worker.begin_step(b.layouts)
        if not b.token_ids:
            return StepOutput(sampled={})
        logits, accel_s = self.model_worker.run(self.attn_worker, b.token_ids, b.positions, b.logit_rows, b.chunks)
        accel_s += draft_s
        self.model_worker.set_centers(self.attn_worker.take_centers())
        t1 = time.perf_counter()
        out = sample_batches([logits], [b])
        accel_s += time.perf_counter() - t1
        attn = self.attn_worker.take_timings()  # {"cpu_attn": s, "cpu_attn_dense": s with a sparse part}
        return replace(out, timings=StepTimings(accelerator_s=accel_s, cpu_attn_s=attn["cpu_attn"],
                                                step_s=time.perf_counter() - t0,
                                                cpu_attn_dense_s=attn.get("cpu_attn_dense")))

    def close(self) -> None:
        """Let the model and the KV cache go (the backend is not stepped again), so that a process that goes on (a
        test suite starting server after server) gets their memory back while something still holds the backend: a
        web framework's caches keep the endpoints of every app they served, and those hold the engine."""
        self.model = self.model_worker = self.draft_worker = self.attn_worker = self.draft_model = None
