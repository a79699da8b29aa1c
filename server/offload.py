"""Partial offload (`--gpu-kv-cache-bytes`; the local executor, or Ray's one backend actor; Ray's model actor
with CPU attention actors does the same in server/ray_actors.ModelActor): the KV of some sequences on the
accelerator, the rest on the host, both attended in every step at the same time (NEO's asymmetric
pipelining).

    block ids [0, Nd)        the accelerator's pool   DeviceAttentionWorker (gpu_model/device_attn.py)
    block ids [Nd, Nd + Nh)  the host's pool          the CPU attention worker, its store's blocks 0 .. Nh - 1

The pools are two shards of one KVSpec with first_fit: a new sequence goes to the accelerator's pool
while it has room for the sequence's first blocks, else to the host's, and keeps its shard until it
ends or is preempted. Each step is two micro-batches, the accelerator-placed sequences and the
host-placed ones, run layer by layer in turn (ModelWorker.forward_pipelined): the host batch's
attention runs on a thread of its own (the kernels release the GIL) while this thread runs the other
batch's linears and attention on the accelerator.

Offload pays only while steps with host-placed sequences make tokens at least as fast as the accelerator's
sequences alone (OffloadGuard: measured against the fastest recent decode steps the accelerator ran alone; without
one, the host's attention must hide behind the accelerator's work); while they do not, the host shard takes no new
sequences (Backend.open_shards), so what the accelerator cannot hold waits, as it would with the accelerator
alone.

When the accelerator's pool has room again (its sequences ended) and no request waits, the scheduler moves
a host-placed decoding sequence there, the one with the most KV that fits (KVSpec.promote_to, one a step):
its KV is copied from the host store into new blocks of the pool before the step, which already attends
it there. So the accelerator's pool stays full while there is work for it, as GPU-only serving keeps it.
Only with exact host attention: MagicPIG's per-sequence tables stay where they were built.
"""
from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from cpu_attn.worker import ChunkLayout
from gpu_model.device_attn import DeviceAttentionWorker, store_dtype
from hetcore.backend import KVCapacityError, KVMove, SeqChunk, StepInput, StepOutput, StepTimings
from server.backend_config import BackendConfig
from server.hetero import HeteroBackend, flatten, sample_batches

log = logging.getLogger(__name__)

DEVICE = 0  # the accelerator pool's shard; the host's store is shard 1 (Ray: the CPU actors' are 1 .. N)


ACTIVATION_RESERVE = 0.1
"""Of a CUDA device's memory, the part its default KV budget leaves free for activations (as vLLM's default
gpu_memory_utilization of 0.9); at least ACTIVATION_RESERVE_MIN bytes."""
ACTIVATION_RESERVE_MIN = 2 * 2**30


def device_kv_budget(free: int, total: int) -> int:
    """The default accelerator KV bytes: what is free after the model (free of total), less the activations'
    reserve."""
    return max(0, free - max(int(ACTIVATION_RESERVE * total), ACTIVATION_RESERVE_MIN))


class OffloadGuard:
    """Whether the host shard may take new sequences: host-placed sequences pay only when a step with them makes
    tokens at least as fast as the accelerator's sequences alone.

    The reference is measured: the fastest of the last few decode steps whose rows were all on the accelerator, per
    number of rows (`alone`). A step with host rows beside that many accelerator rows costs its seconds against the
    seconds its tokens would take at that pace (alone x all rows / accelerator rows), so a host batch that slows the
    accelerator (its attention not hidden, or the host's threads delaying the accelerator's launches) counts
    against it.
    Without a reference for those rows, the step costs the host attention's seconds against the accelerator's work
    of the step (the host batch must hide behind it). Over the last `window` steps with host rows: closed while the
    costs exceed their budgets; open again once they take at most `reopen` of them (hysteresis, so one slow step
    does not flip it). Steps with no accelerator rows are not judged: host sequences are then all the work."""

    def __init__(self, window: int = 8, reopen: float = 0.8):
        self.steps: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self.reopen = reopen
        self.alone: dict[int, collections.deque[float]] = {}
        """Accelerator rows -> the seconds of the last decode steps with those rows alone (the least is the reference:
        a step that compiled a kernel is not)."""
        self.is_open = True

    def observe(self, device_rows: int, host_rows: int, step_s: float, host_attn_s: float, accelerator_s: float,
                is_decode: bool = True) -> None:
        """One step: its rows on each side, its seconds, the host attention's and the accelerator's work of them;
        is_decode: every row a sequence's one decode token (only such steps are a reference)."""
        if not host_rows:
            if is_decode and device_rows:
                self.alone.setdefault(device_rows, collections.deque(maxlen=4)).append(step_s)
            return
        if not device_rows:
            return
        alone = min(self.alone[device_rows]) if is_decode and device_rows in self.alone else None
        if alone is None:
            self.steps.append((host_attn_s, accelerator_s))
        else:
            self.steps.append((step_s, alone * (device_rows + host_rows) / device_rows))
        cost, budget = (sum(x) for x in zip(*self.steps))
        if self.is_open and cost > budget:
            self.is_open = False
        elif not self.is_open and cost <= self.reopen * budget:
            self.is_open = True

    def shards(self, num_shards: int) -> frozenset[int]:
        """The shards new sequences may go to: the accelerator's pool (DEVICE, 0) always, the host's (1 ..
        num_shards - 1) while open."""
        return frozenset(range(num_shards) if self.is_open else (DEVICE,))


def build_backend(model_dir: Path | None, config: BackendConfig) -> HeteroBackend:
    """The backend of the process the model runs in: OffloadBackend where partial offload runs
    (BackendConfig.offloads, with this process's CUDA device), else HeteroBackend."""
    if config.offloads(torch.cuda.is_available()):
        return OffloadBackend(model_dir, config)
    return HeteroBackend(model_dir, config)


def device_pool(model, config: BackendConfig) -> DeviceAttentionWorker:
    """The accelerator's KV pool beside `model` (the model worker's process): config.gpu_kv_cache_bytes of blocks,
    unset: what the CUDA device has free after the model, less the activations' reserve. Raises KVCapacityError
    where that is unset off CUDA or holds no block."""
    cfg, dev = model.cfg, model.device
    dtype = store_dtype(config.gpu_kv_dtype, model.dtype)
    per_block = DeviceAttentionWorker.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                      config.block_size, dtype)
    budget = config.gpu_kv_cache_bytes
    if budget is None:
        if dev.type != "cuda":
            raise KVCapacityError(f"partial offload with the model on {dev} needs --gpu-kv-cache-bytes")
        budget = device_kv_budget(*torch.cuda.mem_get_info(dev))
        log.info("partial offload: %.1f GiB of %s free after the model for its KV (--gpu-kv-cache-bytes sets "
                 "it, 0 turns offload off)", budget / 2**30, dev)
    num_device = budget // per_block
    if num_device < 1:
        raise KVCapacityError(f"{budget} B of KV on {dev} (--gpu-kv-cache-bytes) has no room for one block of "
                              f"{per_block} B ({dtype}); --gpu-kv-cache-bytes 0 keeps every sequence's KV on the "
                              "host")
    log.info("partial offload: %d blocks of %d tokens on %s (%.1f MiB of %s KV)", num_device, config.block_size,
             dev, num_device * per_block / 2**20, dtype)
    return DeviceAttentionWorker(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, num_device,
                                 dev, dtype)


def _leave_a_core() -> None:
    """The host-attention thread's Numba kernels leave one core to the thread that launches the accelerator's work:
    a step on CUDA is mostly launches, and each waits for a busy core."""
    import numba

    numba.set_num_threads(max(1, numba.get_num_threads() - 1))


class OffloadBackend(HeteroBackend):
    def __init__(self, model_dir: Path | None, config: BackendConfig, model=None):
        super().__init__(model_dir, config, model)
        self.device_attn = device_pool(self.model, config)
        num_device = self.num_device_blocks = self.device_attn.num_blocks
        host = self.kv_spec
        self.kv_spec = replace(host, num_blocks=num_device + host.num_blocks, shards=(num_device, host.num_blocks),
                               first_fit=True, promote_to=DEVICE if self.attn_worker.sparse is None else None)
        self.guard = OffloadGuard()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hetserve-host-attn",
                                        initializer=_leave_a_core if self.model.device.type == "cuda" else None)

    def open_shards(self) -> set[int]:
        return set(self.guard.shards(2))

    def _host_layout(self, c: ChunkLayout) -> ChunkLayout:
        """The host store's own block ids (the shard starts at num_device_blocks)."""
        return replace(c, block_table=tuple(b - self.num_device_blocks for b in c.block_table))

    def _move(self, move: KVMove) -> None:
        """A host-placed sequence's KV (as the host store holds it: Oaken's dequantized) copied into its new blocks
        in the accelerator's pool; the host worker forgets the sequence."""
        table = [b - self.num_device_blocks for b in move.src_table]
        for layer in range(self.model_cfg.num_layers):
            k, v = self.attn_worker.store.gather(layer, table, move.num_tokens)
            self.device_attn.load(layer, move.dst_table, torch.from_numpy(k), torch.from_numpy(v))
        self.attn_worker.free([move.seq_id])

    def step(self, inp: StepInput) -> StepOutput:
        t0 = time.perf_counter()
        self.model_worker.free(inp.freed_seq_ids)
        self.attn_worker.free(inp.freed_seq_ids)
        for move in inp.moves:
            self._move(move)
        on_device = [c.block_table[0] < self.num_device_blocks for c in inp.chunks]
        parts: list[tuple[bool, tuple[SeqChunk, ...]]] = [
            (where, tuple(c for c, d in zip(inp.chunks, on_device) if d == where)) for where in (True, False)]
        parts = [(where, chunks) for where, chunks in parts if chunks]
        if not parts:
            return StepOutput(sampled={})
        batches = [flatten(replace(inp, chunks=chunks)) for _, chunks in parts]
        on_dev = [where for where, _ in parts]
        for where, b in zip(on_dev, batches):
            if where:
                self.device_attn.begin_step(b.layouts)
            else:
                self.attn_worker.begin_step([self._host_layout(c) for c in b.layouts])
        pending: dict[int, Future | torch.Tensor] = {}

        def send(m, layer, q, k, v, codes):
            if on_dev[m]:
                pending[m] = self.device_attn.attend(layer, q, k, v, codes)
            else:  # the host's attention on its thread, beside this one's work
                pending[m] = self._pool.submit(self.attn_worker.attend, layer, q, k, v, codes)

        def recv(m):
            out = pending.pop(m)
            return out.result() if isinstance(out, Future) else out

        logits, accel_s = self.model_worker.forward_pipelined(
            [(b.token_ids, b.positions, b.logit_rows, b.chunks) for b in batches], send, recv, on_device=on_dev)
        self.model_worker.set_centers(self.attn_worker.take_centers())
        t1 = time.perf_counter()
        out = sample_batches(logits, batches)
        accel_s += time.perf_counter() - t1
        host = self.attn_worker.take_timings()
        gpu = self.device_attn.take_timings()["gpu_attn"]
        step_s = time.perf_counter() - t0
        rows = {where: len(chunks) for where, chunks in parts}
        self.guard.observe(rows.get(True, 0), rows.get(False, 0), step_s, host["cpu_attn"], accel_s,
                           is_decode=inp.is_decode)
        return replace(out, timings=StepTimings(accelerator_s=accel_s, cpu_attn_s=host["cpu_attn"], step_s=step_s,
                                                cpu_attn_dense_s=host.get("cpu_attn_dense"), gpu_attn_s=gpu),
                       open_shards=self.guard.shards(2))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.device_attn = None
        super().close()
