"""server/channel.py: frames round-trip exactly, also when the socket takes them in pieces."""
import socket
import threading

import numpy as np
import pytest

from server import channel


def test_frames_round_trip_through_a_small_socket_buffer():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # a frame of MBs goes out in many pieces
    a.settimeout(30)  # as channel.connect sets it: a send may then take only part of a frame
    rng = np.random.default_rng(0)
    frames = [({"op": "attend", "layer": i}, [rng.standard_normal((512, 9, 64)).astype(np.float32),
                                             np.zeros((0, 3), np.float32), rng.integers(0, 99, (512, 3, 8), np.int32)])
              for i in range(3)] + [({"op": "free", "seq_ids": [1, 2]}, [])]
    sender = threading.Thread(target=lambda: [channel.send(a, h, arrs) for h, arrs in frames])
    sender.start()
    for header, arrays in frames:
        got_header, got = channel.recv(b)
        assert got_header == header
        assert len(got) == len(arrays)
        for x, y in zip(got, arrays):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)
    sender.join()
    a.close()
    with pytest.raises(channel.ChannelClosed):
        channel.recv(b)
    b.close()


def test_non_contiguous_arrays_are_sent_as_their_values():
    a, b = socket.socketpair()
    x = np.arange(60, dtype=np.float32).reshape(3, 4, 5)[:, 1:3, ::2]
    channel.send(a, {}, [x])
    np.testing.assert_array_equal(channel.recv(b)[1][0], x)
    a.close()
    b.close()
