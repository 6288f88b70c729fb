"""Bus authentication and per-role permissions (shared/bus_auth.py) on a real nats-server started
as `tandem up` starts it: role users from a credentials file, nothing else accepted."""

from __future__ import annotations

import asyncio
import os
import stat
import time

import nats
import nats.errors
import pytest

from shared import bus_auth, subjects
from shared.bus import Bus, BusError
from shared.nats_server import EmbeddedNats
from shared.schemas import Abort, Ack, RoutePlan, StreamChunk, Where
from shared.settings import NatsSettings, Settings

QUIET = 0.5  # seconds a message that must not come is waited for (the allowed one came first)


@pytest.fixture(scope="module", params=[None, "TANDEM"], ids=["global-account", "own-account"])
def secured(request, tmp_path_factory):
    """(url, credentials file) of a nats-server that accepts only the role users: as `tandem up`
    runs it (the global account), and with the users in an account of their own (with JetStream),
    as docs/security.md shows for a shared external server."""
    path = str(tmp_path_factory.mktemp("auth") / "nats.creds")
    server = EmbeddedNats(config=bus_auth.server_config(bus_auth.ensure_creds(path), request.param))
    try:
        yield server.start(), path
    finally:
        server.stop()


async def connect(secured, role: str, name: str | None = None) -> tuple[Bus, list[str]]:
    """A Bus logged in as ``role``, and the NATS errors it is sent (permission violations)."""
    url, path = secured
    bus = await Bus.connect(NatsSettings(url=url, creds_file=path), name=name or role, role=role)
    errors: list[str] = []
    on_error = bus.nc._error_cb

    async def record(e):
        errors.append(str(e))
        await on_error(e)
    bus.nc._error_cb = record
    return bus, errors


async def violation(errors: list[str], subject: str) -> None:
    """Wait until the server reported a permissions violation naming ``subject`` (nats-py lower-cases
    the message)."""
    for _ in range(100):
        if any("permissions violation" in e.lower() and subject.lower() in e.lower() for e in errors):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no permissions violation for {subject}: {errors}")


def test_credentials_file_is_private_and_complete(secured):
    _, path = secured
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    creds = bus_auth.read_creds(path)
    assert set(creds["users"]) == set(bus_auth.ROLES)
    assert len({u["password"] for u in creds["users"].values()}) == len(bus_auth.ROLES)
    assert bus_auth.ensure_creds(path) == creds  # read again, never regenerated


async def test_an_unauthenticated_client_cannot_connect(secured):
    url, _ = secured
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(url, allow_reconnect=False)
    with pytest.raises(BusError) as e:
        await Bus.connect(NatsSettings(url=url, creds_file=None), role=subjects.GATEWAY)
    assert e.value.code == "unavailable" and "TANDEM_NATS_CREDS_FILE is empty" in e.value.message
    # the error says why there was no login (it said "no servers available" after 4 violations)
    with pytest.raises(BusError) as e:
        await Bus.connect(NatsSettings(url=url, creds_file="/nonexistent/nats.creds"), role="tap")
    assert "refused this login: no credentials: TANDEM_NATS_CREDS_FILE (/nonexistent/nats.creds) does " \
           "not exist" in e.value.message
    with pytest.raises(BusError) as e:  # a wrong password
        await Bus.connect(NatsSettings(url=url, user="tandem-worker", password="guess", creds_file=None))
    assert "refused this login: wrong credentials" in e.value.message


async def test_the_request_life_cycle_works_with_role_credentials(secured):
    gateway, gw_err = await connect(secured, subjects.GATEWAY)
    router, r_err = await connect(secured, subjects.ROUTER)
    worker, w_err = await connect(secured, subjects.CPU_DECODE)
    try:
        plan = RoutePlan("r1", None, "w1", subjects.CPU_DECODE, "test")

        async def route(req):
            return plan
        await router.serve(subjects.ROUTE, route, queue=subjects.ROUTE_QUEUE)
        assert await gateway.request(subjects.ROUTE, Abort("r1"), timeout=10, expected=RoutePlan) == plan
        aborts = await worker.subscribe(subjects.ABORT, Abort)
        chunks = await gateway.subscribe(subjects.stream("r1"), StreamChunk)
        await worker.publish(subjects.stream("r1"), StreamChunk("r1", 0, [7], "hi", "w1"))
        assert (await chunks.next(timeout=10)).text == "hi"
        await gateway.publish(subjects.ABORT, Abort("r1"))
        assert (await aborts.next(timeout=10)).request_id == "r1"

        async def alive(req):
            return Ack()
        await gateway.serve(subjects.gateway_alive("g1"), alive)  # workers ask the gateway back
        assert isinstance(await worker.request(subjects.gateway_alive("g1"), Ack(), timeout=10), Ack)
        assert gw_err == r_err == w_err == []
    finally:
        for b in (gateway, router, worker):
            await b.close()


async def test_a_role_cannot_publish_outside_its_permissions(secured):
    gateway, gw_err = await connect(secured, subjects.GATEWAY)
    worker, w_err = await connect(secured, subjects.PREFILL)
    tap, tap_err = await connect(secured, bus_auth.TAP)
    try:
        chunks = await gateway.subscribe(subjects.stream("r2"), StreamChunk)
        aborts = await worker.subscribe(subjects.ABORT, Abort)
        decisions = await tap.subscribe(subjects.ROUTER_DECISION)
        # the gateway cannot inject tokens into a stream, tap cannot publish at all
        await gateway.publish(subjects.stream("r2"), StreamChunk("r2", 0, [1], "forged", "gw"))
        await tap.publish(subjects.stream("r2"), StreamChunk("r2", 0, [1], "forged", "tap"))
        await tap.publish(subjects.ABORT, Abort("r2"))
        # a worker cannot abort other requests or publish plans
        await worker.publish(subjects.ABORT, Abort("r2"))
        await worker.publish(subjects.ROUTER_DECISION, RoutePlan("r2", None, "evil", subjects.CPU_DECODE, "forged"))
        await violation(gw_err, subjects.stream("r2"))
        await violation(tap_err, subjects.ABORT)
        await violation(w_err, subjects.ROUTER_DECISION)
        for sub in (chunks, aborts, decisions):
            with pytest.raises(BusError):
                await sub.next(timeout=QUIET)
        # the allowed publish still arrives: the silence above is the permission, not a dead path
        await worker.publish(subjects.stream("r2"), StreamChunk("r2", 0, [2], "real", "w"))
        assert (await chunks.next(timeout=10)).text == "real"
    finally:
        for b in (gateway, worker, tap):
            await b.close()


async def test_a_role_cannot_subscribe_outside_its_permissions(secured):
    kvpool, p_err = await connect(secured, subjects.KVPOOL)
    worker, w_err = await connect(secured, subjects.CPU_DECODE)
    gateway, _ = await connect(secured, subjects.GATEWAY)
    try:
        await kvpool.subscribe(subjects.stream("r3"))           # prompts and tokens: not the pool's
        await violation(p_err, subjects.stream("r3"))
        await worker.subscribe("_INBOX.gateway.>")              # another role's replies (route plans)
        await violation(w_err, "_INBOX.gateway.>")
        await worker.subscribe(subjects.ROUTE)                  # taking route requests as a router
        await violation(w_err, subjects.ROUTE)
    finally:
        for b in (kvpool, worker, gateway):
            await b.close()


async def test_tap_reads_everything(secured):
    tap, tap_err = await connect(secured, bus_auth.TAP)
    worker, _ = await connect(secured, subjects.GPU_DECODE)
    try:
        seen = await tap.subscribe(subjects.ALL)
        await worker.publish(subjects.stream("r4"), StreamChunk("r4", 0, [3], "x", "w"))
        assert (await seen.next(timeout=10)).request_id == "r4"
        assert tap_err == []
    finally:
        await tap.close()
        await worker.close()


async def test_no_role_can_have_the_server_publish_for_it(secured):
    """What the security probe did (2026-11-29): a push consumer on a bucket the role writes, its
    deliver subject a client's stream, made the server publish a forged token there (nats-server
    does not check the creator may publish to it: nats-server#8274); the tap joined the router's
    queue group and took route requests nobody answered. Neither is allowed now; the tap still
    reads everything."""
    import nats.js.api as api
    router, r_err = await connect(secured, subjects.ROUTER)
    gateway, gw_err = await connect(secured, subjects.GATEWAY)
    tap, tap_err = await connect(secured, bus_auth.TAP)
    try:
        await router.nc.jetstream().create_key_value(bucket=bus_auth.SESSIONS_BUCKET, history=1)
        await gateway.nc.jetstream().create_key_value(bucket=bus_auth.RESPONSES_BUCKET, history=1)
        for bus, errors, bucket in ((router, r_err, bus_auth.SESSIONS_BUCKET),
                                    (gateway, gw_err, bus_auth.RESPONSES_BUCKET)):
            with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
                await bus.nc.jetstream(timeout=QUIET).add_consumer(
                    f"KV_{bucket}", api.ConsumerConfig(deliver_subject=subjects.stream("victim")))
            await violation(errors, f"$JS.API.CONSUMER.CREATE.KV_{bucket}")
        await tap.nc.subscribe(subjects.ROUTE, queue="router")
        await violation(tap_err, subjects.ROUTE)
        seen = await tap.subscribe(subjects.ALL)            # a plain subscription: still everything
        await router.publish(subjects.ROUTER_DECISION, Ack(request_id="d1"))
        assert (await seen.next(timeout=10)).request_id == "d1"
    finally:
        for b in (router, gateway, tap):
            await b.close()


async def test_a_request_whose_reply_is_no_inbox_is_not_answered(secured):
    """A router credential sent a worker a request whose reply subject was a client's stream: the
    worker's ErrorReply landed there and ended the stream. A served subject answers inboxes only."""
    worker, _ = await connect(secured, subjects.CPU_DECODE)
    router, _ = await connect(secured, subjects.ROUTER)
    tap, _ = await connect(secured, bus_auth.TAP)
    handled = []

    async def handler(msg):
        handled.append(msg.request_id)
        raise BusError("not_found", "no such request")
    try:
        await worker.serve(subjects.worker_migrate("w1"), handler, expected=Abort)
        victim = await tap.subscribe(subjects.stream("victim"))
        await router.nc.publish(subjects.worker_migrate("w1"), b'{"schema": "abort", "v": 1, "request_id": "x"}',
                                reply=subjects.stream("victim"))
        with pytest.raises(BusError, match="not_found"):   # a real request (an inbox reply): answered
            await router.request(subjects.worker_migrate("w1"), Abort(request_id="y"), timeout=10)
        assert handled == ["y"]
        with pytest.raises(BusError, match="timeout"):
            await victim.next(timeout=QUIET)
    finally:
        for b in (worker, router, tap):
            await b.close()


async def test_jetstream_buckets_per_role(secured):
    """The router keeps its buckets; the gateway can read none of them (only its own)."""
    router, r_err = await connect(secured, subjects.ROUTER)
    gateway, gw_err = await connect(secured, subjects.GATEWAY)
    try:
        kv = await router.nc.jetstream().create_key_value(bucket=bus_auth.SESSIONS_BUCKET, history=1)
        await kv.put("s1", b"interactive")
        assert (await kv.get("s1")).value == b"interactive"
        assert await router.kv_keys(bus_auth.SESSIONS_BUCKET) == ["s1"]
        mine = await gateway.nc.jetstream().create_key_value(bucket=bus_auth.RESPONSES_BUCKET, history=1)
        await mine.put("t.resp_1", b"{}")
        await mine.purge("t.resp_1")
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
            await gateway.nc.jetstream(timeout=QUIET).key_value(bus_auth.SESSIONS_BUCKET)
        assert r_err == []
        await violation(gw_err, f"KV_{bus_auth.SESSIONS_BUCKET}")
    finally:
        await router.close()
        await gateway.close()


async def test_a_new_gateway_and_router_find_what_the_buckets_hold(secured):
    """What a restarted (or another) gateway and router read back, as their roles, on first use:
    each tenant's stored responses — the per-tenant caps count them — and the session table.
    nats-py's KeyValue.keys() missed these: its ``filters`` match substrings, so ``alice.*``
    matched no key, and its watcher could end before a key in flight arrived (nats.py #842)."""
    import time
    from services.gateway.response_store import ResponseStore
    from services.sessions import SessionStore, SessionView
    gateway, gw_err = await connect(secured, subjects.GATEWAY)
    router, r_err = await connect(secured, subjects.ROUTER)
    try:
        first = ResponseStore(gateway)
        for tenant, rid in (("alice", "resp_1"), ("alice", "resp_2"), ("bob", "resp_3"), ("alice2", "resp_4")):
            await first.put(tenant, rid, {"id": rid, "output": "x" * 10})
        await first.delete("alice", "resp_2")
        # two deletes of one response at once: one finds it (each answered 200 before)
        await first.put("alice", "resp_5", {"id": "resp_5"})
        assert sorted(await asyncio.gather(first.delete("alice", "resp_5"), first.delete("alice", "resp_5"))) == \
            [False, True]
        again = ResponseStore(gateway)                      # a restart: nothing in memory
        assert list(await again._ledger("alice")) == ["resp_1"]
        assert list(await again._ledger("bob")) == ["resp_3"]
        table = SessionStore(router, flush_s=0.05)
        await table.start()
        for i in range(3):
            table.changed(f"s-{i}", SessionView("gpu", f"gpu-decode-{i}", time.monotonic(), "router-1"))
        await table.close()
        again_table = SessionStore(router, flush_s=0.05)
        restored = await again_table.start()
        await again_table.close()
        assert sorted(restored) == ["s-0", "s-1", "s-2"] and restored["s-1"].worker == "gpu-decode-1"
        assert gw_err == [] and r_err == []
    finally:
        await gateway.close()
        await router.close()


async def test_role_credentials_are_harmless_on_a_server_without_auth(nats_server, secured):
    """The shared test server has no authentication: services that log in as their role still
    connect (the server ignores credentials it does not ask for)."""
    _, path = secured
    bus = await Bus.connect(NatsSettings(url=nats_server, creds_file=path), role=subjects.ROUTER)
    try:
        sub = await bus.subscribe("tandem.test.noauth", Abort)
        await bus.publish("tandem.test.noauth", Abort("n"))
        assert (await sub.next(timeout=10)).request_id == "n"
    finally:
        await bus.close()


def test_every_role_has_permissions_and_services_map_to_roles():
    for role in bus_auth.ROLES:
        assert bus_auth.permissions(role)["subscribe"]
    assert {bus_auth.role_of(s) for s in subjects.ROLES} | {bus_auth.role_of("tap")} == set(bus_auth.ROLES)
    with pytest.raises(ValueError, match="no bus role"):
        bus_auth.role_of("bench")


async def test_tandem_tap_logs_in_read_only(secured):
    """`tandem tap` with the deployment's settings: it sees the traffic, as the tap role."""
    import io
    from services.tap import tap
    url, path = secured
    out, ready = io.StringIO(), asyncio.Event()
    worker, _ = await connect(secured, subjects.CPU_DECODE)
    try:
        task = asyncio.create_task(tap(subjects.ALL, count=1, out=out, ready=ready,
                                       settings=Settings(nats=NatsSettings(url=url, creds_file=path))))
        await asyncio.wait_for(ready.wait(), 10)
        await worker.publish(subjects.stream("r5"), StreamChunk("r5", 0, [4], "t", "w"))
        assert await asyncio.wait_for(task, 30) == 0
        assert "tandem.stream.r5" in out.getvalue()
    finally:
        await worker.close()
    with pytest.raises(BusError):  # without the file tap cannot connect
        await tap(subjects.ALL, count=1, settings=Settings(nats=NatsSettings(url=url, creds_file=None)))


async def test_a_role_login_wins_over_credentials_in_the_url(secured):
    """The e2e tests' URL carries a test user's login (tests/e2e/conftest.py) and the stacks'
    services must still log in as their roles, or the e2e tests would check no permission."""
    url, path = secured
    tap_login = bus_auth.role_login(path, bus_auth.TAP)
    with_userinfo = url.replace("nats://", f"nats://{tap_login[0]}:{tap_login[1]}@")
    gateway = await Bus.connect(NatsSettings(url=with_userinfo, creds_file=path), role=subjects.GATEWAY)
    as_tap = await Bus.connect(NatsSettings(url=with_userinfo, creds_file=None))
    try:
        aborts = await as_tap.subscribe(subjects.ABORT, Abort)
        await gateway.publish(subjects.ABORT, Abort("r6"))    # the gateway may, tap may not
        assert (await aborts.next(timeout=10)).request_id == "r6"
    finally:
        await gateway.close()
        await as_tap.close()


async def test_a_frozen_client_leaves_its_queue_group(tmp_path):
    """A client that stops answering (SIGSTOP: a frozen router copy) is dropped by the server, its
    queue subscription with it, so the group's requests go to the members left (a frozen router
    copy kept its share of the session updates, each waiting 10 s, for nats-server's ~4 minutes).
    The live member pings (TANDEM_NATS_PING_S) and is never dropped."""
    import os
    import signal
    import subprocess
    import sys

    path = str(tmp_path / "nats.creds")
    server = EmbeddedNats(config=bus_auth.server_config(bus_auth.ensure_creds(path), client_ping_s=0.3))
    url = server.start()
    member = f"""
import asyncio, sys
from shared import subjects
from shared.bus import Bus
from shared.schemas import Ack, Where
from shared.settings import NatsSettings
async def main():
    bus = await Bus.connect(NatsSettings(url={url!r}, creds_file={path!r}, ping_s=60), name="frozen", role="router")
    async def where(req): return Ack(worker="frozen")
    await bus.serve(subjects.ROUTER_SESSION, where, queue="routers", expected=Where)
    await bus.nc.flush()
    print("ready", flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""
    proc = subprocess.Popen([sys.executable, "-c", member], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    live = asker = None
    try:
        assert proc.stdout.readline().strip() == "ready"
        live = await Bus.connect(NatsSettings(url=url, creds_file=path, ping_s=0.2), name="live", role="router")

        async def where(req: Where) -> Ack:
            return Ack(worker="live")
        await live.serve(subjects.ROUTER_SESSION, where, queue="routers", expected=Where)
        asker = await Bus.connect(NatsSettings(url=url, creds_file=path, ping_s=0.2), name="gw", role="gateway")
        os.kill(proc.pid, signal.SIGSTOP)
        t0, answered = time.monotonic(), 0
        while answered < 10:   # ten in a row from the live member: the frozen one is out of the group
            assert time.monotonic() - t0 < 15, "requests still go to the frozen member"
            try:
                got = await asker.request(subjects.ROUTER_SESSION, Where(request_id="r"), timeout=0.3,
                                          expected=Ack)
                answered = answered + 1 if got.worker == "live" else 0
            except BusError:
                answered = 0
        assert live.nc.is_connected
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        for b in (live, asker):
            if b is not None:
                await b.close()
        server.stop()
