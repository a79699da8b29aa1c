"""`hetserve eval`: what a KV format costs in accuracy, measured through the serving path.

Each window of text is prefilled (its first `prefill_tokens`) and then decoded one token at a
time with teacher forcing, exactly as the hetero backend runs a request: the model's linears,
the attention worker, the KV store in the format under test. An exact fp32-KV run advances in
lockstep on the same windows, so every decoded position gives the next-token distribution with
and without the format:

    ppl             exp(mean NLL of the true next token), decoded positions only
    kl_mean         mean KL(exact || format) in nats
    top1_agreement  share of positions where both put the same token first
    top1_agreement_clear  the same over the positions whose exact top two tokens are at least
                    CLEAR_GAP nats apart (`clear_positions_frac` of them): disagreements at near-ties
                    are what a small model's flat distributions give any perturbation
    effective_bits  stored bits per K/V value, every scale, count and sparse entry included
    kv_kept_frac    with kv_policy layered: KV rows held over a full cache's (evaluation/layered.py);
                    ppl_vs_full_pct compares the perplexity with the same format's full cache
    cpu_attn_s      seconds in the attention worker (KV writes, prefill and decode attention, scoring and
                    eviction); the variants run in lockstep, so a busy machine slows them alike
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from cpu_attn.calibrate import SPARSE_FRACTION, OakenThresholds
from cpu_attn.kv_store import OakenKVStore, SimQuantKVStore, make_store
from cpu_attn.magicpig import LshConfig, MagicPig
from cpu_attn.topk import AnnTopK, TopK
from cpu_attn.worker import AttentionWorker, ChunkLayout
from evaluation.layered import LAYERED_SUFFIX, LayeredRun, layered_names
from gpu_model.worker import ModelWorker
from hetcore.kv_policy import KVPolicy

CLEAR_GAP = 0.2
"""nats between the exact run's first and second token for top1_agreement_clear."""


@dataclass
class _Score:
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    count: int = 0
    top1_clear: int = 0
    clear: int = 0
    groups: dict[str, int] = field(default_factory=lambda: {"values": 0, "sparse": 0, "outer": 0})
    touched: int = 0
    eligible: int = 0
    kept_sum: float = 0.0
    kept_count: int = 0
    attn_s: float = 0.0

    def add(self, ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> None:
        self.nll -= float(logp.gather(1, targets[:, None]).sum())
        self.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        same = ref_logp.argmax(-1) == logp.argmax(-1)
        top2 = ref_logp.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] >= CLEAR_GAP
        self.top1 += int(same.sum())
        self.top1_clear += int((same & clear).sum())
        self.clear += int(clear.sum())
        self.count += len(targets)


def _effective_bits(kv_format: str, store, groups: dict[str, int]) -> float:
    if isinstance(store, OakenKVStore):
        c = store.num_kv_heads * store.head_dim
        per_value = 4 + (3 * 16 + 8 * (c // 64)) / c  # dense nibble, scales, counts
        return per_value + 8 * groups["sparse"] / groups["values"]
    if isinstance(store, SimQuantKVStore):
        return store.effective_bits()
    return {"fp16": 16.0, "fp32": 32.0}[kv_format]


def variant_names(kv_formats: list[str], lsh: LshConfig | None, topk_frac: float | None) -> list[str]:
    """The formats, then "<format>+magicpig" with `lsh`, then "<format>+topk" and "+topk-ann" with `topk_frac` too."""
    if lsh is not None and any(f != "oaken" for f in kv_formats):
        raise ValueError("MagicPIG attention runs over the oaken KV format only")
    topk = [f"{f}+{a}" for a in ("topk", "topk-ann") for f in kv_formats] if lsh is not None and topk_frac else []
    return list(kv_formats) + ([f"{f}+magicpig" for f in kv_formats] if lsh is not None else []) + topk


def sparse_part(name: str, lsh: LshConfig | None, topk_frac: float | None, cfg):
    """The attention worker's sparse-attention part for one variant, or None for exact."""
    if name.endswith("+magicpig"):
        return MagicPig(lsh, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    if name.endswith(("+topk", "+topk-ann")):
        layers = MagicPig(lsh, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim).sampled_layers
        return (TopK if name.endswith("+topk") else AnnTopK)(topk_frac, lsh.sinks, lsh.window, lsh.min_context, layers)
    return None


def _forward(model_worker: ModelWorker, attn: AttentionWorker, batch: torch.Tensor, tables: list[tuple[int, ...]],
             seq_ids: list[int], start: int, length: int, layouts: list[ChunkLayout] | None = None) -> torch.Tensor:
    """One step over every window's tokens start .. start + length - 1 -> the logits of each one's last
    (`layouts`: the chunks' layouts when they are not the plain ones, layered sparsity's)."""
    tokens = batch[:, start:start + length].reshape(-1).tolist()
    positions = list(range(start, start + length)) * len(batch)
    rows = [i * length + length - 1 for i in range(len(batch))]
    attn.begin_step(layouts or [ChunkLayout(length, start, t, i) for i, t in zip(seq_ids, tables)])
    logits, _ = model_worker.forward(tokens, positions, rows, attn.attend, [(i, start, length, 0) for i in seq_ids])
    model_worker.set_centers(attn.take_centers())
    return logits


def evaluate(model, windows: list[list[int]], kv_formats: list[str], *, prefill_tokens: int = 128,
             batch_windows: int = 16, block_size: int = 16, oaken_cal: OakenThresholds | None = None,
             sparse_fraction: float = SPARSE_FRACTION, progress: bool = True, exact_recent: bool = True,
             lsh: LshConfig | None = None, topk_frac: float | None = None, ref_model=None,
             cached_prefix_tokens: int = 0, prefill_chunk_tokens: int = 0, ref_kv_format: str = "fp32",
             kv_policy: KVPolicy | None = None) -> list[dict]:
    """Score each format in `kv_formats` against exact fp32 KV on the same windows (all of one length),
    the reference run on `ref_model` when given (the same weights in other linears, to score those).
    With `lsh`, every (Oaken) format is also scored with MagicPIG attention, as "<format>+magicpig";
    with `topk_frac` as well, with TopK attention keeping that share of keys, as "<format>+topk"
    (exact top-k) and "<format>+topk-ann" (HNSW search), on the same layers and sequences, with
    the same sinks and window. With `cached_prefix_tokens` P, each window's first P tokens are
    prefilled by a sequence that then ends, and the window's own sequence takes its blocks, as the
    server's prefix cache gives them, and prefills the rest: it reads that start through the store,
    and MagicPIG codes those keys on the CPU, centered on their mean. With `prefill_chunk_tokens` C, the
    prompt (past its cached prefix) is prefilled C tokens a step, as the server splits a prompt longer than
    its step budget (max_num_batched_tokens); 0: in one step. `ref_kv_format` is the reference's KV
    format (fp32; another to score weights alone, the reference on `ref_model` with the variants' KV).
    With a layered `kv_policy`, every format is also scored with it, as "<format>+layered"."""
    from tqdm import tqdm

    cfg = model.cfg
    window_tokens = len(windows[0])
    if not 0 < prefill_tokens < window_tokens - 1:
        raise ValueError(f"prefill_tokens must be in [1, {window_tokens - 2}] for windows of {window_tokens} tokens")
    if not 0 <= cached_prefix_tokens < prefill_tokens:
        raise ValueError(f"cached_prefix_tokens must be in [0, {prefill_tokens - 1}] (below prefill_tokens)")
    if prefill_chunk_tokens < 0:
        raise ValueError(f"prefill_chunk_tokens must be 0 (one step) or positive, not {prefill_chunk_tokens}")
    worker = ModelWorker(model, None if lsh is None else MagicPig(lsh, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim).coder())
    ref_worker = worker if ref_model is None else ModelWorker(ref_model)
    variants = variant_names(kv_formats, lsh, topk_frac)
    layout = None
    if kv_policy is not None and kv_policy.is_layered:
        layout = kv_policy.layout(cfg.num_layers, cfg.max_position_embeddings)
    if layout is not None:
        variants += layered_names(kv_formats, lsh is not None, cached_prefix_tokens)
    names = ["fp32-exact"] + variants
    scores = {name: _Score() for name in names}
    workers = {name: ref_worker if name == "fp32-exact" else worker for name in names}
    blocks_per_window = -(-window_tokens // block_size)
    bar = tqdm(total=len(windows) * (window_tokens - prefill_tokens), desc="eval", unit="tok", disable=not progress)
    stores = {}
    for first in range(0, len(windows), batch_windows):
        batch = torch.tensor(windows[first:first + batch_windows])
        num = len(batch)
        stores = {name: make_store(ref_kv_format if name == "fp32-exact" else name.split("+")[0], cfg.num_layers, cfg.num_kv_heads,
                                   cfg.head_dim, block_size, num * blocks_per_window, oaken_cal, sparse_fraction,
                                   num if exact_recent else 0)
                  for name in names if not name.endswith(LAYERED_SUFFIX)}
        attn = {name: AttentionWorker(store, cfg.head_dim, sparse_part(name, lsh, topk_frac, cfg))
                for name, store in stores.items()}
        layered = {name: LayeredRun(name.split("+")[0], cfg, layout, num, blocks_per_window, block_size, oaken_cal,
                                    sparse_fraction, num if exact_recent else 0)
                   for name in names if name.endswith(LAYERED_SUFFIX)}
        for name, run in layered.items():
            stores[name], attn[name] = run.store, run.worker
        tables = [tuple(range(i * blocks_per_window, (i + 1) * blocks_per_window)) for i in range(num)]
        ids = list(range(num))
        if cached_prefix_tokens:  # an earlier request's sequences fill the cache, then end
            for name in names:
                _forward(workers[name], attn[name], batch, tables, ids, 0, cached_prefix_tokens)
                attn[name].free(ids)
            worker.free(ids)
            ref_worker.free(ids)
            ids = list(range(num, 2 * num))
        # step 0 prefills every window (after its cached prefix); step s > 0 decodes token prefill_tokens + s - 1
        for s in range(window_tokens - prefill_tokens):
            if s == 0:
                start, length = cached_prefix_tokens, prefill_tokens - cached_prefix_tokens
            else:
                start, length = prefill_tokens + s - 1, 1
            targets = batch[:, start + length]
            logp = {}
            for name in names:
                if s == 0 and cached_prefix_tokens and isinstance(attn[name].sparse, MagicPig):
                    worker.free(ids)  # the coder takes the center MagicPIG chooses (the others use no codes)
                chunk = prefill_chunk_tokens if s == 0 and prefill_chunk_tokens else length
                for at in range(start, start + length, chunk):
                    n = min(chunk, start + length - at)
                    run = layered.get(name)
                    layouts = None if run is None else run.layouts(ids, at, n, start + length)
                    logits = _forward(workers[name], attn[name], batch, tables, ids, at, n, layouts)
                if name in layered and s > 0:
                    layered[name].count_kept(start + length)
                logp[name] = torch.log_softmax(logits.float().cpu(), -1)
            for name in names:
                scores[name].add(logp["fp32-exact"], logp[name], targets)
            bar.update(num)
        for name, run in layered.items():
            scores[name].kept_sum += run.kept_sum
            scores[name].kept_count += run.kept_count
        for name, worker_ in attn.items():
            scores[name].attn_s += worker_.take_timings()["cpu_attn"]
            if worker_.sparse is not None:
                touched, eligible = worker_.sparse.take_stats()
                scores[name].touched += touched
                scores[name].eligible += eligible
        for name, store in stores.items():
            if isinstance(store, OakenKVStore):
                for table in tables:
                    for key, n in store.group_counts(table, window_tokens).items():
                        scores[name].groups[key] += n
    bar.close()
    ppl_ref = float(np.exp(scores["fp32-exact"].nll / scores["fp32-exact"].count))
    results = []
    for name in variants:
        sc = scores[name]
        is_layered = name.endswith(LAYERED_SUFFIX)
        row = {"kv_format": name.split("+")[0],
               "attention": name.split("+")[1] if "+" in name and not is_layered else "exact",
               "kv_policy": "layered" if is_layered else "full",
               "kv_kept_frac": sc.kept_sum / sc.kept_count if is_layered else 1.0,
               "cpu_attn_s": sc.attn_s,
               "ppl": float(np.exp(sc.nll / sc.count)), "ppl_ref": ppl_ref,
               "kl_mean": sc.kl / sc.count, "top1_agreement": sc.top1 / sc.count,
               "top1_agreement_clear": sc.top1_clear / max(sc.clear, 1), "clear_positions_frac": sc.clear / sc.count,
               "effective_bits": _effective_bits(name.split("+")[0], stores[name], sc.groups),
               "num_windows": len(windows), "window_tokens": window_tokens, "prefill_tokens": prefill_tokens,
               "cached_prefix_tokens": cached_prefix_tokens, "prefill_chunk_tokens": prefill_chunk_tokens,
               "scored_positions": sc.count}
        row["ppl_change_pct"] = 100 * (row["ppl"] / ppl_ref - 1)
        if is_layered:
            row["ppl_full"] = results[variants.index(name.split("+")[0])]["ppl"]
            row["ppl_vs_full_pct"] = 100 * (row["ppl"] / row["ppl_full"] - 1)
            row["kv_policy_settings"] = dataclasses.asdict(kv_policy)
        if sc.eligible:
            exact_attention = results[variants.index(name.split("+")[0])]
            row["keys_touched_frac"] = sc.touched / sc.eligible
            row["ppl_vs_exact_attention_pct"] = 100 * (row["ppl"] / exact_attention["ppl"] - 1)
        if sc.groups["values"]:
            g = sc.groups
            row["group_fractions"] = {"outer": g["outer"] / g["values"], "inner": (g["sparse"] - g["outer"]) / g["values"],
                                      "middle": 1 - g["sparse"] / g["values"]}
        results.append(row)
    return results
