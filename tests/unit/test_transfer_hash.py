"""Hashing a payload in a second thread behind the socket calls (shared/transfer/tcp.py
``HashBehind``): the digest of every byte in order, whatever the pieces the bytes arrive in;
a failed transfer stops the thread."""

from __future__ import annotations

import os
import random
import threading

import pytest

from shared.transfer.base import Hasher
from shared.transfer.frames import HASH_UNIT, HashBehind

MiB = 1 << 20


def digest(data) -> bytes:
    h = Hasher("xxh3")
    h.update(data)
    return h.digest()


@pytest.mark.parametrize("n", [1, HASH_UNIT - 1, 3 * HASH_UNIT + 12345])
def test_digest_of_every_byte_whatever_the_pieces(n):
    data = os.urandom(n)
    rng = random.Random(n)
    h = Hasher("xxh3")
    behind = HashBehind(h, memoryview(data), 4 * MiB)
    ready = 0
    while ready < n:                        # bytes landing in uneven pieces, as recv_into returns them
        ready = min(n, ready + rng.randint(1, 300_000))
        behind.advance(ready)
    behind.finish()
    assert h.digest() == digest(data)


def test_finish_hashes_what_was_never_advanced():
    data = os.urandom(2 * HASH_UNIT + 7)
    h = Hasher("xxh3")
    HashBehind(h, memoryview(data), HASH_UNIT).finish()
    assert h.digest() == digest(data)


def test_stop_ends_the_thread_of_a_failed_transfer():
    h = Hasher("xxh3")
    behind = HashBehind(h, memoryview(bytes(8 * MiB)), MiB)
    behind.advance(MiB + 1)                 # a few bytes landed, then the connection broke
    behind.stop()
    assert not behind._thread.is_alive()
    assert not any(t.name == "kv-hash" and t is behind._thread for t in threading.enumerate())
