"""A worker's lease check across a bus outage (docs/reliability.md): a real cpu-decode worker
with the bundled model streams a request of a gateway; the nats-server is killed and restarted
on the same port, and the gateway stays away for several lease intervals after the worker is
back (its connection goes through a gate the test keeps shut). The worker must not take the
gateway for gone: the request stays held. Once the gateway has answered again and then dies
for real (its connection closed, no abort sent), the request is dropped and its KV freed."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest

from services.decode import DecodeWorker
from shared import subjects
from shared.bus import Bus
from shared.nats_server import EmbeddedNats
from shared.schemas import GenerateRequest, Lease, LeaseReply
from shared.settings import DataPlaneSettings, NatsSettings, PoolSettings, Settings, WorkerSettings

pytestmark = [pytest.mark.timeout(300)]

INTERVAL = 0.3     # the worker's heartbeat interval (its lease checks run every max(0.5, this) s)
AWAY_S = 4.0       # the gateway stays away this long after the worker is back: several lease checks


class Gate:
    """A TCP proxy to the NATS server; shut, it closes every connection it is offered."""

    def __init__(self, upstream: int):
        self.upstream, self.open = upstream, True

    async def start(self) -> "Gate":
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            if not self.open:
                return
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            return
        finally:
            if not self.open:
                w.close()

        async def pump(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            try:
                while data := await a.read(65536):
                    b.write(data)
                    await b.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                b.close()
        await asyncio.gather(pump(r, uw), pump(ur, w))

    def close(self) -> None:
        self.server.close()


async def until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


async def test_a_bus_outage_is_not_a_dead_gateway(bundled_model):
    server = EmbeddedNats()
    url = server.start()
    gate = await Gate(server.port).start()
    wid, gw_id, rid = f"lease-{uuid.uuid4().hex[:6]}", "gw-away", f"lease-{uuid.uuid4().hex[:8]}"
    worker = DecodeWorker(Settings(nats=NatsSettings(url=url), data=DataPlaneSettings(timeout=10.0),
                                   pool=PoolSettings(enabled=False),
                                   worker=WorkerSettings(worker_id=wid, threads=1, kv_blocks=96,
                                                         heartbeat_interval=INTERVAL, metrics_port=-1)),
                          subjects.CPU_DECODE)
    await worker.start()
    gateway = await Bus.connect(url=f"nats://127.0.0.1:{gate.port}", name=gw_id)
    asked: list[float] = []

    async def alive(lease: Lease) -> LeaseReply:   # the gateway waits for every request it is asked about
        asked.append(time.monotonic())
        return LeaseReply(gateway=gw_id, attempts=dict(lease.requests))
    await gateway.serve(subjects.gateway_alive(gw_id), alive, expected=Lease)
    client = await Bus.connect(url=url, name="lease-client")
    try:
        ids = worker.engine.tokenizer.encode("Tell me a very long story about the sea and its ships.")
        await client.request(subjects.worker_generate(wid), GenerateRequest(
            request_id=rid, prompt_token_ids=ids, sampling={"max_tokens": 4000, "temperature": 0, "ignore_eos": True},
            tier="standard", stream_subject=subjects.stream(rid), session_id=None, origin=gw_id))
        await until(lambda: gw_id in worker.heard, 30, "the worker checked the gateway's lease")

        gate.open = False                                    # the gateway will not get back in
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        await asyncio.sleep(0.5)
        server.restart()
        await until(lambda: worker.bus.connected_for() > 0, 30, "the worker reconnected")
        back = time.monotonic()
        while time.monotonic() - back < AWAY_S:              # lease checks get "no responders" meanwhile
            assert rid in worker.held and rid in worker.engine.engine.seqs, \
                f"the worker dropped {rid} {time.monotonic() - back:.1f} s after the bus came back"
            await asyncio.sleep(0.05)

        gate.open = True                                     # the gateway comes back and answers
        await until(lambda: asked and asked[-1] > back + AWAY_S, 30, "the gateway answered a lease again")
        assert rid in worker.held
        await gateway.close()                                # ... then dies: no abort, no answer
        await until(lambda: rid not in worker.held and not worker.engine.engine.seqs, 30,
                    "the dead gateway's request was dropped")
    finally:
        await client.close()
        if not gateway.nc.is_closed:
            await gateway.close()
        await worker.close()
        gate.close()
        server.stop()
