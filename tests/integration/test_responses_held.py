"""Stored Responses through a bus outage, on a real nats-server with JetStream killed and started
again on its store: a record the bus does not take is held by the gateway — its next turn and a
GET find it there at once — and written once the bus answers, where another gateway reads it; a
held record deleted stays deleted (purged once the bus answers: the put nats-py buffered while it
reconnected reached the bucket after it had timed out here). (Before: answered ``"store": false``, and an agent's next
turn through ``previous_response_id`` was a 404.)"""

from __future__ import annotations

import pytest

from services.gateway import response_store
from services.gateway.response_store import ResponseStore, StoreUnavailable
from shared.bus import Bus
from shared.nats_server import EmbeddedNats
from shared.settings import NatsSettings
from tests.waiting import wait_for


async def test_a_record_the_bus_does_not_take_is_held_then_written(tmp_path, monkeypatch):
    monkeypatch.setattr(response_store, "BUS_TRIES", 1)
    monkeypatch.setattr(response_store, "HELD_RETRY_S", 0.3)
    monkeypatch.setattr(response_store, "BUS_TIMEOUT_S", 1.0)   # each call to a dead bus waits this long
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    bus = await Bus.connect(NatsSettings(url=server.url), name="gateway-a")
    other = None
    try:
        store = ResponseStore(bus)
        await store.put("t1", "resp_a", {"id": "resp_a", "output": "before"})
        server.proc.kill()                                   # the bus gone (kill -9)
        server.proc.wait(10)
        await store.put("t1", "resp_b", {"id": "resp_b", "output": "during"})      # held, not refused
        await store.put("t1", "resp_c", {"id": "resp_c", "output": "deleted"})
        assert (await store.get("t1", "resp_b"))["output"] == "during"             # found here at once
        assert await store.delete("t1", "resp_c") is True
        with pytest.raises(StoreUnavailable):                                       # not held: the bus
            await store.get("t1", "resp_a")
        server.restart()                                     # the same port and store
        other = await Bus.connect(NatsSettings(url=server.url), name="gateway-b")
        elsewhere = ResponseStore(other)
        got = await wait_for("the held record written", lambda: elsewhere.get("t1", "resp_b"), 40)
        assert got["output"] == "during"

        async def all_written():
            return not store._held           # (the deleted one's purge comes after resp_b's write)
        await wait_for("the held records written and purged", all_written, 20)
        assert (await elsewhere.get("t1", "resp_a"))["output"] == "before"
        assert await elsewhere.get("t1", "resp_c") is None                         # deleted while held
        await store.close()
    finally:
        for b in (bus, other):
            if b is not None:
                await b.close()
        server.stop()
