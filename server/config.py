"""Server configuration: one frozen dataclass, filled from a YAML file and/or CLI flags.

Every field carries its help text in `metadata`; the CLI builds one flag per field from it,
so `hetserve serve --help` always documents every option.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hetcore.kv_policy import BUDGET_RATIO, WINDOW_RATIO, KVPolicy

GPU_KV_DTYPES = ("auto", "fp8")
KV_FORMATS = ("oaken", "fp16", "fp32", "int4", "int5", "int6", "kivi")  # the same tuple as cpu_attn.kv_store's, without numba
SPARSE_FRACTION = 0.125  # cpu_attn.calibrate.SPARSE_FRACTION, without numba

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int) -> int:
    """'2GiB', '512MB', '1e9' or an int -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size (examples: 2GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_switch(value: str | bool) -> bool:
    """'on' / 'off' (also true / false, yes / no, 1 / 0) or a bool -> bool."""
    if isinstance(value, bool):
        return value
    words = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}
    word = str(value).strip().lower()
    if word not in words:
        raise ValueError(f"cannot read {value!r} as on or off")
    return words[word]


def offload_runs(gpu_kv_cache_bytes: int | None, device: str, cuda: bool) -> bool:
    """Whether a backend that can offload does: with gpu_kv_cache_bytes > 0, or unset (None) with the linears on a
    CUDA device (`device` auto or cuda, `cuda`: one is there). GPU-only attention of the sequences the GPU holds is
    what a GPU host should get; the host takes only what does not fit (server/offload.py)."""
    if gpu_kv_cache_bytes is None:
        return device != "cpu" and cuda
    return gpu_kv_cache_bytes > 0


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


def parse_layers(text: str | None, name: str) -> tuple[int, ...] | None:
    """"0, 15" -> (0, 15); None -> None (the default layers)."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{name} must be comma-separated layer numbers, not {text!r}") from None


WEIGHT_FORMATS = ("auto", "gguf", "mxfp8", "mxfp6", "mxfp6_e3m2", "mxfp4", "mxint8", "bf16", "fp32")  # gpu_model.weight_format's, without torch
WEIGHT_ROTATIONS = ("none", "hadamard")
CPU_LINEAR_DTYPES = ("auto", "float32", "bfloat16")
"""Values of `cpu_linear_dtype` (also the CLI choices of calibrate and eval, and benchmarks' HF dtype)."""
_KV = KVPolicy()
"""The KV policy's own defaults, which the kv_* options take."""


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = _opt(None, "GGUF file or safetensors directory of a Llama-architecture model (default: bundled SmolLM2-135M-Instruct)")
    served_model_name: str | None = _opt(None, "name clients pass as `model` (default: the model file's stem)")
    model_cache_dir: str = _opt("~/.cache/hetserve/models", "where dequantized GGUF weights are cached")
    host: str = _opt("127.0.0.1", "address to bind; 0.0.0.0 exposes the server to the network")
    port: int = _opt(8000, "TCP port")
    device: str = _opt("auto", "where the linear layers run: auto (cuda if present), cuda or cpu")
    dtype: str = _opt("auto", "model dtype: auto (float32 on cpu, bfloat16 on cuda), float32, float16, bfloat16")
    cpu_linear_dtype: str = _opt("auto", "on the CPU (dtype float32), the linear layers' weights and matmuls: auto "
                                         "(bfloat16 where the CPU has AVX512-BF16 or AMX, else float32), float32, "
                                         "bfloat16; activations, norms and embeddings stay float32. With auto or "
                                         "bfloat16 the GGUF blocks multiply x rounded to int16 per block by integer "
                                         "dots where the CPU has AVX512-VNNI or AVX2; float32 keeps their exact "
                                         "float products. With float32 linears a sequence's greedy tokens do not "
                                         "depend on what it is batched with; with bfloat16 they may, as on GPUs")
    gguf_blocks_max_tokens: int | None = _opt(None, "on the CPU, steps of at most this many tokens multiply by the GGUF's "
                                                    "own Q4_1/Q8_0 blocks, or by the MX weights of an MX weight_format "
                                                    "(0 = never; default: 64 with float32 linears or weight_format gguf; "
                                                    "with bfloat16 ones 32 where the CPU has AVX512-VNNI and AMX, 16 with "
                                                    "AVX512-VNNI or AVX2 (64 with activation_bits 8), else 1; MX 2)")
    activation_bits: int = _opt(16, "on the CPU, what the integer-dot linears round each activation block of 32 "
                                    "to: 16 bits (a relative error of 2^-16), or 8 (llama.cpp's Q8 rounding: the "
                                    "GGUF's blocks by vpdpbusd, 1.2-1.4x the rows a second at several rows a step, "
                                    "perplexity +0.1 percent; needs AVX512-VNNI, or AVX2, where the Q8_0 head "
                                    "keeps 16 bits; docs/weight-formats.md)")
    weight_format: str = _opt("auto", "the linear layers' weights: auto (gguf blocks where the model has them, "
                                      "else cpu_linear_dtype), gguf (the GGUF's Q4_1/Q8_0 blocks), mxfp8, mxfp6, "
                                      "mxfp4, mxint8 (OCP MX, converted at load and cached), bf16 or fp32; see "
                                      "docs/weight-formats.md")
    weight_rotation: str = _opt("none", "MX weight formats: none, or hadamard (a block Hadamard rotation of the "
                                        "input dimension, folded into the weights; for mxfp4)")
    weight_format_head: str = _opt("same", "MX weight formats: same (the LM head takes the format too) or dense "
                                           "(it stays in the dense linears' dtype)")
    kv_format: str = _opt("fp16", "KV cache format in the CPU store: oaken (about 5 bits, calibrated), fp16, fp32, "
                                  "or the integer baselines int4, int5, int6 and kivi (simulated on fp32 memory, for comparison)")
    oaken_thresholds: str | None = _opt(None, "Oaken thresholds JSON from `hetserve calibrate` (default: the model "
                                              "cache's, calibrated on first use when missing)")
    oaken_sparse_fraction: float = _opt(SPARSE_FRACTION, "Oaken sparse entries a KV block has room for, as a share of "
                                                          "its values")
    oaken_recent_blocks: int | None = _opt(None, "Oaken: blocks per layer kept in full precision while they fill, so "
                                                 "each sequence's newest tokens are exact (default: max_num_seqs; 0 = off)")
    attention: str = _opt("exact", "decode attention: exact, or magicpig (LSH-sampled; needs kv_format oaken)")
    lsh_k: int = _opt(10, "MagicPIG: bits per hash table")
    lsh_l: int = _opt(300, "MagicPIG: hash tables (the paper's 150, with lsh_retrieval head and lsh_min_collisions 2)")
    lsh_min_collisions: int = _opt(3, "MagicPIG: tables a key must share with the query to be sampled (the paper's 2)")
    lsh_sinks: int = _opt(4, "MagicPIG: first tokens always attended exactly")
    lsh_window: int = _opt(128, "MagicPIG: last tokens always attended exactly")
    lsh_dense_layers: str | None = _opt(None, "MagicPIG: comma-separated layers kept exact (default: 0 and the middle one)")
    lsh_min_context: int = _opt(1024, "MagicPIG: shorter sequences are attended exactly")
    lsh_retrieval: str = _opt("group", "MagicPIG: group (a GQA group's heads share the retrieval of their mean query: "
                                       "fewer rows read) or head (each query head retrieves its own keys, as the paper)")
    lsh_recenter: bool = _opt(True, "MagicPIG, on or off: a prompt longer than a step's token budget is prefilled in "
                                    "chunks, its keys centered on its first chunk's mean; at a decode step, center "
                                    "them on the whole prompt's mean instead (its keys coded on the CPU)",
                              parse=parse_switch)
    kv_policy: str = _opt("full", "full (every layer keeps every token) or layered: the first kv_full_layers keep "
                                  "every token, the others a budget of sinks, a recent window and the tokens with "
                                  "the most attention (scored at the prompt's end, accumulated while decoding); "
                                  "needs attention exact; see docs/kv-policy.md")
    kv_full_layers: int | None = _opt(None, "kv_policy layered: the first layers that keep every token (default: the "
                                            "leading layers of broad attention in the model's attention profile, "
                                            "`hetserve calibrate --attention-profile`, measured on first use)")
    kv_budget_tokens: int | None = _opt(None, "kv_policy layered: tokens each other layer keeps per sequence")
    kv_budget_ratio: float | None = _opt(None, "kv_policy layered: tokens each other layer keeps, as a share of "
                                               f"the sequence's prompt (default: {BUDGET_RATIO} unless kv_budget_tokens)")
    kv_budget_schedule: str = _opt(_KV.schedule, "kv_policy layered: flat (one budget) or pyramid (budgets falling with "
                                           "depth, 1.5x to 0.5x, the same mean)")
    kv_score_pool: int = _opt(_KV.score_pool, "kv_policy layered: at a prompt's end rank each token by the larger of its score "
                                  "and the mean score of this many tokens around it (with kv_focus, the focus "
                                  "queries' scores) (odd; SnapKV's pooling; 1: its own score)")
    kv_observe: int = _opt(_KV.observe, "kv_policy layered: the prompt's last queries whose attention scores its tokens "
                               "(SnapKV's observation window)")
    kv_chunk_observe: int = _opt(_KV.chunk_observe, "kv_policy layered with kv_prefill_evict: each prompt chunk's last "
                                                    "queries whose attention scores the rows before its eviction")
    kv_focus: int = _opt(_KV.focus, "kv_policy layered: the prompt's last queries that rank its tokens a second time "
                            "(pooled by kv_score_pool; a token ranks by the larger of both, the kv_observe "
                            "window's then by own scores) (0: off)")
    kv_window: int | None = _opt(None, "kv_policy layered: latest tokens always kept (default: kv_window_ratio)")
    kv_window_ratio: float | None = _opt(None, "kv_policy layered: latest tokens always kept, as a share of each "
                                               f"layer's budget, instead of kv_window (default: {WINDOW_RATIO} "
                                               "unless kv_window)")
    kv_sinks: int = _opt(_KV.sinks, "kv_policy layered: first tokens always kept")
    kv_evict_slack: int = _opt(_KV.evict_slack, "kv_policy layered: tokens over the budget a sparse layer may hold "
                                                "before it evicts (evictions run once per this many decode steps)")
    kv_prefill_evict: bool = _opt(_KV.prefill_evict, "kv_policy layered with kv_budget_tokens, on or off: evict after every "
                                         "prompt chunk too, so a long prompt holds budget + a chunk's rows in the "
                                         "sparse layers, not the whole prompt (later chunks attend to the kept rows "
                                         "only: an approximation of the prompt's own attention)", parse=parse_switch)
    kv_cache_bytes: int | None = _opt(None, "KV cache capacity, e.g. 4GiB, MagicPIG's hash tables included "
                                      "(overrides --kv-cache-fraction)", parse=parse_bytes)
    gpu_kv_cache_bytes: int | None = _opt(None, "partial offload: KV of this many bytes on the accelerator, e.g. "
                                          "24GiB (less than it has emulates a smaller GPU); sequences go there first "
                                          "and to the host's KV (--kv-cache-bytes) once it is full, each step "
                                          "attending both at once; 0 = none, every sequence's KV on the host (default: "
                                          "on a CUDA device, what it has free after the weights less a tenth of its "
                                          "memory, where backend hetero, speculative_method off and kv_policy full; "
                                          "otherwise none)", parse=parse_bytes)
    gpu_kv_dtype: str = _opt("auto", "partial offload: the accelerator's KV values: auto (the model's dtype, bfloat16 "
                                     "on CUDA) or fp8 (float8 e4m3, scale 1 as vLLM's default: half the bytes, so "
                                     "twice the sequences fit; each value rounded to 3 mantissa bits)")
    kv_cache_fraction: float = _opt(0.25, "KV cache capacity (MagicPIG's tables included) as a fraction of total RAM")
    block_size: int = _opt(16, "tokens per KV block")
    max_num_seqs: int = _opt(64, "most requests in the running batch")
    max_num_batched_tokens: int = _opt(512, "token budget of one step (decodes plus prefill chunks)")
    max_model_len: int | None = _opt(None, "longest prompt plus output in tokens (default: the model's context)")
    prefix_caching: bool = _opt(True, "on or off: a request whose tokens start with the same full KV blocks as an "
                                      "earlier one's reuses their KV instead of computing it (blocks no request "
                                      "holds stay cached until the space is needed; with attention magicpig each "
                                      "request still builds its own hash tables, from the cached keys)",
                                parse=parse_switch)
    speculative_method: str = _opt("off", "speculative decoding: off; ngram (drafts copied from the continuation of "
                                          "the latest earlier occurrence of the sequence's last tokens, prompt "
                                          "lookup); self-sparse (the model drafts with attention over "
                                          "speculative_sinks + speculative_window tokens); self-mx (a copy of the "
                                          "model with MXFP4 weights drafts); self-mx-sparse (both); draft-model "
                                          "(speculative_model drafts; these four need the KV in the model's "
                                          "process: executor local, or ray with ray_cpu_actors 0); each "
                                          "emitted token is the one the model samples without speculation; needs "
                                          "kv_format fp16, fp32 or oaken (ngram, draft-model; with attention exact or "
                                          "magicpig); see docs/speculative.md")
    num_speculative_tokens: int = _opt(4, "speculative decoding: most draft tokens a sequence sends per step (1-16); "
                                          "fewer, or none, when its acceptance rate and the measured step cost say "
                                          "more would not pay")
    ngram_min: int = _opt(2, "speculative method ngram: shortest suffix looked up")
    ngram_max: int = _opt(4, "speculative method ngram: longest suffix looked up (the longest found wins)")
    speculative_sinks: int = _opt(16, "speculative method self-sparse: first tokens a draft step attends to")
    speculative_window: int = _opt(256, "speculative method self-sparse: latest tokens a draft step attends to")
    speculative_model: str | None = _opt(None, "speculative method draft-model: the model that drafts, a GGUF file "
                                               "or a Hugging Face directory with the model's tokenizer (a smaller "
                                               "sibling); its KV takes a share of kv_cache_bytes")
    executor: str = _opt("local", "how workers run: local (one process), or ray (a model actor, and CPU attention "
                                  "actors if ray_cpu_actors > 0; a local Ray cluster unless ray_address is given)")
    ray_address: str | None = _opt(None, "ray executor: address of an existing Ray cluster to join, e.g. auto or "
                                         "HEAD_IP:6379 (default: start a local one)")
    ray_cpu_actors: int = _opt(0, "ray executor: CPU attention actors (one per KV node); the KV capacity is split "
                                     "among them, and each layer's attention is a TCP round trip to them; 0: the "
                                     "model actor holds the KV and attends in its own process (one node)")
    ray_actor_cpus: int = _opt(0, "ray executor: CPUs (and kernel threads) per CPU attention actor (0: the "
                                  "machine's cores divided by ray_cpu_actors)")
    ray_microbatches: int = _opt(0, "ray executor: split each step's batch into this many micro-batches (1 or 2) "
                                    "so the model actor computes one while the CPU actors attend for the other "
                                    "(0: 2 when the model actor has a GPU, else 1: on CPU-only nodes both share the cores)")
    ray_kv_resource: str = _opt("kv_node", "ray executor: custom resource every CPU attention actor needs one of, so "
                                           "they land on the nodes that offer it (empty: any node)")
    backend: str = _opt("hetero", "what serves requests: hetero (the model on this machine), or sim (the same real "
                                  "tokens, with per-step timing simulated for --sim-device; reported as x_sim)")
    sim_device: str = _opt("oaken-lpddr", "backend sim: simulated system (oaken-lpddr, oaken-hbm, a100-vllm, "
                                          "a100-kivi, a100-qserve, h100-vllm, lpu-lpddr, lpu-hbm); --kv-format must "
                                          "match its KV format (oaken for the Oaken devices)")
    sim_model: str = _opt("smollm2-135m", "backend sim: model shape whose timing is simulated (e.g. llama2-13b; "
                                          "tokens always come from --model)")
    log_level: str = _opt("info", "debug, info, warning or error")
    log_format: str = _opt("text", "text, or json: one JSON object per line with the request id of the request it is about")
    max_waiting_requests: int = _opt(256, "requests queued beyond the running batch; more get 429 with Retry-After")
    request_timeout_s: float = _opt(0.0, "end a request (queued or running) this many seconds after arrival with an "
                                         "error and free its KV cache (0: no limit)")
    shutdown_grace_s: float = _opt(25.0, "on SIGTERM, seconds in-flight requests may take to finish (new ones get "
                                         "503) before the rest are cancelled; keep it below the orchestrator's kill "
                                         "timeout (Kubernetes: terminationGracePeriodSeconds, 30 by default)")
    api_key_env: str = _opt("HETSERVE_API_KEY", "environment variable holding the API key; when it is set and not "
                                                "empty, every path outside auth_exempt_paths needs `Authorization: "
                                                "Bearer <key>` (empty name: no key)")
    auth_exempt_paths: str = _opt("/health,/metrics", "comma-separated paths that need no API key")
    cors_allow_origins: str = _opt("", "comma-separated origins allowed cross-origin requests, or * (empty: CORS off)")
    max_body_bytes: int = _opt(2**20, "largest request body, e.g. 1MiB; larger ones get 413", parse=parse_bytes)
    max_prompt_tokens: int | None = _opt(None, "longest prompt in tokens (default: max_model_len - 1)")

    def __post_init__(self) -> None:
        checks = [
            (self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, not {self.device!r}"),
            (self.dtype in ("auto", "float32", "float16", "bfloat16"), f"unknown dtype {self.dtype!r}"),
            (self.kv_format in KV_FORMATS, f"kv_format must be one of {', '.join(KV_FORMATS)}, not {self.kv_format!r}"),
            (0 < self.oaken_sparse_fraction <= 1, "oaken_sparse_fraction must be in (0, 1]"),
            (self.oaken_recent_blocks is None or self.oaken_recent_blocks >= 0, "oaken_recent_blocks must be >= 0"),
            (self.attention in ("exact", "magicpig"), f"attention must be exact or magicpig, not {self.attention!r}"),
            (self.attention == "exact" or self.kv_format == "oaken", "attention magicpig needs kv_format oaken"),
            (re.fullmatch(r"\s*(\d+\s*(,\s*\d+\s*)*)?", self.lsh_dense_layers or ""),
             "lsh_dense_layers must be comma-separated layer numbers"),
            (self.lsh_retrieval in ("head", "group"), f"lsh_retrieval must be head or group, not {self.lsh_retrieval!r}"),
            (1 <= self.lsh_min_collisions <= min(self.lsh_l, 255), "lsh_min_collisions must be in 1 .. min(lsh_l, 255)"),
            (self.executor in ("local", "ray"), f"executor must be local or ray, not {self.executor!r}"),
            (self.ray_cpu_actors >= 0 and self.ray_actor_cpus >= 0, "ray_cpu_actors must be >= 0, ray_actor_cpus >= 0"),
            (self.ray_microbatches in (0, 1, 2), "ray_microbatches must be 0 (auto), 1 or 2"),
            (0 < self.kv_cache_fraction < 1, "kv_cache_fraction must be in (0, 1)"),
            (self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes must be positive"),
            (self.gpu_kv_cache_bytes is None or self.gpu_kv_cache_bytes >= 0, "gpu_kv_cache_bytes must be >= 0"),
            (self.gpu_kv_dtype in GPU_KV_DTYPES, f"gpu_kv_dtype must be one of {', '.join(GPU_KV_DTYPES)}, not "
                                                 f"{self.gpu_kv_dtype!r}"),
            (self.block_size > 0 and self.max_num_seqs > 0, "block_size and max_num_seqs must be positive"),
            (self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive"),
            (self.gguf_blocks_max_tokens is None or self.gguf_blocks_max_tokens >= 0, "gguf_blocks_max_tokens must be >= 0"),
            (self.activation_bits in (8, 16), f"activation_bits must be 8 or 16, not {self.activation_bits}"),
            (self.weight_format in WEIGHT_FORMATS,
             f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, not {self.weight_format!r}"),
            (self.weight_rotation in WEIGHT_ROTATIONS,
             f"weight_rotation must be one of {', '.join(WEIGHT_ROTATIONS)}, not {self.weight_rotation!r}"),
            (self.weight_rotation == "none" or self.weight_format.startswith("mx"),
             f"weight_rotation {self.weight_rotation} needs an MX weight_format, not {self.weight_format}"),
            (self.weight_format_head in ("same", "dense"),
             f"weight_format_head must be same or dense, not {self.weight_format_head!r}"),
            (self.cpu_linear_dtype in CPU_LINEAR_DTYPES,
             f"cpu_linear_dtype must be auto, float32 or bfloat16, not {self.cpu_linear_dtype!r}"),
            (self.max_model_len is None or self.max_model_len > 1, "max_model_len must be > 1"),
            (0 < self.port < 65536, f"port {self.port} out of range"),
            (self.log_level in ("debug", "info", "warning", "error"), f"unknown log_level {self.log_level!r}"),
            (self.log_format in ("text", "json"), f"log_format must be text or json, not {self.log_format!r}"),
            (self.max_waiting_requests >= 0, "max_waiting_requests must be >= 0"),
            (self.request_timeout_s >= 0 and self.shutdown_grace_s >= 0, "timeouts must be >= 0"),
            (self.max_body_bytes > 0, "max_body_bytes must be positive"),
            (self.max_prompt_tokens is None or self.max_prompt_tokens > 0, "max_prompt_tokens must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.speculative_config()  # raises on bad speculative settings
        if self.speculative_method != "off" and (self.kv_format not in ("fp16", "fp32", "oaken")
                                                 or self.backend != "hetero"):
            raise ValueError(f"speculative_method {self.speculative_method} needs kv_format fp16, fp32 or oaken and "
                             "backend hetero (its rejected drafts' KV must not stay in the store)")
        if self.speculative_method != "off" and self.attention == "magicpig" and \
                self.lsh_window <= self.num_speculative_tokens:
            raise ValueError(f"speculative_method with attention magicpig needs lsh_window > num_speculative_tokens "
                             f"(drafts are never indexed into the hash tables), not {self.lsh_window}")
        if self.speculative_method.startswith("self") and self.kv_format == "oaken":
            raise ValueError(f"speculative_method {self.speculative_method} needs kv_format fp16 or fp32 (its draft "
                             "steps are plain decodes on the store; ngram and draft-model, whose drafts come from "
                             "outside it, take oaken)")
        if self.speculative_config().backend_drafts and not self.kv_beside_model:
            raise ValueError(f"speculative_method {self.speculative_method} needs executor local, or ray with "
                             "ray_cpu_actors 0 (its draft steps run where the model and the KV are)")
        layered = self.kv_policy_config().is_layered
        if layered and (self.attention != "exact" or self.speculative_method != "off"):
            raise ValueError("kv_policy layered needs attention exact and speculative_method off")
        if layered and self.executor == "ray" and self.ray_microbatches == 2:
            raise ValueError("kv_policy layered takes one micro-batch a step on the ray executor (a sequence's scores "
                             "live in one attention worker): ray_microbatches 0 or 1")
        if self.gpu_kv_cache_bytes and not self.offload_possible:
            raise ValueError("gpu_kv_cache_bytes needs backend hetero, speculative_method off and kv_policy full (the "
                             "accelerator's KV takes exact one-token and prompt rows only)")
        if self.gpu_kv_dtype != "auto" and not (self.gpu_kv_cache_bytes or self.offload_by_default):
            raise ValueError(f"gpu_kv_dtype {self.gpu_kv_dtype} is for partial offload's accelerator KV: pass "
                             "gpu_kv_cache_bytes, or serve on a CUDA device (offload is its default there), with "
                             "backend hetero, speculative_method off and kv_policy full")
        if self.backend not in ("hetero", "sim"):
            raise ValueError(f"backend must be hetero or sim, not {self.backend!r}")
        if self.backend == "sim":
            from accel_sim.backend import numerics_kv_format
            from accel_sim.models import get_model

            get_model(self.sim_model)
            fmt = numerics_kv_format(self.sim_device)
            if self.kv_format != fmt:
                raise ValueError(f"backend sim with sim_device {self.sim_device} computes with the {fmt} KV format: "
                                 f"pass --kv-format {fmt}")

    @property
    def kv_beside_model(self) -> bool:
        """Whether the KV store and the model run in one process (local, or ray without CPU attention actors)."""
        return self.executor == "local" or self.ray_cpu_actors == 0

    @property
    def offload_possible(self) -> bool:
        """Whether partial offload (gpu_kv_cache_bytes) can serve this configuration: the accelerator's KV pool, beside
        the model on either executor, takes exact one-token and prompt rows only, on the hetero backend."""
        return (self.backend == "hetero" and self.speculative_method == "off"
                and not self.kv_policy_config().is_layered)

    @property
    def offload_by_default(self) -> bool:
        """Whether partial offload runs without asking here: gpu_kv_cache_bytes unset, a configuration offload
        serves and the linears on a CUDA device of this process (offload_runs). With a Ray cluster the backend
        actor decides the same where its GPU is."""
        import torch

        return self.gpu_kv_cache_bytes is None and self.offload_possible and offload_runs(
            None, self.device, torch.cuda.is_available())

    def speculative_config(self):
        from server.speculative import SpecConfig

        return SpecConfig(self.speculative_method, self.num_speculative_tokens, self.ngram_min, self.ngram_max,
                          self.speculative_sinks, self.speculative_window, self.speculative_model)

    def kv_policy_config(self) -> KVPolicy:
        """The KV policy; raises KVPolicyError (a ValueError) on bad settings."""
        return KVPolicy(self.kv_policy, self.kv_full_layers, self.kv_budget_tokens, self.kv_budget_ratio,
                        self.kv_budget_schedule, self.kv_window, self.kv_sinks, prefill_evict=self.kv_prefill_evict,
                        observe=self.kv_observe, chunk_observe=self.kv_chunk_observe, score_pool=self.kv_score_pool,
                        focus=self.kv_focus, window_ratio=self.kv_window_ratio, evict_slack=self.kv_evict_slack)

    def lsh_config(self):
        """The MagicPIG settings, or None for exact attention."""
        if self.attention != "magicpig":
            return None
        from cpu_attn.magicpig import LshConfig

        dense = parse_layers(self.lsh_dense_layers, "lsh_dense_layers")
        return LshConfig(self.lsh_k, self.lsh_l, self.lsh_sinks, self.lsh_window, dense, self.lsh_min_context,
                         retrieval=self.lsh_retrieval, min_collisions=self.lsh_min_collisions,
                         recenter=self.lsh_recenter)

    def api_key(self) -> str | None:
        """The key from the environment variable `api_key_env` names (never from a file or flag)."""
        return os.environ.get(self.api_key_env) or None if self.api_key_env else None

    def csv(self, name: str) -> tuple[str, ...]:
        """A comma-separated option as a tuple of its non-empty items."""
        return tuple(x.strip() for x in getattr(self, name).split(",") if x.strip())

    def kv_capacity_bytes(self) -> int:
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * self.kv_cache_fraction)

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "ServeConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of option: value")
        data = {k.replace("-", "_"): v for k, v in data.items()}
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{path}: unknown option(s) {', '.join(unknown)}")
        for k, v in data.items():
            parse = names[k].metadata.get("parse")
            if parse and v is not None:
                data[k] = parse(v)
        return cls(**{**data, **overrides})


def flag_type(parse):
    """`parse` for argparse: its ValueError's message becomes the flag's error (not "invalid parse_bytes value")."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file with any of the options below (flags override it)")
    for f in dataclasses.fields(ServeConfig):
        parse = f.metadata.get("parse")
        kind = flag_type(parse) if parse else {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        help = f.metadata["help"]  # a help that describes its default says it already
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None,
                            help=help if "(default:" in help else f"{help} (default: {f.default})")


def from_args(args: argparse.Namespace) -> ServeConfig:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig) if getattr(args, f.name) is not None}
    if args.config:
        return ServeConfig.from_file(args.config, **overrides)
    return ServeConfig(**overrides)
