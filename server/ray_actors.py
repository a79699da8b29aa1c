"""The Ray actors behind `--executor ray` (see server/ray_executor.py for the whole picture):
ModelActor, the accelerator side, and AttentionActor, one shard of the KV cache each. They talk
per layer over direct TCP connections (server.channel), not through Ray. BackendActor is both in one
process (the local executor's backend in an actor), for the KV on the model's own node."""
from __future__ import annotations

import bisect
import logging
import os
import pickle
import secrets
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hetcore.backend import StepInput, StepOutput, StepTimings, WorkerLost
from server import channel
from server.backend_config import BackendConfig
from server.memory import Trimmer

log = logging.getLogger(__name__)
STEP_TIMEOUT_S = 600.0
"""A step that takes longer than this counts as a lost accelerator worker."""


def _set_threads(n: int) -> None:
    import numba

    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


class AttentionActor:
    """One shard of the KV cache: an AttentionWorker behind a TCP listener (one model actor at a time)."""

    def __init__(self, cfg, config: BackendConfig, num_blocks: int, first_block: int, cal, threads: int):
        """cfg: the model's ModelConfig; blocks [first_block, first_block + num_blocks) of the engine's ids are here."""
        import ray

        from cpu_attn.worker import AttentionWorker
        from server.hetero import attention_worker
        from server.kv_layout import layered_attention_worker

        self.threads = threads  # set by the channel thread, which runs the kernels (_serve)
        if config.kv_policy.is_layered:  # one micro-batch a step: a sequence's scores stay in this worker
            self.worker = layered_attention_worker(config, cfg, num_blocks, cal)
            self.workers = [self.worker]
        else:
            self.worker = attention_worker(cfg, config.kv_format, num_blocks, config.block_size, cal,
                                           config.oaken_sparse_fraction, config.oaken_recent_blocks, config.lsh)
            # micro-batch 1 has its own step plan over the same store and tables
            self.workers = [self.worker, AttentionWorker(self.worker.store, cfg.head_dim, self.worker.sparse)]
        self.trimmer = Trimmer()
        self.first_block = first_block
        self._listener = socket.create_server((ray.util.get_node_ip_address(), 0))
        threading.Thread(target=self._serve, name="attention-channel", daemon=True).start()

    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def pid(self) -> int:
        return os.getpid()

    def _serve(self) -> None:
        _set_threads(self.threads)  # Numba's thread count is per calling thread: this one runs the kernels
        channel.serve(self._listener, self._attend_until_closed)

    def _attend_until_closed(self, conn: socket.socket) -> None:
        while True:
            self._handle(conn, *channel.recv(conn))

    def _layout(self, num_tokens, start, table, seq_id, drafts, view=None):
        """A chunk's layout as the model actor sent it (wire_layout), in this shard's block ids."""
        from cpu_attn.layered_worker import LayeredChunkLayout
        from cpu_attn.worker import ChunkLayout
        from hetcore.kv_policy import KVView

        if view is None:
            return ChunkLayout(num_tokens, start, self._local(table), seq_id, drafts)
        tables, before, after, observed = view
        return LayeredChunkLayout(num_tokens, start, self._local(table), seq_id, drafts, kv_view=KVView(
            tuple(map(self._local, tables)), tuple(before), tuple(after), observed))

    def _local(self, table: list[int]) -> tuple[int, ...]:
        """Engine block ids -> this store's; one outside this shard is refused (the kernels do not check bounds)."""
        ids = np.asarray(table, dtype=np.int64) - self.first_block
        if ids.size and (ids.min() < 0 or ids.max() >= self.worker.store.num_blocks):
            raise ValueError(f"block ids {table[:4]}... are outside this shard's {self.worker.store.num_blocks} "
                             f"blocks from {self.first_block}")
        return tuple(ids.tolist())

    def _handle(self, conn: socket.socket, h: dict, arrays: list[np.ndarray]) -> None:
        if h["op"] == "free":
            self.worker.free(h["seq_ids"])
            return
        try:
            if h["op"] == "gather":  # a sequence moving to the accelerator's pool: its KV, then it is forgotten here
                table = [b - self.first_block for b in h["table"]]
                kv = [self.worker.store.gather(layer, table, h["num_tokens"])
                      for layer in range(self.worker.store.num_layers)]
                self.worker.free([h["seq_id"]])
                wire = np.dtype(h["dtype"])  # float16 where the pool keeps 16 bits or fewer: half the bytes
                channel.send(conn, {}, [np.stack([k for k, _ in kv]).astype(wire, copy=False),
                                        np.stack([v for _, v in kv]).astype(wire, copy=False)])
                return
            worker = self.workers[h["mb"]]
            if "layout" in h:
                worker.begin_step([self._layout(*entry) for entry in h["layout"]])
            q, k, v, *codes = (torch.from_numpy(a) for a in arrays)
            o = worker.attend(h["layer"], q, k, v, tuple(codes) or None)
            reply = worker.take_timings() if h.get("last") else {}
            centers = worker.take_centers()  # for the coder: sequences that started after a cached prefix
            if centers:
                reply["centers"] = [[seq, layer] for seq, layer, _ in centers]
            channel.send(conn, reply, [o.numpy(), *(mu for _, _, mu in centers)])
            if h.get("last"):
                self.trimmer.worked()
                self.trimmer.maybe_release()  # server/memory.py
        except Exception as exc:  # reported to the model actor, which fails the step
            log.exception("attention failed")
            channel.send(conn, {"error": f"{type(exc).__name__}: {exc}"})


def wire_layout(lay) -> list:
    """A chunk layout as a frame header carries it to a CPU attention actor (AttentionActor._layout reads it): its
    fields, and a layered chunk's rows in the later layer groups."""
    from cpu_attn.layered_worker import LayeredChunkLayout

    entry = [lay.num_tokens, lay.start_pos, list(lay.block_table), lay.seq_id, lay.num_draft]
    if isinstance(lay, LayeredChunkLayout) and lay.kv_view is not None:
        v = lay.kv_view
        entry.append([[list(t) for t in v.tables], list(v.rows_before), list(v.keep_after), v.observed])
    return entry


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


class BackendActor:
    """The model worker and the whole KV cache in one process: the local executor's backend in an actor
    (server.offload.build_backend: with partial offload where it runs, decided on the actor's node), no
    per-layer exchange. Steps come over the step channel (server.channel: a Ray call costs ~2.4 ms a step on
    2 cores, a loopback frame tens of microseconds): StepInput in, StepOutput (or the step's exception) out.

    serve_steps() runs the channel on the actor's main thread, the thread that loaded the model: from a
    second thread the steps took ~20 % longer at one sequence (OpenMP regions started from another thread
    than the start-up's pay more, see server.launch.start_engine). It never returns, so it is the last
    call the actor takes (a sync actor runs one method at a time)."""

    def __init__(self, model_dir: str, config: BackendConfig, threads: int):
        import ray

        from server.offload import build_backend

        if threads:
            _set_threads(threads)
        self.backend = build_backend(Path(model_dir), config)
        self.trimmer = Trimmer()
        self.token = secrets.token_bytes(16)
        self._listener = socket.create_server((ray.util.get_node_ip_address(), 0))

    def config(self):
        return self.backend.model_cfg

    def kv_spec(self):
        return self.backend.kv_spec

    def address(self) -> tuple[tuple[str, int], bytes]:
        """Where the step channel listens, and the token a connection must send first."""
        return self._listener.getsockname()[:2], self.token

    def serve_steps(self) -> None:
        channel.serve(self._listener, self._step_until_closed)

    def _step_until_closed(self, conn: socket.socket) -> None:
        if not channel.admit(conn, self.token):
            log.warning("step channel: refused a connection without the token")
            return
        while True:
            out = self._step(channel.recv_object(conn))
            try:
                channel.send_object(conn, out)
            except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
                channel.send_object(conn, RuntimeError(f"{type(out).__name__}: {out}"))

    def _step(self, inp: StepInput) -> StepOutput | Exception:
        self.trimmer.maybe_release()  # what the previous steps freed (server/memory.py)
        self.trimmer.worked()
        try:
            return self.backend.step(inp)
        except Exception as exc:  # the server raises it, as a Ray call would
            log.exception("step failed")
            return exc


class ModelActor:
    """The accelerator side: the model worker, one channel per CPU attention actor and, with partial offload, the
    accelerator's KV pool (server/offload.py): block ids [0, Nd) are shard 0, attended here; the CPU actors' blocks
    follow, actor a being shard a + 1. A step's sequences placed here are one micro-batch of their own, attended
    on the accelerator while the CPU actors attend the others'."""

    def __init__(self, model_dir: str, config: BackendConfig, threads: int, microbatches: int):
        from server.hetero import model_worker, pick_device, pick_dtype
        from server.offload import OffloadGuard, device_pool

        if threads:
            _set_threads(threads)
        device = pick_device(config.device)
        self.model_dir = Path(model_dir)
        self.model = config.load_model(self.model_dir, device, pick_dtype(config.dtype, device))
        self.worker = model_worker(self.model, config.lsh, device)
        self.device_attn = device_pool(self.model, config) if config.offloads(torch.cuda.is_available()) else None
        self.guard = OffloadGuard()
        self.base = 0 if self.device_attn is None else 1
        """The shard id of CPU actor 0."""
        self.addresses: list[tuple[str, int] | None] = []
        self.first_blocks: list[int] = []
        self.socks: list[socket.socket | None] = []
        self.pending_free: list[list[int]] = []
        self.microbatches = microbatches
        self.trimmer = Trimmer()

    def config(self):
        return self.model.cfg

    def kv_policy(self, policy):
        """`policy` with its full layers chosen from this model's attention profile where it leaves them open."""
        from server.hetero import kv_full_layers

        if policy.is_layered and policy.full_layers is None:
            return policy.with_full_layers(kv_full_layers(self.model, self.model_dir))
        return policy

    def device_blocks(self) -> int:
        """Blocks of the accelerator's KV pool, shard 0 (0: no partial offload)."""
        return 0 if self.device_attn is None else self.device_attn.num_blocks

    def thresholds(self, path: str | None):
        from server.hetero import oaken_thresholds

        return oaken_thresholds(self.model, self.model_dir, path)

    def set_shards(self, first_blocks: list[int], device_blocks: int) -> None:
        """The CPU actors' first block ids, and the accelerator pool's blocks the server allocates in (a restarted
        actor sized its pool again from what the device has free: it takes the server's size)."""
        from gpu_model.device_attn import DeviceAttentionWorker

        if self.device_attn is not None and self.device_attn.num_blocks != device_blocks:
            pool, self.device_attn = self.device_attn, None  # released before the new pool takes its room
            cfg, dev, dtype, block_size = self.model.cfg, pool.k_cache.device, pool.k_cache.dtype, pool.block_size
            del pool
            self.device_attn = DeviceAttentionWorker(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                                                     device_blocks, dev, dtype)
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
        return WorkerLost(f"CPU attention worker {shard} lost: {type(exc).__name__}: {exc}", shard + self.base)

    def step(self, inp: StepInput) -> StepOutput:
        from server.hetero import flatten, sample_batches

        t0 = time.perf_counter()
        self.trimmer.maybe_release()  # what the previous steps freed (server/memory.py)
        self.trimmer.worked()
        self.worker.free(inp.freed_seq_ids)
        for s, pending in enumerate(self.pending_free):
            pending.extend(inp.freed_seq_ids)
            if pending and self.socks[s] is not None:
                self._send(s, {"op": "free", "seq_ids": pending}, [])
                pending.clear()
        for move in inp.moves:
            self._move(move)
        if not inp.chunks:
            return StepOutput(sampled={})
        nd = self.device_blocks()
        host = [c for c in inp.chunks if c.block_table[0] >= nd]
        mbs = [self._micro_batch(c) for c in split(host, self.microbatches)] if host else []
        here = tuple(c for c in inp.chunks if c.block_table[0] < nd)  # attended on the accelerator, a micro-batch
        if here:
            b = flatten(StepInput(here))
            self.device_attn.begin_step(b.layouts)
            mbs.append((b, None))
        pending: dict[int, torch.Tensor] = {}
        busy: dict[int, float] = {}
        dense: float | None = None  # of busy, the layers MagicPIG keeps exact (with a sparse part)
        centers: list = []  # key centers the CPU actors chose (AttentionWorker.take_centers), for the coder
        last = self.model.cfg.num_layers - 1

        # Between the first send and the last reply the CPU actors may hold every core: no torch op
        # (an OpenMP parallel region waits for a thread with no core to run on) before all frames are
        # out, and the shards' rows are gathered and scattered with NumPy, on this thread.
        def send(m, layer, q, k, v, codes):
            if mbs[m][1] is None:  # on the accelerator's pool
                pending[m] = self.device_attn.attend(layer, q, k, v)
                return
            arrays = [t.numpy() for t in (q, k, v, *(codes or ()))]  # codes: the decode rows' q codes, k codes
            frames = [(s, layout, arrays if rows is None else [a[decodes if i == 3 else rows]
                                                               for i, a in enumerate(arrays)])
                      for s, (rows, decodes, layout) in mbs[m][1].items()]
            for s, layout, shard_arrays in frames:
                h = {"op": "attend", "mb": m, "layer": layer, "last": layer == last}
                if layer == 0:
                    h["layout"] = layout
                self._send(s, h, shard_arrays)

        def recv(m):
            nonlocal dense
            b, parts = mbs[m]
            if parts is None:
                return pending.pop(m)
            out = None
            for s, (rows, _, _) in parts.items():
                h, arrays = self._recv(s)
                if "error" in h:
                    raise RuntimeError(f"CPU attention worker {s}: {h['error']}")
                busy[s] = busy.get(s, 0.0) + h.get("cpu_attn", 0.0)
                centers.extend((seq, layer, mu) for (seq, layer), mu in zip(h.get("centers", ()), arrays[1:]))
                if "cpu_attn_dense" in h:
                    dense = (dense or 0.0) + h["cpu_attn_dense"]
                if rows is None:
                    out = arrays[0]
                else:
                    out = out if out is not None else np.empty((len(b.token_ids), arrays[0].shape[1]), arrays[0].dtype)
                    out[rows] = arrays[0]
            return torch.from_numpy(out)

        logits, accel_s = self.worker.forward_pipelined(
            [(b.token_ids, b.positions, b.logit_rows, b.chunks) for b, _ in mbs], send, recv,
            on_device=[parts is None for _, parts in mbs])
        self.worker.set_centers(centers)
        t1 = time.perf_counter()
        out = sample_batches(logits, [b for b, _ in mbs])
        step_s = time.perf_counter() - t0
        accel_s += time.perf_counter() - t1
        if self.device_attn is None:
            return replace(out, timings=StepTimings(accelerator_s=accel_s, cpu_attn_s=sum(busy.values()), step_s=step_s,
                                                    cpu_attn_dense_s=dense, cpu_attn_max_s=max(busy.values())))
        self.guard.observe(len(here), len(host), step_s, max(busy.values(), default=0.0), accel_s,
                           is_decode=inp.is_decode)
        timings = StepTimings(accelerator_s=accel_s, cpu_attn_s=sum(busy.values()), step_s=step_s,
                              cpu_attn_dense_s=dense, cpu_attn_max_s=max(busy.values(), default=None),
                              gpu_attn_s=self.device_attn.take_timings()["gpu_attn"])
        return replace(out, timings=timings, open_shards=self.guard.shards(len(self.first_blocks) + 1))

    def _move(self, move) -> None:
        """A sequence's KV copied from its CPU actor (which then forgets it) into its new blocks of the accelerator's
        pool (StepInput.moves), before the step: float16 on the wire unless the pool is float32 (bf16 and fp8 keep
        fewer bits), every layer's rows in one frame each for K and V."""
        s = bisect.bisect_right(self.first_blocks, move.src_table[0]) - 1
        if self.socks[s] is None:
            raise self._lost(s, ConnectionError("not connected"))
        wire = "float32" if self.device_attn.k_cache.dtype == torch.float32 else "float16"
        self._send(s, {"op": "gather", "table": list(move.src_table), "num_tokens": move.num_tokens,
                       "seq_id": move.seq_id, "dtype": wire}, [])
        h, arrays = self._recv(s)
        if "error" in h:
            raise RuntimeError(f"CPU attention worker {s}: {h['error']}")
        k, v = arrays
        for layer in range(len(k)):
            self.device_attn.load(layer, move.dst_table, torch.from_numpy(k[layer]), torch.from_numpy(v[layer]))

    def _micro_batch(self, chunks) -> tuple:
        """The flat batch of `chunks` and, per shard, (its rows and its rows among the decode rows
        (one-token chunks, which alone have query codes), or None, None for all; its chunk layouts)."""
        from server.hetero import flatten

        b = flatten(StepInput(tuple(chunks)))
        parts: dict[int, tuple[list[int], list[int], list]] = {}
        row = decode = 0
        for c, lay in zip(chunks, b.layouts):
            s = bisect.bisect_right(self.first_blocks, c.block_table[0]) - 1
            if self.socks[s] is None:
                raise self._lost(s, ConnectionError("not connected"))
            rows, decodes, layout = parts.setdefault(s, ([], [], []))
            rows.extend(range(row, row + len(c.token_ids)))
            if len(c.token_ids) == 1:
                decodes.append(decode)
                decode += 1
            layout.append(wire_layout(lay))
            row += len(c.token_ids)
        if len(parts) == 1:
            return b, {s: (None, None, layout) for s, (_, _, layout) in parts.items()}
        return b, {s: (np.array(rows), np.array(decodes, np.int64), layout)
                   for s, (rows, decodes, layout) in parts.items()}

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
