"""Open-loop dispatch: each request is sent at its scheduled time whether or not earlier ones have
finished (an optional concurrency cap holds requests in the client until a slot frees)."""
from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass

import aiohttp

from loadgen.client import Endpoint, RequestRecord, RequestSpec, send


@dataclass(frozen=True)
class RunResult:
    """Every request's record (in the order of the specs) and the run's wall time."""

    records: tuple[RequestRecord, ...]
    duration_s: float  # first send to last response end (vLLM's benchmark duration)
    max_concurrency: int | None
    started_at_perf_s: float = 0.0  # time.perf_counter() at the run's start; *_at_s offsets are from here


async def served_model(base_url: str, api_key: str | None = None,
                       timeout_s: float = 10.0) -> tuple[str | None, int | None]:
    """(id, max_model_len) of the first model of GET /v1/models; None for what the endpoint does not say
    (max_model_len is a vLLM/hetserve extension)."""
    root = base_url.rstrip("/")
    root = root.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s, \
                s.get(root + "/v1/models", headers=headers) as r:
            data = (await r.json()).get("data") if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None, None
    if not data or not isinstance(data, list) or not isinstance(data[0], dict):
        return None, None
    limit = data[0].get("max_model_len")
    return (str(data[0]["id"]) if "id" in data[0] else None), (int(limit) if isinstance(limit, int) else None)


class _Progress:
    """A live tqdm bar: completed requests, in flight, failed."""

    def __init__(self, total: int, is_enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", desc="requests", disable=not is_enabled, smoothing=0.1)
        self.in_flight = self.failed = 0

    def started(self) -> None:
        self.in_flight += 1

    def done(self, rec: RequestRecord) -> None:
        self.in_flight -= 1
        self.failed += not rec.is_success
        self.bar.update(1)

    async def ticker(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.bar.set_postfix(in_flight=self.in_flight, failed=self.failed, refresh=False)


async def _dispatch(session: aiohttp.ClientSession, specs: list[RequestSpec], ep: Endpoint,
                    gate: asyncio.Semaphore | None, progress: _Progress, count_output) -> tuple[list, float]:
    """Create each request's task at its arrival time; returns (records in spec order, start perf_counter)."""
    records: list[RequestRecord | None] = [None] * len(specs)

    async def one(pos: int, t0: float) -> None:
        if gate is not None:
            await gate.acquire()
        progress.started()
        try:
            rec = await send(session, ep, specs[pos], t0, count_output)
        finally:
            if gate is not None:
                gate.release()
        records[pos] = rec
        progress.done(rec)

    tasks = []
    t0 = time.perf_counter()
    for i in sorted(range(len(specs)), key=lambda i: specs[i].arrival_s):
        delay = t0 + specs[i].arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, t0)))
    await asyncio.gather(*tasks)
    return records, t0


async def run_requests(specs: list[RequestSpec], ep: Endpoint, max_concurrency: int | None = None,
                       show_progress: bool = True, count_output=None) -> RunResult:
    """Send `specs` open-loop at their `arrival_s` (s from now); returns when every response has ended."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max concurrency must be >= 1, got {max_concurrency}")
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = _Progress(len(specs), show_progress)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=ep.timeout_s, sock_connect=min(ep.timeout_s, 30.0))
    # Everything allocated so far (a tokenizer, torch, prompts) leaves the collector's view: otherwise its
    # full collections walk millions of objects and stall the event loop for seconds mid-run.
    gc.collect()
    gc.freeze()
    ticker = asyncio.create_task(progress.ticker())
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**18) as session:
            records, t0 = await _dispatch(session, specs, ep, gate, progress, count_output)
    finally:
        ticker.cancel()
        progress.bar.close()
        gc.unfreeze()
    done = [r for r in records if r is not None]
    assert len(done) == len(specs), "every request ends with a record"
    first = min((r.send_at_s for r in done), default=0.0)
    duration = max((r.done_at_s for r in done), default=0.0) - first
    return RunResult(tuple(done), duration, max_concurrency, t0)


def make_specs(prompts, requests) -> list[RequestSpec]:
    """Pair prompts (loadgen.prompts.Prompt) with trace requests (loadgen.traces.TraceRequest)."""
    return [RequestSpec(i, r.arrival_s, p.text, p.num_tokens, r.num_output_tokens)
            for i, (p, r) in enumerate(zip(prompts, requests, strict=True))]
