"""A minimal, fast OpenAI-compatible streaming endpoint for measuring the load generator itself
(benchmarks/bench_loadgen.py) and for client tests. Not a model: every output chunk is the text " tok".

    python -m loadgen.fake_server --port 8123 [--ttft-ms 0] [--itl-ms 0] [--fail-every 0]

Plain asyncio streams, HTTP/1.1 keep-alive, chunked SSE. Each chunk's send time (time.perf_counter, the
system-wide monotonic clock on Linux) is kept per X-Request-Id header and served (then cleared) at
GET /stamps, so a client on the same machine can compare its own stamps with the server's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class FakeServerState:
    """Behaviour and the send stamps of every request seen."""

    ttft_s: float = 0.0
    itl_s: float = 0.0
    fail_every: int = 0  # every Nth generation request gets HTTP 500 (0: never)
    stream_error_every: int = 0  # every Nth generation request streams one token, then an error event (0: never)
    is_usage_supported: bool = True  # False: never send usage, like servers without stream_options
    num_requests: int = 0
    stamps: dict[str, list[float]] = field(default_factory=dict)


def _response(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse_chunks(chat: bool, num_tokens: int, num_prompt_tokens: int) -> tuple[bytes, bytes, bytes]:
    """(token chunk, finish chunk with usage, [DONE]) as SSE events."""
    if chat:
        tok = {"id": "fake", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": " tok"}}]}
    else:
        tok = {"id": "fake", "object": "text_completion", "choices": [{"index": 0, "text": " tok"}]}
    usage = {"id": "fake", "choices": [], "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_tokens,
                                                    "total_tokens": num_prompt_tokens + num_tokens}}
    return (b"data: " + json.dumps(tok).encode() + b"\n\n", b"data: " + json.dumps(usage).encode() + b"\n\n",
            b"data: [DONE]\n\n")


async def _generate(state: FakeServerState, writer: asyncio.StreamWriter, body: dict, chat: bool, rid: str) -> None:
    n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    prompt = body.get("messages", [{}])[0].get("content", "") if chat else body.get("prompt", "")
    tok, usage, done = _sse_chunks(chat, n, len(str(prompt).split()))
    is_usage = state.is_usage_supported and bool((body.get("stream_options") or {}).get("include_usage"))
    if state.stream_error_every and state.num_requests % state.stream_error_every == 0:
        n, done = 1, b'data: {"error": {"message": "injected stream failure", "code": 500}}\n\n'
        is_usage = False
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    stamps = state.stamps.setdefault(rid, []) if rid else None
    if state.ttft_s:
        await asyncio.sleep(state.ttft_s)
    tok_chunk = _chunk(tok)
    for i in range(n):
        if i and state.itl_s:
            await asyncio.sleep(state.itl_s)
        writer.write(tok_chunk)
        if stamps is not None:
            stamps.append(time.perf_counter())
        if state.itl_s:
            await writer.drain()
    writer.write((_chunk(usage) if is_usage else b"") + _chunk(done) + b"0\r\n\r\n")
    await writer.drain()


async def _serve_one(state: FakeServerState, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    raw = await reader.readexactly(int(headers.get("content-length", 0)))
    if method == "GET" and path == "/v1/models":
        writer.write(_response("200 OK", b'{"object": "list", "data": [{"id": "fake"}]}'))
    elif method == "GET" and path == "/stamps":
        writer.write(_response("200 OK", json.dumps(state.stamps).encode()))
        state.stamps = {}  # served once: the next run starts clean
    elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
        state.num_requests += 1
        if state.fail_every and state.num_requests % state.fail_every == 0:
            writer.write(_response("500 Internal Server Error", b'{"error": {"message": "injected failure"}}'))
        else:
            await _generate(state, writer, json.loads(raw), path.endswith("chat/completions"),
                            headers.get("x-request-id", ""))
    else:
        writer.write(_response("404 Not Found", b'{"error": {"message": "no such route"}}'))
    await writer.drain()


async def serve(port: int, state: FakeServerState, host: str = "127.0.0.1") -> asyncio.base_events.Server:
    """Start listening; requests on one connection are served in order (keep-alive)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await _serve_one(state, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, backlog=4096)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft-ms", type=float, default=0.0)
    ap.add_argument("--itl-ms", type=float, default=0.0)
    ap.add_argument("--fail-every", type=int, default=0)
    args = ap.parse_args()
    state = FakeServerState(args.ttft_ms / 1e3, args.itl_ms / 1e3, args.fail_every)

    async def run() -> None:
        server = await serve(args.port, state)
        print(f"fake endpoint on http://127.0.0.1:{args.port}", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


if __name__ == "__main__":
    main()
