"""Decode step time of the Ray executor against the local one, in one run, plus what one layer's
exchange costs over each channel Ray offers.

    python -m benchmarks.bench_executor [--concurrency 1 8 32] [--prompt-tokens 256] [--output-tokens 32] [--out F]

Engines (in this process, no HTTP): `local`; `ray-1process`, the Ray default: one actor holds the model and
the KV (`--ray-cpu-actors 0`), one step-channel round trip a step; `ray` with 2 CPU attention actors, 1 micro-batch;
`ray-mb2` the same with the batch split into 2 pipelined micro-batches; `ray-1actor` with one CPU
attention actor holding all the KV with the machine's cores as its threads. Each concurrency level c
sends c requests at once (prompts of --prompt-tokens, exactly --output-tokens out, fp32 KV) to
each engine in turn, in --repeats rounds; the decode step time is the median over steps in which
every chunk is one token, and `vs_local` the median over rounds of the ratio to the local engine
in the same round, because a shared machine's speed can drift by up to 3x over minutes. `hidden` is the share of the CPU
attention time (slowest shard) during which the model actor did not wait for it.

Exchange: one layer of a 32-sequence decode (q [32, 9, 64], k and v [32, 3, 64] out to each of 2
actors, o [32, 576] back): our TCP channel, a Ray actor call per layer, and a Ray Compiled Graph
(30 layers unrolled, per layer).
"""
from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import numpy as np

from benchmarks.common import machine, print_table, write_json


def engine_for(executor: str, microbatches: int = 1, cpu_actors: int = 2):
    from server.launch import start_engine, warm_up
    from server.config import ServeConfig

    cfg = ServeConfig(executor=executor, ray_cpu_actors=cpu_actors, ray_microbatches=microbatches, kv_format="fp32",
                      kv_cache_bytes=1 << 30, max_num_seqs=64, max_num_batched_tokens=2048)
    engine = start_engine(cfg)[0]  # built on its own thread, as `hetserve serve` does
    warm_up(engine)
    return engine


def decode_steps(engine, concurrency: int, prompt_tokens: int, output_tokens: int) -> list[dict]:
    """Timings of the decode-only steps while `concurrency` requests run to the end."""
    from hetcore.backend import SamplingParams
    from server.request import EngineRequest

    steps, step = [], engine.backend.step

    def timed(inp):
        t0 = time.perf_counter()
        out = step(inp)
        if all(len(c.token_ids) == 1 for c in inp.chunks):
            steps.append({**(out.timings.parts() if out.timings else {}), "wall": time.perf_counter() - t0, "batch": len(inp.chunks)})
        return out

    engine.backend.step = timed
    done = threading.Semaphore(0)
    for i in range(concurrency):
        prompt = [(1000 + 17 * i + j) % 40000 + 10 for j in range(prompt_tokens)]
        engine.submit(EngineRequest(f"b{i}-{time.monotonic()}", prompt, SamplingParams(temperature=0.0), output_tokens,
                                    on_event=lambda ev: ev.finish_reason and done.release(), ignore_eos=True))
    for _ in range(concurrency):
        assert done.acquire(timeout=600), "request did not finish"
    engine.backend.step = step
    full = [s for s in steps if s["batch"] == concurrency] or steps
    return full


def exchange(repeats: int = 200) -> list[dict]:
    import ray
    from ray.dag import InputNode

    from server import channel

    q = np.random.rand(32, 9, 64).astype(np.float32)
    kv = np.random.rand(32, 3, 64).astype(np.float32)

    class Echo:
        def __init__(self):
            self.sock = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=self._serve, daemon=True).start()

        def address(self):
            return self.sock.getsockname()

        def _serve(self):
            conn, _ = self.sock.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                _, (a, *_) = channel.recv(conn)
                channel.send(conn, {}, [a.reshape(len(a), -1)])

        def attend(self, layer, a, k=None, v=None):
            return a.reshape(len(a), -1)

    class Model:
        def start(self, x):
            return x, x

        def layer(self, layer, *outs):
            return tuple(o.reshape(q.shape) for o in outs)

        def finish(self, *outs):
            return len(outs)

    actors = [ray.remote(num_cpus=0)(Echo).remote() for _ in range(2)]
    socks = [channel.connect(tuple(a), 30) for a in ray.get([a.address.remote() for a in actors])]
    rows = []

    def timeit(name, fn, per=1):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats // per):
            fn()
        rows.append({"channel": name, "layer_exchange_us": (time.perf_counter() - t0) / (repeats // per * per) * 1e6})

    def tcp():
        for s in socks:
            channel.send(s, {"layer": 0}, [q, kv, kv])
        for s in socks:
            channel.recv(s)

    timeit("tcp (server.channel)", tcp)
    timeit("ray actor call", lambda: ray.get([a.attend.remote(0, q, kv, kv) for a in actors]))
    model = ray.remote(num_cpus=0)(Model).remote()
    layers = 30
    with InputNode() as inp:
        shards = model.start.options(num_returns=2).bind(inp)
        for layer in range(layers):
            outs = [a.attend.bind(layer, s) for a, s in zip(actors, shards)]
            if layer < layers - 1:
                shards = model.layer.options(num_returns=2).bind(layer, *outs)
        dag = model.finish.bind(*outs).experimental_compile()
    timeit("ray compiled graph", lambda: ray.get(dag.execute(q)), per=layers)
    dag.teardown()
    for a in [*actors, model]:
        ray.kill(a)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="executor.json", help="file name under benchmarks/results/")
    args = p.parse_args()

    import ray

    ray.init(num_cpus=16, resources={"kv_node": 8}, include_dashboard=False)  # room for both Ray engines' actors
    engines = {"local": engine_for("local"), "ray-1process": engine_for("ray", cpu_actors=0),
               "ray": engine_for("ray", 1), "ray-mb2": engine_for("ray", 2),
               "ray-1actor": engine_for("ray", 1, cpu_actors=1)}
    samples: dict[tuple[str, int], list[dict]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    for c in args.concurrency:
        for rep in range(args.repeats):
            medians = {}
            for name, engine in engines.items():
                steps = decode_steps(engine, c, args.prompt_tokens, args.output_tokens)
                samples.setdefault((name, c), []).extend(steps)
                medians[name] = statistics.median(s["wall"] for s in steps)
                print(f"  c={c} round {rep + 1}/{args.repeats} {name}: {medians[name] * 1e3:.1f} ms per decode step",
                      flush=True)
            for name in engines:  # against the local engine of the same round: the VM's speed drifts
                ratios.setdefault((name, c), []).append(medians[name] / medians["local"])
    rows = []
    for c in args.concurrency:
        for name in engines:
            ss = samples[name, c]
            step_ms = statistics.median(s["wall"] for s in ss) * 1e3
            row = {"executor": name, "concurrency": c, "decode_step_ms": step_ms,
                   "vs_local": statistics.median(ratios[name, c]),
                   "accel_ms": statistics.median(s["accelerator"] for s in ss) * 1e3,
                   "cpu_attn_ms": statistics.median(s.get("cpu_attn_max", s["cpu_attn"]) for s in ss) * 1e3}
            if "cpu_attn_max" in ss[0]:  # CPU attention actors
                wait = sum(s["step"] - s["accelerator"] for s in ss)
                row["hidden"] = max(0.0, 1 - wait / sum(s["cpu_attn_max"] for s in ss))
            rows.append(row)
    for engine in engines.values():
        engine.stop()
    print_table(rows, ["executor", "concurrency", "decode_step_ms", "vs_local", "accel_ms", "cpu_attn_ms", "hidden"])

    ex = exchange()
    ray.shutdown()
    print_table(ex, ["channel", "layer_exchange_us"])
    path = write_json(args.out, {"machine": machine(), "args": vars(args), "decode": rows, "exchange": ex})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
