"""The router's session table reading JetStream at start, against a stand-in bucket: an entry
JetStream cannot serve for a moment (a cluster electing leaders after losing a server) is read
again; one it never serves is skipped. The router must start either way (it exited with
ServiceUnavailableError's traceback, a probe of 2026-11-30)."""

from __future__ import annotations

import asyncio
import time

import nats.js.errors
import orjson

from services import sessions
from services.sessions import SessionStore


class Entry:
    def __init__(self, value: bytes):
        self.value = value


class Bucket:
    def __init__(self, entries: dict[str, bytes], failures: dict[str, int]):
        self.entries, self.failures, self.asked = entries, failures, []

    async def get(self, key: str) -> Entry:
        self.asked.append(key)
        if self.failures.get(key, 0) != 0:
            self.failures[key] -= 1
            raise nats.js.errors.ServiceUnavailableError()
        if key not in self.entries:
            raise nats.js.errors.KeyNotFoundError()
        return Entry(self.entries[key])


class Bus:
    def __init__(self, bucket: Bucket):
        self.bucket = bucket
        self.nc = self

    def jetstream(self):
        return None

    async def jetstream_ensure(self, what, open_, create):
        return self.bucket

    async def kv_keys(self, bucket: str) -> list[str]:
        return list(self.bucket.entries) + ["gone"]


def test_an_entry_jetstream_cannot_serve_yet_is_read_again_and_one_it_never_serves_is_skipped(monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    value = orjson.dumps({"tier": "interactive", "worker": "g1", "last": time.time(), "owner": "o"})
    a, b = sessions._key("agent-a"), sessions._key("agent-b")
    bucket = Bucket({a: value, b: value}, {a: 2, b: -1})     # a: twice unavailable; b: always
    store = SessionStore(Bus(bucket))
    try:
        got = asyncio.run(_start(store))
    finally:
        store._task = None
    assert set(got) == {"agent-a"} and got["agent-a"].tier == "interactive"
    assert bucket.asked.count(a) == 3 and bucket.asked.count(b) == sessions.READ_TRIES
    assert bucket.asked.count("gone") == 1                    # no such key: not asked again


async def _start(store: SessionStore):
    out = await store.start()
    store._task.cancel()
    return out


_real_sleep = asyncio.sleep


async def _no_sleep(s):
    await _real_sleep(0)
