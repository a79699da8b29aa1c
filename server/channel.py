"""Direct TCP channels between the Ray executor's processes.

The per-layer channel between the model worker and a CPU attention worker: NumPy arrays and a small
JSON header over one TCP connection, no pickle.

    frame = u32 header length | header JSON | array bytes, back to back
    header = {..., "arrays": [[dtype, shape], ...]}

One frame per layer and direction; a loopback round trip costs tens of microseconds, where a
Ray task or a Ray Compiled Graph hop costs about a millisecond on a 2-core machine
(benchmarks/bench_executor.py, its `exchange` part).

The step channel between the server and a backend actor: one pickled object a frame each way
(u64 length | pickle), on a connection that first sent the actor's secret token and got one byte back
(`connect(token=)`, `admit`): a peer that does not know the token never reaches the unpickler.
"""
from __future__ import annotations

import hmac
import json
import pickle
import socket
import struct

import numpy as np

_LEN = struct.Struct("<I")
_LEN64 = struct.Struct("<Q")
_ADMITTED = b"\x01"


class ChannelClosed(ConnectionError):
    """The other end went away."""


def send(sock: socket.socket, header: dict, arrays=()) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    head = json.dumps({**header, "arrays": [[a.dtype.str, a.shape] for a in arrays]}).encode()
    # one system call for the whole frame where the socket takes it: every partial write would
    # wake the receiver to read a piece and sleep again
    parts = [_LEN.pack(len(head)) + head, *(memoryview(a).cast("B") for a in arrays if a.nbytes)]
    sent = sock.sendmsg(parts)
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        sock.sendall(part[sent:])
        sent = 0


def _read_exact(sock: socket.socket, buf: memoryview) -> None:
    while len(buf):
        n = sock.recv_into(buf)
        if n == 0:
            raise ChannelClosed("connection closed by peer")
        buf = buf[n:]


def recv(sock: socket.socket) -> tuple[dict, list[np.ndarray]]:
    size = bytearray(_LEN.size)
    _read_exact(sock, memoryview(size))
    head = bytearray(_LEN.unpack(size)[0])
    _read_exact(sock, memoryview(head))
    header = json.loads(head)
    arrays = []
    for dtype, shape in header.pop("arrays"):
        a = np.empty(shape, dtype=np.dtype(dtype))
        if a.nbytes:
            _read_exact(sock, memoryview(a).cast("B"))
        arrays.append(a)
    return header, arrays


def connect(address: tuple[str, int], timeout_s: float, token: bytes = b"") -> socket.socket:
    """A connection whose reads and writes time out after timeout_s; with a `token`, it first sends it and
    waits for the peer to admit it (see admit): ChannelClosed if the peer refuses it."""
    sock = socket.create_connection(address, timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if token:
        got = bytearray(len(_ADMITTED))
        try:
            sock.sendall(token)
            _read_exact(sock, memoryview(got))
        except OSError:
            sock.close()
            raise
    return sock


def serve(listener: socket.socket, handle) -> None:
    """Accept connections one at a time, forever: handle(conn) on each until its peer goes away (a peer that
    reconnects gets the next accept)."""
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                handle(conn)
            except (ConnectionError, OSError):
                pass


def admit(sock: socket.socket, token: bytes, timeout_s: float = 10.0) -> bool:
    """Whether the peer's first bytes are `token` (read within timeout_s); if so, the peer is told so (one
    byte) and the socket blocks again."""
    got = bytearray(len(token))
    sock.settimeout(timeout_s)
    try:
        _read_exact(sock, memoryview(got))
    except (ConnectionError, OSError):
        return False
    if not hmac.compare_digest(bytes(got), token):
        return False
    sock.settimeout(None)
    sock.sendall(_ADMITTED)
    return True


def send_object(sock: socket.socket, obj) -> None:
    """One pickled object; only over a connection `admit` accepted."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN64.pack(len(data)) + data)


def recv_object(sock: socket.socket):
    size = bytearray(_LEN64.size)
    _read_exact(sock, memoryview(size))
    data = bytearray(_LEN64.unpack(size)[0])
    _read_exact(sock, memoryview(data))
    return pickle.loads(data)
