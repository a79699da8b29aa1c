"""The per-layer data channel between the model worker and a CPU attention worker: NumPy arrays
and a small JSON header over one TCP connection, no pickle.

    frame = u32 header length | header JSON | array bytes, back to back
    header = {..., "arrays": [[dtype, shape], ...]}

One frame per layer and direction; a loopback round trip costs tens of microseconds, where a
Ray task or a Ray Compiled Graph hop costs about a millisecond on a 2-core machine
(benchmarks/bench_executor.py, its `exchange` part).
"""
from __future__ import annotations

import json
import socket
import struct

import numpy as np

_LEN = struct.Struct("<I")


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


def connect(address: tuple[str, int], timeout_s: float) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
