"""The ring connections' messages (shared/engine/ring_net.py): tagged, so a changed, replayed or
reflected message is refused."""

from __future__ import annotations

import socket

import pytest

from shared.engine.ring_net import _Channel, _session_key


def pair(key: bytes = b"k"):
    a, b = socket.socketpair()
    sk = _session_key(key, b"s" * 32, b"c" * 32)
    return _Channel(a, sk, client=True, max_payload=1 << 20), _Channel(b, sk, client=False, max_payload=1 << 20), a, b


def raw(ch: _Channel, op: int, meta: dict, payload: bytes) -> bytes:
    """What ``ch.send`` puts on the wire (captured on a socket pair of its own)."""
    x, y = socket.socketpair()
    sock, ch.sock = ch.sock, x
    ch.send(op, meta, payload)
    ch.sock = sock
    x.close()
    return y.recv(1 << 20)


@pytest.mark.parametrize("size", [0, 100, 1 << 17])   # small messages go in one write, large in three
def test_a_message_arrives_whole_and_verified(size):
    c, s, a, b = pair()
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    c.send(3, {"sid": "r#0", "layer": 2}, body)
    op, meta, payload = s.recv()
    assert (op, meta, bytes(payload)) == (3, {"sid": "r#0", "layer": 2}, body)
    s.send(0, {"shape": None})
    assert c.recv()[:2] == (0, {"shape": None})


def test_a_changed_message_is_refused():
    c, s, a, _ = pair()
    wire = bytearray(raw(c, 3, {"sid": "r"}, b"\x00" * 64))
    wire[-40] ^= 1   # a payload byte
    a.sendall(wire)
    with pytest.raises(ConnectionError, match="tag"):
        s.recv()


def test_a_replayed_or_reflected_message_is_refused():
    c, s, a, b = pair()
    wire = raw(c, 5, {"sid": "r"}, b"")
    c.sent -= 1                       # the capture counted it; send it for real once
    a.sendall(wire)
    assert s.recv()[0] == 5
    a.sendall(wire)                   # the same bytes again: the counter moved on
    with pytest.raises(ConnectionError):
        s.recv()
    c2, s2, a2, b2 = pair()
    b2.sendall(raw(c2, 5, {"sid": "r"}, b""))   # a client's message sent back to the client
    with pytest.raises(ConnectionError):
        c2.recv()


def test_without_a_key_nothing_is_tagged():
    c, s, _, _ = pair(key=b"")
    c.send(1, {"sid": "r", "start": 0, "end": 256})
    assert s.recv()[1]["end"] == 256
