"""The router's session table when JetStream is not there at start: a real nats-server without
JetStream, then the same server restarted with it on the same port. The router's SessionStore
keeps its sessions in memory meanwhile, opens the bucket once JetStream answers, restores the
sessions the bucket held that it did not know, and writes its own — before this, a router that
started without JetStream kept its sessions in memory for its whole life (noted 2026-11-30)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import orjson

from services import sessions
from services.placement import SessionView
from services.sessions import SessionStore, _key
from shared.bus import Bus
from shared.nats_server import EmbeddedNats, find_nats_server, free_port
from shared.settings import NatsSettings


async def test_a_table_opened_without_jetstream_is_written_once_it_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(sessions, "REOPEN_S", 0.2)
    port = free_port("127.0.0.1")
    plain = subprocess.Popen([str(find_nats_server()), "-a", "127.0.0.1", "-p", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = EmbeddedNats(port=port, store_dir=tmp_path / "js")
    bus = None
    try:
        for _ in range(100):
            try:
                bus = await Bus.connect(NatsSettings(url=f"nats://127.0.0.1:{port}"), name="sessions-test")
                break
            except Exception:  # noqa: BLE001 - the server still starting
                await asyncio.sleep(0.1)
        bus.jetstream_wait = 1.0
        store = SessionStore(bus, flush_s=0.1)
        hold = asyncio.Event()                 # set: the store's next tries wait (the test's turn)
        real_open = store._open

        async def gated_open():
            while hold.is_set():
                await asyncio.sleep(0.05)
            return await real_open()
        store._open = gated_open
        restored: list[dict] = []
        assert await store.start(on_opened=restored.append) == {}          # memory only, for now
        now = time.monotonic()
        store.changed("mine", SessionView("interactive", "gpu-decode-1", now, "alice"))
        await asyncio.sleep(0.5)                                           # tried again: nothing there
        assert store.kv is None and not restored
        hold.set()
        plain.terminate()
        plain.wait(10)
        server.start()                                                     # the same port, JetStream on
        # a session another router copy wrote before this one could
        other = await Bus.connect(NatsSettings(url=server.url), name="other")
        try:
            theirs = SessionStore(other)
            assert await theirs.start() == {}
            theirs.changed("theirs", SessionView("batch", "cpu-decode-2", time.monotonic(), "bob"))
            await theirs.close()
            kv = theirs.kv
            hold.clear()
            deadline = time.monotonic() + 30
            got = None
            while time.monotonic() < deadline:
                try:
                    got = orjson.loads((await kv.get(_key("mine"))).value)
                    break
                except Exception:  # noqa: BLE001 - not written yet
                    await asyncio.sleep(0.2)
        finally:
            await other.close()
        assert got is not None and got["tier"] == "interactive" and got["worker"] == "gpu-decode-1"
        assert got["owner"] == "alice"
        assert len(restored) == 1 and restored[0]["theirs"].tier == "batch" and "mine" not in restored[0]
        await store.close()
    finally:
        if bus is not None:
            await bus.close()
        plain.kill()
        server.stop()
