"""The hetero backend on Ray (`--executor ray`): the model worker and N CPU attention workers as
Ray actors, on one machine or across a cluster.

    engine thread ──Ray call per step──> ModelActor (linears, LSH codes, sampler; num_gpus=1)
                                            │  per layer: q, k, v (+ codes) out, o back,
                                            │  one TCP frame each way per shard (server.channel)
                                  ┌─────────┴─────────┐
                         AttentionActor 0   …   AttentionActor N-1   (KV store, tables, kernels;
                         blocks [0, n)            blocks [.., B)        num_cpus, custom resource)

Ray places, restarts and addresses the actors; the per-layer exchange goes over a direct TCP
connection, because a Ray call or a Compiled Graph hop per layer costs more than the layer
(benchmarks/bench_executor.py measures both). The block manager shards KV blocks by actor, so every sequence
lives on one actor, the one with the most free blocks when it was admitted.

Failures: a CPU actor that dies is restarted by Ray; the step fails with WorkerLost(shard), the
engine preempts the running sequences, and they are recomputed on the surviving shards while
/health says degraded; the shard takes sequences again once its actor answers. A dead model
actor fails the step with WorkerLost(None): every running request ends with an error, /health
is down until Ray has restarted it and it has reconnected.
"""
from __future__ import annotations

import bisect
import logging
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import torch

from server import channel
from server.backend import KVSpec, StepInput, StepOutput, WorkerLost

log = logging.getLogger(__name__)
STEP_TIMEOUT_S = 600.0
"""A step that takes longer than this counts as a lost accelerator worker."""


def _set_threads(n: int) -> None:
    import numba

    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


class AttentionActor:
    """One shard of the KV cache: an AttentionWorker behind a TCP listener (one model actor at a time)."""

    def __init__(self, cfg, kv_format: str, num_blocks: int, first_block: int, block_size: int, cal,
                 sparse_fraction: float, recent_blocks: int, lsh, threads: int):
        import ray

        from cpu_attn.worker import AttentionWorker
        from server.hetero import attention_worker

        _set_threads(threads)
        self.worker = attention_worker(cfg, kv_format, num_blocks, block_size, cal, sparse_fraction, recent_blocks, lsh)
        # micro-batch 1 has its own step plan over the same store and tables
        self.workers = [self.worker, AttentionWorker(self.worker.store, cfg.head_dim, self.worker.sparse)]
        self.first_block = first_block
        self._listener = socket.create_server((ray.util.get_node_ip_address(), 0))
        threading.Thread(target=self._serve, name="attention-channel", daemon=True).start()

    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def pid(self) -> int:
        return os.getpid()

    def _serve(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                try:
                    while True:
                        self._handle(conn, *channel.recv(conn))
                except (ConnectionError, OSError):
                    pass  # the model actor went away or reconnects

    def _handle(self, conn: socket.socket, h: dict, arrays: list[np.ndarray]) -> None:
        from cpu_attn.worker import ChunkLayout

        if h["op"] == "free":
            self.worker.free(h["seq_ids"])
            return
        try:
            worker = self.workers[h["mb"]]
            if "layout" in h:
                worker.begin_step([ChunkLayout(n, start, tuple(b - self.first_block for b in table), seq)
                                   for n, start, table, seq in h["layout"]])
            q, k, v, *codes = (torch.from_numpy(a) for a in arrays)
            o = worker.attend(h["layer"], q, k, v, tuple(codes) or None)
            channel.send(conn, {"busy_s": worker.take_busy_s()} if h.get("last") else {}, [o.numpy()])
        except Exception as exc:  # reported to the model actor, which fails the step
            log.exception("attention failed")
            channel.send(conn, {"error": f"{type(exc).__name__}: {exc}"})


def split(chunks, n: int) -> list[list]:
    """`chunks` in at most n contiguous groups of about equal token counts (no empty group)."""
    total = sum(len(c.token_ids) for c in chunks)
    groups, size = [[]], 0
    for c in chunks:
        if size >= total * len(groups) / n and len(groups) < n:
            groups.append([])
        groups[-1].append(c)
        size += len(c.token_ids)
    return groups


class ModelActor:
    """The accelerator side: the model worker, and one channel per attention shard."""

    def __init__(self, model_dir: str, device: str, dtype: str, gguf_blocks_max_tokens: int, lsh, threads: int,
                 microbatches: int):
        from gpu_model.loader import load_model
        from server.hetero import model_worker, pick_dtype, pick_device

        if threads:
            _set_threads(threads)
        device = pick_device(device)
        self.model_dir = Path(model_dir)
        self.model = load_model(self.model_dir, device, pick_dtype(dtype, device), gguf_blocks_max_tokens)
        self.worker = model_worker(self.model, lsh, device)
        self.addresses: list[tuple[str, int] | None] = []
        self.first_blocks: list[int] = []
        self.socks: list[socket.socket | None] = []
        self.pending_free: list[list[int]] = []
        self.microbatches = microbatches

    def config(self):
        return self.model.cfg

    def thresholds(self, path: str | None):
        from server.hetero import oaken_thresholds

        return oaken_thresholds(self.model, self.model_dir, path)

    def set_shards(self, first_blocks: list[int]) -> None:
        self.first_blocks = first_blocks
        self.addresses = [None] * len(first_blocks)
        self.socks = [None] * len(first_blocks)
        self.pending_free = [[] for _ in first_blocks]

    def connect(self, shard: int, address: tuple[str, int]) -> None:
        self._close(shard)
        self.addresses[shard] = tuple(address)
        self.socks[shard] = channel.connect(self.addresses[shard], STEP_TIMEOUT_S)

    def _close(self, shard: int) -> None:
        if self.socks[shard] is not None:
            self.socks[shard].close()
            self.socks[shard] = None

    def _lost(self, shard: int, exc: BaseException) -> WorkerLost:
        """Forget the dead shard and reset every channel (replies of this step may still be in flight)."""
        self.addresses[shard] = None
        for s in range(len(self.socks)):
            self._close(s)
            if self.addresses[s] is not None:
                try:
                    self.connect(s, self.addresses[s])
                except OSError:
                    self.addresses[s] = None
        return WorkerLost(f"CPU attention worker {shard} lost: {type(exc).__name__}: {exc}", shard)

    def step(self, inp: StepInput) -> tuple[dict[int, int], dict[str, float]]:
        from gpu_model.sampler import sample

        t0 = time.perf_counter()
        self.worker.free(inp.freed_seq_ids)
        for s, pending in enumerate(self.pending_free):
            pending.extend(inp.freed_seq_ids)
            if pending and self.socks[s] is not None:
                self._send(s, {"op": "free", "seq_ids": pending}, [])
                pending.clear()
        if not inp.chunks:
            return {}, {}
        mbs = [self._micro_batch(c) for c in split(inp.chunks, self.microbatches)]
        busy: dict[int, float] = {}
        last = self.model.cfg.num_layers - 1

        def send(m, layer, q, k, v, codes):
            b, parts = mbs[m]
            for s, (rows, layout) in parts.items():
                h = {"op": "attend", "mb": m, "layer": layer, "last": layer == last}
                if layer == 0:
                    h["layout"] = layout
                self._send(s, h, [(t if rows is None else t[rows]).numpy() for t in (q, k, v, *(codes or ()))])

        def recv(m):
            b, parts = mbs[m]
            out = None
            for s, (rows, _) in parts.items():
                h, arrays = self._recv(s)
                if "error" in h:
                    raise RuntimeError(f"CPU attention worker {s}: {h['error']}")
                busy[s] = busy.get(s, 0.0) + h.get("busy_s", 0.0)
                o = torch.from_numpy(arrays[0])
                if rows is None:
                    out = o
                else:
                    out = out if out is not None else torch.empty(len(b.token_ids), o.shape[1])
                    out[rows] = o
            return out

        logits, accel_s = self.worker.forward_pipelined(
            [(b.token_ids, b.positions, b.sample_rows, b.chunks) for b, _ in mbs], send, recv)
        t1 = time.perf_counter()
        tokens = sample(torch.cat(logits), [p for b, _ in mbs for p in b.params],
                        [i for b, _ in mbs for i in b.output_indices]) if any(b.sample_rows for b, _ in mbs) else []
        step_s = time.perf_counter() - t0
        accel_s += time.perf_counter() - t1
        return dict(zip([i for b, _ in mbs for i in b.sampled_ids], tokens)), {
            "accelerator": accel_s, "cpu_attn": sum(busy.values()), "cpu_attn_max": max(busy.values()),
            "step": step_s}

    def _micro_batch(self, chunks) -> tuple:
        """The flat batch of `chunks` and, per shard, (its rows, or None for all; its chunk layouts)."""
        from server.hetero import flatten

        b = flatten(StepInput(tuple(chunks)))
        parts: dict[int, tuple[list[int], list]] = {}
        row = 0
        for c, lay in zip(chunks, b.layouts):
            s = bisect.bisect_right(self.first_blocks, c.block_table[0]) - 1
            if self.socks[s] is None:
                raise self._lost(s, ConnectionError("not connected"))
            rows, layout = parts.setdefault(s, ([], []))
            rows.extend(range(row, row + len(c.token_ids)))
            layout.append([lay.num_tokens, lay.start_pos, list(lay.block_table), lay.seq_id])
            row += len(c.token_ids)
        whole = len(parts) == 1
        return b, {s: (None if whole else torch.tensor(rows), layout) for s, (rows, layout) in parts.items()}

    def _send(self, s: int, header: dict, arrays) -> None:
        try:
            channel.send(self.socks[s], header, arrays)
        except OSError as exc:
            raise self._lost(s, exc) from None

    def _recv(self, s: int):
        try:
            return channel.recv(self.socks[s])
        except OSError as exc:
            raise self._lost(s, exc) from None


class RayBackend:
    """Backend protocol over the actors; lives in the server process (the Ray driver)."""

    def __init__(self, model_dir: Path, *, device: str, dtype: str, kv_format: str, kv_capacity_bytes: int,
                 block_size: int, max_model_len: int | None, gguf_blocks_max_tokens: int = 2,
                 oaken_thresholds_path: str | None = None, oaken_sparse_fraction: float = 0.125,
                 oaken_recent_blocks: int = 0, lsh=None, ray_address: str | None = None, cpu_actors: int = 2,
                 actor_cpus: int = 0, kv_resource: str = "kv_node", microbatches: int = 0):
        import ray

        from server.hetero import kv_blocks

        actor_cpus = actor_cpus or max(1, (os.cpu_count() or 1) // cpu_actors)
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if ray_address:
                ray.init(address=ray_address, log_to_driver=True)
            else:  # a local cluster sized for our actors (logical CPUs may exceed the cores)
                ray.init(num_cpus=max(os.cpu_count() or 1, cpu_actors * actor_cpus + 1), include_dashboard=False,
                         resources={kv_resource: cpu_actors} if kv_resource else None)
        self.ray = ray
        use_gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        # OpenMP threads that spin-wait after each op would steal the cores the other actors compute on
        # (measured on 2 cores at concurrency 8: an ACTIVE model actor made decode steps 4x slower than local,
        # a PASSIVE one 1.09x, or 0.78x with two micro-batches)
        env = {"runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}, "max_restarts": -1}
        model_opts = {"num_gpus": 1, "num_cpus": 1, **env} if use_gpu else {"num_cpus": 1, **env}
        threads = 0 if ray_address else os.cpu_count() or 1
        microbatches = microbatches or (2 if use_gpu else 1)
        self.model_actor = ray.remote(ModelActor).options(**model_opts).remote(
            str(model_dir), device, dtype, gguf_blocks_max_tokens, lsh, threads, microbatches)
        cfg = ray.get(self.model_actor.config.remote())
        cal = ray.get(self.model_actor.thresholds.remote(oaken_thresholds_path)) if kv_format == "oaken" else None
        num_blocks, per_block = kv_blocks(cfg, kv_format, kv_capacity_bytes // cpu_actors, block_size,
                                          oaken_sparse_fraction, oaken_recent_blocks)
        self.first_blocks = [i * num_blocks for i in range(cpu_actors)]
        actor_opts = {"num_cpus": actor_cpus, **env}
        if kv_resource:
            actor_opts["resources"] = {kv_resource: 1}
        self.cpu_actors = [ray.remote(AttentionActor).options(**actor_opts).remote(
            cfg, kv_format, num_blocks, first, block_size, cal, oaken_sparse_fraction, oaken_recent_blocks, lsh,
            actor_cpus) for first in self.first_blocks]
        self.kv_spec = KVSpec(block_size, num_blocks * cpu_actors, per_block, shards=(num_blocks,) * cpu_actors)
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.model_cfg = cfg
        self.down: set[int] = set(range(cpu_actors))
        self.model_down = False
        self._probes: dict = {}
        self._connect_all()
        if self.down:
            raise RuntimeError(f"CPU attention actors {sorted(self.down)} did not start")
        log.info("Ray executor: %d CPU attention actors x %d CPUs, %d KV blocks each (%.1f MiB), %s",
                 cpu_actors, actor_cpus, num_blocks, num_blocks * per_block / 2**20, kv_format)

    def _connect_all(self, timeout_s: float = 300.0) -> None:
        addresses = self.ray.get([a.address.remote() for a in self.cpu_actors], timeout=timeout_s)
        self.ray.get(self.model_actor.set_shards.remote(self.first_blocks))
        for s, address in enumerate(addresses):
            self.ray.get(self.model_actor.connect.remote(s, address))
            self.down.discard(s)

    def _poll(self) -> None:
        """Bring back actors Ray has restarted."""
        from ray.exceptions import RayError

        if self.model_down:
            probe = self._probes.setdefault("model", self.model_actor.config.remote())
            if self.ray.wait([probe], timeout=0)[0]:
                del self._probes["model"]
                try:
                    self.ray.get(probe)
                    self.down = set(range(len(self.cpu_actors)))
                    self._connect_all(timeout_s=30)
                    self.model_down = False
                    log.warning("accelerator worker is back")
                except (RayError, OSError) as exc:
                    log.warning("accelerator worker not back yet: %s", exc)
            return
        for s in sorted(self.down):
            probe = self._probes.setdefault(s, self.cpu_actors[s].address.remote())
            if self.ray.wait([probe], timeout=0)[0]:
                del self._probes[s]
                try:
                    self.ray.get(self.model_actor.connect.remote(s, self.ray.get(probe)))
                    self.down.discard(s)
                    log.warning("CPU attention worker %d is back", s)
                except (RayError, OSError) as exc:
                    log.warning("CPU attention worker %d not back yet: %s", s, exc)

    def live_shards(self) -> set[int]:
        self._poll()
        return set() if self.model_down else set(range(len(self.cpu_actors))) - self.down

    def health(self) -> str:
        if self.model_down or len(self.down) == len(self.cpu_actors):
            return "down"
        return "degraded" if self.down else "ok"

    def step(self, inp: StepInput) -> StepOutput:
        from ray.exceptions import GetTimeoutError, RayActorError

        if self.model_down:
            raise WorkerLost("the accelerator worker is restarting")
        try:
            sampled, timings = self.ray.get(self.model_actor.step.remote(inp), timeout=STEP_TIMEOUT_S)
        except WorkerLost as exc:  # raised in the model actor; Ray hands it back wrapped
            lost = getattr(exc, "cause", exc)
            self.down.add(lost.shard)
            raise WorkerLost(str(lost), lost.shard) from None
        except (RayActorError, GetTimeoutError) as exc:
            self.model_down = True
            raise WorkerLost(f"the accelerator worker died ({type(exc).__name__}); restarting it") from None
        return StepOutput(sampled=sampled, timings_s=timings)

    def close(self) -> None:
        for a in [self.model_actor, *self.cpu_actors]:
            self.ray.kill(a, no_restart=True)
        if self._owns_ray:
            self.ray.shutdown()
