"""The hetero backend on Ray (`--executor ray`), in one of two shapes.

With `cpu_actors` 0 (the default), one BackendActor holds the model and the whole KV (the local
executor's backend: server.hetero.HeteroBackend, or server.offload.OffloadBackend with its pools on the
actor's GPU and host); each step goes to it over the step channel (server.channel: StepInput out,
StepOutput back, after the actor's token), one round trip a step.

With N >= 1, the model worker and N CPU attention workers are Ray actors, on one machine or across
a cluster:

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

import logging
import os
from dataclasses import replace
from pathlib import Path

from hetcore.backend import Backend, StepInput, StepOutput, WorkerLost
from server import channel
from server.backend_config import BackendConfig, RayConfig
from server.ray_actors import STEP_TIMEOUT_S, AttentionActor, BackendActor, ModelActor

log = logging.getLogger(__name__)


def _restartable(**env_vars) -> dict:
    """Ray actor options: restarted whenever it dies, with these environment variables."""
    return {"runtime_env": {"env_vars": env_vars}, "max_restarts": -1}


class RayBackend(Backend):
    """The backend over the actors; lives in the server process (the Ray driver)."""

    def __init__(self, model_dir: Path, config: BackendConfig, placement: RayConfig = RayConfig()):
        import ray

        from server.hetero import reserve_note

        self.config, c, num_actors = config, config, placement.cpu_actors
        actor_cpus = placement.actor_cpus or max(1, (os.cpu_count() or 1) // max(1, num_actors))
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if placement.address:
                ray.init(address=placement.address, log_to_driver=True)
            else:  # a local cluster sized for our actors (logical CPUs may exceed the cores)
                adopt_orphans()
                # Ray starts its workers at nice 15 by default: on a few cores the API process and the
                # engine thread would then preempt the actors that compute every step
                ray.init(num_cpus=max(os.cpu_count() or 1, num_actors * actor_cpus + 1), include_dashboard=False,
                         resources={placement.kv_resource: num_actors} if placement.kv_resource and num_actors else None,
                         _system_config={"worker_niceness": 0})
        self.ray = ray
        use_gpu = c.device == "cuda" or (c.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        model_opts = {"num_cpus": 1, **({"num_gpus": 1} if use_gpu else {})}
        threads = 0 if placement.address else os.cpu_count() or 1
        self.model_down = False
        self._unsent_frees: tuple[int, ...] = ()
        """Sequences freed while the model actor could not be told (it forwards frees to the CPU actors)."""
        self._open: frozenset[int] | None = None
        """The shards the backend actor said new sequences may go to after its last step (None: every live one)."""
        self._probes: dict = {}
        """Key -> the pending Ray call that tells whether an actor is back (one at a time: a call queued behind
        a busy actor's serve_steps never runs)."""
        if num_actors == 0:  # the KV in the model actor's process: its threads inherit the server's spinning
            self.model_actor = ray.remote(BackendActor).options(**model_opts, **_restartable()).remote(
                str(model_dir), c, threads)
            self.model_cfg = ray.get(self.model_actor.config.remote())
            self.kv_spec = ray.get(self.model_actor.kv_spec.remote())
            self.cpu_actors, self.first_blocks, self.down, self.device_blocks = [], [], set(), 0
            self._connect_all()
            log.info("Ray executor: the model actor holds the KV, %d blocks (%.1f MiB), %s%s%s", self.kv_spec.num_blocks,
                     self.kv_spec.num_blocks * self.kv_spec.bytes_per_block / 2**20, c.kv_format,
                     reserve_note(self.kv_spec), f", {self.kv_spec.shards[0]} of them on its accelerator (partial "
                     "offload)" if self.kv_spec.promote_to is not None else "")
        else:
            self._start_actors(model_dir, placement, model_opts, threads, actor_cpus, use_gpu)
        cfg = self.model_cfg
        self.max_model_len = min(c.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)

    def _start_actors(self, model_dir: Path, placement: RayConfig, model_opts: dict, threads: int, actor_cpus: int,
                      use_gpu: bool) -> None:
        """The model actor and placement.cpu_actors CPU attention actors, connected."""
        from server.hetero import kv_spec, reserve_note
        from server.kv_layout import layered_kv_spec

        ray, c, num_actors = self.ray, self.config, placement.cpu_actors
        # OpenMP threads that spin-wait after each op would steal the cores the other actors compute on
        # (measured on 2 cores at concurrency 8: an ACTIVE model actor made decode steps 4x slower than local).
        # The CPU actors' threads sleep at once; the model actor's spin ~2,000 turns first, enough to bridge
        # the gaps between one layer's ops but not the wait for attention (2 cores, side by side: 1.15x local
        # against 1.35x fully PASSIVE at concurrency 1, 1.15x against 1.21x at 8, even at 32)
        model_opts = {**model_opts, **_restartable(GOMP_SPINCOUNT="2000")}
        # layered KV: one micro-batch (a sequence's scores live in one worker)
        microbatches = 1 if c.kv_policy.is_layered else placement.microbatches or (2 if use_gpu else 1)
        self.model_actor = ray.remote(ModelActor).options(**model_opts).remote(str(model_dir), c, threads, microbatches)
        cfg = self.model_cfg = ray.get(self.model_actor.config.remote())
        self.device_blocks = ray.get(self.model_actor.device_blocks.remote())
        cal = ray.get(self.model_actor.thresholds.remote(c.oaken_thresholds_path)) if c.kv_format == "oaken" else None
        if c.kv_policy.is_layered:  # the full layers from the model's profile, as the actors' workers need them
            c = self.config = replace(c, kv_policy=ray.get(self.model_actor.kv_policy.remote(c.kv_policy)))
            shard = layered_kv_spec(c, cfg, c.kv_capacity_bytes // num_actors)
        else:
            shard = kv_spec(cfg, c.kv_format, c.kv_capacity_bytes // num_actors, c.block_size,
                            c.oaken_sparse_fraction, c.oaken_recent_blocks, c.lsh, c.max_num_seqs)
        num_blocks, per_block = shard.num_blocks, shard.bytes_per_block
        self.first_blocks = [self.device_blocks + i * num_blocks for i in range(num_actors)]
        actor_opts = {"num_cpus": actor_cpus, **_restartable(OMP_WAIT_POLICY="PASSIVE")}
        if placement.kv_resource:
            actor_opts["resources"] = {placement.kv_resource: 1}
        self.cpu_actors = [ray.remote(AttentionActor).options(**actor_opts).remote(cfg, c, num_blocks, first, cal,
                                                                                   actor_cpus)
                           for first in self.first_blocks]
        nd = self.device_blocks  # partial offload: the model actor's pool is shard 0, filled first
        self.kv_spec = replace(shard, num_blocks=nd + num_blocks * num_actors,
                               shards=((nd,) if nd else ()) + (num_blocks,) * num_actors, first_fit=bool(nd),
                               promote_to=0 if nd and c.lsh is None else None)
        self.down: set[int] = set(range(num_actors))
        self._connect_all()
        if self.down:
            raise RuntimeError(f"CPU attention actors {sorted(self.down)} did not start")
        log.info("Ray executor: %d CPU attention actors x %d CPUs, %d KV blocks each (%.1f MiB), %s%s%s",
                 num_actors, actor_cpus, num_blocks, num_blocks * per_block / 2**20, c.kv_format, reserve_note(shard),
                 f"; {nd} blocks on the model actor's accelerator first (partial offload)" if nd else "")

    def _connect_all(self, timeout_s: float = 300.0) -> None:
        if not self.cpu_actors:  # the backend actor: its step channel
            address, self._step_token = self.ray.get(self.model_actor.address.remote(), timeout=timeout_s)
            self._step_address = tuple(address)
            self._serving = self.model_actor.serve_steps.remote()  # until the actor dies; connect waits for it
            self._step_sock = channel.connect(self._step_address, STEP_TIMEOUT_S, self._step_token)
            return
        addresses = self.ray.get([a.address.remote() for a in self.cpu_actors], timeout=timeout_s)
        self.ray.get(self.model_actor.set_shards.remote(self.first_blocks, self.device_blocks))
        for s, address in enumerate(addresses):
            self.ray.get(self.model_actor.connect.remote(s, address))
            self.down.discard(s)

    def _poll(self) -> None:
        """Bring back actors Ray has restarted."""
        from ray.exceptions import RayError

        if self.model_down:
            if not self.cpu_actors and self._reconnect_step_channel():
                self.model_down = False
                log.warning("accelerator worker is back")
                return
            probe = self._probe("model", self.model_actor.config)
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
            probe = self._probe(s, self.cpu_actors[s].address)
            if self.ray.wait([probe], timeout=0)[0]:
                del self._probes[s]
                try:
                    self.ray.get(self.model_actor.connect.remote(s, self.ray.get(probe)))
                    self.down.discard(s)
                    log.warning("CPU attention worker %d is back", s)
                except (RayError, OSError) as exc:
                    log.warning("CPU attention worker %d not back yet: %s", s, exc)

    def _probe(self, key, method):
        """The pending call of `method` under `key`, made only if none is pending."""
        if key not in self._probes:
            self._probes[key] = method.remote()
        return self._probes[key]

    def _reconnect_step_channel(self, timeout_s: float = 1.0) -> bool:
        """Whether the backend actor, alive, took a new step connection (after a broken one); a restarted
        actor listens elsewhere and runs serve_steps only once _connect_all has asked it to."""
        from ray.exceptions import RayError

        if self.ray.wait([self._serving], timeout=0)[0]:  # serve_steps ended: the actor died
            try:
                self.ray.get(self._serving)  # its error, taken: Ray would log it as unhandled
            except RayError:
                pass
            return False
        try:
            self._step_sock = channel.connect(self._step_address, timeout_s, self._step_token)
        except OSError:
            return False
        self._step_sock.settimeout(STEP_TIMEOUT_S)
        return True

    def live_shards(self) -> set[int]:
        self._poll()
        if self.model_down:
            return set()
        if not self.cpu_actors:  # the backend actor's shards (partial offload's two pools), up with it
            return super().live_shards()
        base = self.shard_base
        return ({0} if base else set()) | {a + base for a in range(len(self.cpu_actors)) if a not in self.down}

    @property
    def shard_base(self) -> int:
        """The shard id of CPU actor 0: 1 where the model actor's accelerator pool is shard 0, else 0."""
        return 1 if self.device_blocks else 0

    def open_shards(self) -> set[int]:
        live = self.live_shards()
        return live if self._open is None else live & self._open

    def health(self) -> str:
        if self.model_down or (self.cpu_actors and len(self.down) == len(self.cpu_actors)):
            return "down"
        return "degraded" if self.down else "ok"

    def step(self, inp: StepInput) -> StepOutput:
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        # frees the model actor has not taken are kept for its next step (freeing twice is harmless)
        inp = replace(inp, freed_seq_ids=self._unsent_frees + tuple(inp.freed_seq_ids))
        self._unsent_frees = ()
        if self.model_down:
            self._unsent_frees = inp.freed_seq_ids
            raise WorkerLost("the accelerator worker is restarting")
        if not self.cpu_actors:
            return self._step_backend_actor(inp)
        try:
            out = self.ray.get(self.model_actor.step.remote(inp), timeout=STEP_TIMEOUT_S)
        except WorkerLost as exc:  # raised in the model actor, after it took the frees; Ray hands it back wrapped
            lost = exc.cause if isinstance(exc, RayTaskError) else exc
            self.down.add(lost.shard - self.shard_base)
            raise WorkerLost(str(lost), lost.shard) from None
        except (RayActorError, GetTimeoutError) as exc:
            self.model_down = True
            self._unsent_frees = inp.freed_seq_ids
            self._open = None
            raise WorkerLost(f"the accelerator worker died ({type(exc).__name__}); restarting it") from None
        self._open = out.open_shards
        return out

    def _step_backend_actor(self, inp: StepInput) -> StepOutput:
        try:
            channel.send_object(self._step_sock, inp)
            out = channel.recv_object(self._step_sock)
        except OSError as exc:  # timeouts and a dead actor alike: Ray restarts it, _poll reconnects
            self._step_sock.close()
            self.model_down = True
            self._unsent_frees = inp.freed_seq_ids
            self._open = None  # a restarted actor's pools start open
            raise WorkerLost(f"the accelerator worker is lost ({type(exc).__name__}); restarting it") from None
        if isinstance(out, Exception):
            raise out
        self._open = out.open_shards
        return out

    def close(self) -> None:
        if not self.cpu_actors:
            self._step_sock.close()
        for a in [self.model_actor, *self.cpu_actors]:
            self.ray.kill(a, no_restart=True)
        if self._owns_ray:
            stop_local_ray(self.ray)


def adopt_orphans() -> None:
    """Make this process the child subreaper of its descendants (Linux), so that processes whose parent
    dies are re-parented to it instead of to init: Ctrl-C reaches the whole process group, the raylet
    can exit first, and its agents must still be found (and stopped) as our descendants."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def stop_local_ray(ray, grace_s: float = 5.0) -> None:
    """ray.shutdown(), then end every process the local cluster started that outlived it.

    Ray's agents (dashboard agent, runtime-env agent) are the raylet's children and exit on their own
    only some tens of seconds after it; the daemon must leave nothing behind when it stops."""
    import psutil

    def is_ray(p: psutil.Process) -> bool:
        try:
            return "ray" in " ".join(p.cmdline())
        except psutil.Error:
            return False

    # before shutdown, while they are still our descendants (a test may have other children: keep them)
    started = [p for p in psutil.Process().children(recursive=True) if is_ray(p)]
    ray.shutdown()
    alive = [p for p in started if p.is_running()]
    for p in alive:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)  # reap them: they may be our children now
    if alive:
        log.warning("killed %d Ray processes that did not stop within %.0f s", len(alive), grace_s)
