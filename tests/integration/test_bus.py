"""Bus on a real nats-server: serve/request, queue groups, error envelope, streams, heartbeats,
credentials."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from shared import subjects
from shared.bus import Bus, BusError, RemoteError
from shared.nats_server import EmbeddedNats
from shared.schemas import (
    Abort, Ack, ErrorReply, Heartbeat, RoutePlan, RouteRequest, StreamChunk,
)
from shared.settings import NatsSettings, Settings

pytestmark = pytest.mark.timeout(60)


def route_req(rid: str = "r1") -> RouteRequest:
    return RouteRequest(rid, "smollm2", "standard", None, 10, 5)


@pytest.fixture
def private_nats():
    """A server of this test's own for the cross-connection tests. (They lost a message twice in
    full CI runs on the shared server: nats-py's flush() could return before the server had the
    SUB — see ``test_flush_covers_the_commands_sent_before_it``.)"""
    with EmbeddedNats() as url:
        yield url


def test_a_server_that_exits_at_start_up_is_said_with_its_own_words(tmp_path):
    """nats-server refusing to start (its monitoring port taken here) raises an error that quotes
    what the server printed, not only its exit code."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = EmbeddedNats(store_dir=tmp_path / "s", extra_args=["-m", str(port)], startup_timeout=10)
        with pytest.raises(RuntimeError) as e:
            server.start()
    said = str(e.value)
    assert "exited with code" in said and "address already in use" in said, said
    assert server.proc is None


@pytest.fixture
async def bus(nats_server):
    b = await Bus.connect(NatsSettings(url=nats_server), name="test")
    yield b
    await b.close()


async def test_serve_and_request(bus):
    async def route(req: RouteRequest) -> RoutePlan:
        return RoutePlan(req.request_id, None, "cpu-0", subjects.CPU_DECODE, f"tier {req.tier}")

    await bus.serve(subjects.ROUTE, route, queue=subjects.ROUTE_QUEUE, expected=RouteRequest)
    plan = await bus.request(subjects.ROUTE, route_req("r7"), timeout=2, expected=RoutePlan)
    assert plan == RoutePlan("r7", None, "cpu-0", "cpu-decode", "tier standard")


async def test_flush_covers_the_commands_sent_before_it(bus):
    """serve(), subscribe() and flush() return on a PONG that answers a PING sent after the SUB
    or PUB on the wire, so the server has processed them (nats-py's own flush() writes its PING
    ahead of commands still queued for its flusher: a SUB 'flushed' that way raced requests from
    other connections, which got "no responders" under load)."""
    wire = []
    transport = bus.nc._transport
    write, writelines = transport.write, transport.writelines
    transport.write = lambda b: (wire.append(bytes(b)[:4]), write(b))[1]
    transport.writelines = lambda bs: (wire.extend(bytes(b)[:4] for b in bs), writelines(bs))[1]
    try:
        for i, start in enumerate((lambda: bus.serve("tandem.test.order", _ack, queue="q"),
                                   lambda: bus.subscribe("tandem.test.order2"),
                                   lambda: bus.subscribe_raw("tandem.test.order3"))):
            del wire[:]
            await start()
            assert b"SUB " in wire and wire[-1] == b"PING", (i, wire)
            assert wire.index(b"SUB ") < len(wire) - 1, (i, wire)
        del wire[:]
        await bus.publish("tandem.test.order", Abort("x"))
        await bus.flush()
        pub = next(i for i, w in enumerate(wire) if w in (b"PUB ", b"HPUB"))
        assert pub < len(wire) - 1 and wire[-1] == b"PING", wire
    finally:
        transport.write, transport.writelines = write, writelines


async def test_handler_returning_none_acks(bus):
    async def handler(req):
        return None

    await bus.serve(subjects.worker_prefill("p0"), handler)
    ack = await bus.request(subjects.worker_prefill("p0"), Abort("r2"), timeout=2)
    assert ack == Ack(request_id="r2")


async def test_queue_group_shares_work(nats_server):
    a = await Bus.connect(NatsSettings(url=nats_server), name="a")
    b = await Bus.connect(NatsSettings(url=nats_server), name="b")
    client = await Bus.connect(NatsSettings(url=nats_server), name="client")
    seen = {"a": 0, "b": 0}

    def make(name):
        async def route(req):
            seen[name] += 1
            await asyncio.sleep(0.005)
            return RoutePlan(req.request_id, None, name, subjects.CPU_DECODE, "")
        return route

    subject = "tandem.test.queue"
    try:
        await a.serve(subject, make("a"), queue="router")
        await b.serve(subject, make("b"), queue="router")
        await a.flush()
        await b.flush()
        plans = await asyncio.gather(*(client.request(subject, route_req(f"r{i}"), timeout=5)
                                       for i in range(40)))
        assert sorted(p.request_id for p in plans) == sorted(f"r{i}" for i in range(40))
        assert seen["a"] + seen["b"] == 40  # each request handled exactly once
        assert seen["a"] > 0 and seen["b"] > 0, seen
    finally:
        for x in (a, b, client):
            await x.close()


@pytest.mark.parametrize("exc,code,status", [
    (BusError("overloaded", "queue full"), "overloaded", 429),
    (BusError("prompt_too_long", "prompt of 9000 tokens > 8192"), "prompt_too_long", 400),
    (ValueError("invalid sampling parameter top_p=2"), "bad_request", 400),
    (RuntimeError("boom"), "internal", 500),
])
async def test_handler_exception_becomes_remote_error(bus, caplog, exc, code, status):
    async def handler(req):
        raise exc

    subject = f"tandem.test.err.{code}"
    await bus.serve(subject, handler)
    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        with pytest.raises(RemoteError) as e:
            await bus.request(subject, route_req("r3"), timeout=2)
    assert e.value.code == code
    assert e.value.status == status
    assert e.value.request_id == "r3"
    assert (exc.message if isinstance(exc, BusError) else str(exc)) in e.value.message
    assert any(code in r.getMessage() or r.exc_info for r in caplog.records)  # logged, not silent


async def test_bad_request_payload_gets_bad_request(bus):
    async def handler(req):
        return Ack()

    subject = "tandem.test.expected"
    await bus.serve(subject, handler, expected=RouteRequest)
    with pytest.raises(RemoteError) as e:
        await bus.request(subject, Abort("r4"), timeout=2)
    assert e.value.code == "bad_request"
    assert "expected schema 'RouteRequest'" in e.value.message
    # and raw garbage
    reply = await bus.nc.request(subject, b"not json", timeout=2)
    from shared.schemas import decode
    err = decode(reply.data, ErrorReply)
    assert err.code == "bad_request"


async def test_no_responders_and_timeout(bus):
    with pytest.raises(BusError) as e:
        await bus.request("tandem.test.nobody", Abort("r5"), timeout=1)
    assert e.value.code == "unavailable"

    async def slow(req):
        await asyncio.sleep(0.5)

    await bus.serve("tandem.test.slow", slow)
    with pytest.raises(BusError) as e:
        await bus.request("tandem.test.slow", Abort("r5"), timeout=0.2)
    assert e.value.code == "timeout"


async def test_stream_ordering(nats_server, bus):
    worker = await Bus.connect(NatsSettings(url=nats_server), name="worker")
    rid = "req-stream"
    try:
        async with await bus.subscribe(subjects.stream(rid), expected=StreamChunk) as chunks:
            n = 500
            for i in range(n):
                await worker.publish(subjects.stream(rid), StreamChunk(rid, i, [i], str(i), "w"))
            await worker.publish(subjects.stream(rid), StreamChunk(
                rid, n, [], "", "w", finish_reason="stop",
                usage={"prompt_tokens": 1, "completion_tokens": n, "cached_tokens": 0}))
            got = []
            while True:
                c = await chunks.next(timeout=5)
                got.append(c)
                if c.finish_reason:
                    break
        assert [c.seq for c in got] == list(range(n + 1))
        assert got[-1].usage["completion_tokens"] == n
    finally:
        await worker.close()


async def test_stream_next_times_out(bus):
    sub = await bus.subscribe(subjects.stream("silent"))
    with pytest.raises(BusError) as e:
        await sub.next(timeout=0.1)
    assert e.value.code == "timeout"
    await sub.unsubscribe()


async def test_subscription_skip_invalid(nats_server, bus):
    sub = await bus.subscribe("tandem.test.mixed", skip_invalid=True)
    await bus.nc.publish("tandem.test.mixed", b"garbage")
    await bus.publish("tandem.test.mixed", Abort("ok"))
    assert await sub.next(timeout=2) == Abort("ok")
    strict = await bus.subscribe("tandem.test.strict")
    await bus.nc.publish("tandem.test.strict", b"garbage")
    with pytest.raises(ValueError):
        await strict.next(timeout=2)
    await sub.unsubscribe()
    await strict.unsubscribe()


async def test_heartbeat_arrives(nats_server, bus):
    worker = await Bus.connect(NatsSettings(url=nats_server), name="worker")
    calls = 0

    async def make() -> Heartbeat:
        nonlocal calls
        calls += 1
        return Heartbeat("c1", subjects.CPU_DECODE, "cpu", "m", True, 0, calls, 10, 10, 2048,
                         "127.0.0.1", 0, 0.0, interval=0.05)

    try:
        sub = await bus.subscribe(subjects.HEARTBEAT_ALL, expected=Heartbeat)
        task = worker.start_heartbeat(subjects.heartbeat(subjects.CPU_DECODE, "c1"), make, 0.05)
        first = await sub.next(timeout=2)
        second = await sub.next(timeout=2)
        assert first.worker_id == "c1" and second.running == first.running + 1
        assert not task.done()
    finally:
        await worker.close()  # cancels the heartbeat
    assert task.cancelled()


async def test_a_woken_heartbeat_comes_sooner_but_not_within_its_gap(nats_server, bus):
    """``wake`` brings the next beat forward (a worker whose request ended); a burst of wakes
    gives one beat, not one each, and none within ``min_gap`` of the one before."""
    worker = await Bus.connect(NatsSettings(url=nats_server), name="worker")
    wake, sent = asyncio.Event(), []

    def make() -> Heartbeat:
        sent.append(time.monotonic())
        return Heartbeat("w1", subjects.CPU_DECODE, "cpu", "m", True, 0, len(sent), 10, 10, 2048,
                         "127.0.0.1", 0, 0.0, interval=30.0)

    try:
        sub = await bus.subscribe(subjects.heartbeat(subjects.CPU_DECODE, "w1"), expected=Heartbeat)
        worker.start_heartbeat(subjects.heartbeat(subjects.CPU_DECODE, "w1"), make, 30.0, wake=wake, min_gap=0.4)
        assert (await sub.next(timeout=2)).running == 1            # the first one at once
        for _ in range(5):                                         # a burst of ends: one beat, after the gap
            wake.set()
            await asyncio.sleep(0.02)
        assert (await sub.next(timeout=2)).running == 2
        assert sent[1] - sent[0] >= 0.4
        await asyncio.sleep(0.6)
        assert len(sent) == 2                                       # nothing more without a wake ...
        wake.set()                                                  # ... and a wake past the gap: at once
        assert (await sub.next(timeout=0.3)).running == 3
    finally:
        await worker.close()


async def test_heartbeats_of_another_release_are_refused_sparsely_and_said_in_health(nats_server, bus, caplog):
    """A service of another release whose heartbeat version this build does not speak: skipped,
    logged at the 1st, 2nd, 4th... (it was a line each beat: 631 in 10 minutes), and the gateway's
    /health says so (the service was invisible while /health said ready)."""
    import types

    import orjson

    from services.gateway.nats_backend import NatsBackend
    from shared.envelope import encode
    from shared.liveness import Heartbeats
    beats = Heartbeats(bus)
    await beats.start()
    try:
        good = Heartbeat("w-old", subjects.CPU_DECODE, "cpu", "m", True, 0, 0, 10, 10, 2048, "127.0.0.1", 0, 0.0)
        other = dict(orjson.loads(encode(good)), worker_id="w-new", v=99)
        with caplog.at_level(logging.DEBUG, logger="shared.bus"):
            for _ in range(5):
                await bus.nc.publish(subjects.heartbeat(subjects.CPU_DECODE, "w-new"), orjson.dumps(other))
            await bus.publish(subjects.heartbeat(subjects.CPU_DECODE, "w-old"), good)
            deadline = time.monotonic() + 5
            while "w-old" not in beats.last:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
        assert "w-new" not in beats.last and beats.refused()[0] == 5 and "version 99" in beats.refused()[1]
        warned = [r for r in caplog.records if "skipping invalid message" in r.getMessage()]
        assert [r.levelno for r in warned] == [logging.WARNING, logging.WARNING, logging.DEBUG, logging.WARNING,
                                               logging.DEBUG]
        ready, details = NatsBackend.health(types.SimpleNamespace(heartbeats=beats))
        assert details["refused_heartbeats"]["count"] == 5 and "version 99" in details["refused_heartbeats"]["last"]
        assert beats.refused(within=0.0) == (0, "")               # an old refusal is not news
    finally:
        await beats.close()


async def test_close_lets_running_handler_finish(private_nats):
    server = await Bus.connect(NatsSettings(url=private_nats), name="server")
    client = await Bus.connect(NatsSettings(url=private_nats), name="client")
    started = asyncio.Event()

    async def handler(req):
        started.set()
        await asyncio.sleep(0.2)
        return Ack(request_id=req.request_id)

    await server.serve("tandem.test.drain", handler)
    pending = asyncio.create_task(client.request("tandem.test.drain", Abort("r6"), timeout=5))
    await asyncio.wait({pending, asyncio.ensure_future(started.wait())}, return_when=asyncio.FIRST_COMPLETED)
    assert started.is_set(), f"the handler never ran: {pending.exception() if pending.done() else 'no reply yet'}"
    await server.close()
    assert (await pending) == Ack(request_id="r6")
    await client.close()


async def test_close_does_not_wait_on_unread_subscriptions_and_flushes_publishes(private_nats):
    a = await Bus.connect(NatsSettings(url=private_nats), name="a")
    b = await Bus.connect(NatsSettings(url=private_nats), name="b")
    unread = await a.subscribe("tandem.test.unread", Abort)   # like an abort listener nobody reads now
    got = await b.subscribe("tandem.test.last", Abort)
    for i in range(3):
        await b.publish("tandem.test.unread", Abort(f"u{i}"))
    await b.flush()
    for i in range(50):
        await a.publish("tandem.test.last", Abort(f"p{i}"))   # published right before close
    # nc.drain() waited until every subscription's pending messages were read: the whole timeout
    await asyncio.wait_for(a.close(timeout=60), 20)
    seen = [(await asyncio.wait_for(got.__anext__(), 5)).request_id for _ in range(50)]
    assert seen == [f"p{i}" for i in range(50)]
    assert unread is not None
    await b.close()


async def test_next_with_timeouts_never_loses_a_message(private_nats):
    """Reads with timeouts that keep expiring while messages arrive (the gateway's liveness
    polling under load): every message comes, in order."""
    a = await Bus.connect(NatsSettings(url=private_nats), name="a")
    b = await Bus.connect(NatsSettings(url=private_nats), name="b")
    sub = await a.subscribe("tandem.test.race", Abort)
    n = 3000

    async def publish():
        for i in range(n):
            await b.publish("tandem.test.race", Abort(str(i)))
            if i % 7 == 0:
                await asyncio.sleep(0)
        await b.flush()

    pub = asyncio.create_task(publish())
    got, timeouts = [], 0
    while len(got) < n:
        try:
            got.append(int((await sub.next(timeout=0.0002)).request_id))
        except BusError:
            timeouts += 1
            assert timeouts < 10 * n, f"stuck after {len(got)} messages"
    await pub
    assert got == list(range(n)) and timeouts > 0
    await a.close()
    await b.close()


async def test_user_password_credentials():
    with EmbeddedNats(extra_args=["--user", "tandem", "--pass", "s3cret"]) as url:
        env = {"TANDEM_NATS_URL": url, "TANDEM_NATS_USER": "tandem", "TANDEM_NATS_PASSWORD": "s3cret"}
        b = await Bus.connect(Settings.from_env(env))
        await b.serve("tandem.test.auth", lambda req: _ack(req))
        assert await b.request("tandem.test.auth", Abort("a"), timeout=2) == Ack(request_id="a")
        await b.close()
        bad = dict(env, TANDEM_NATS_PASSWORD="wrong")
        with pytest.raises(BusError) as e:
            await Bus.connect(Settings.from_env(bad))
        assert e.value.code == "unavailable"


async def test_token_credentials():
    with EmbeddedNats(extra_args=["--auth", "tok-123"]) as url:
        b = await Bus.connect(Settings.from_env({"TANDEM_NATS_URL": url, "TANDEM_NATS_TOKEN": "tok-123"}))
        await b.publish("tandem.test.x", Abort("t"))
        await b.flush()
        await b.close()
        with pytest.raises(BusError):
            await Bus.connect(Settings.from_env({"TANDEM_NATS_URL": url}))


async def test_connect_without_url_is_a_clear_error():
    with pytest.raises(ValueError, match="TANDEM_NATS_URL"):
        await Bus.connect(NatsSettings())


async def test_tap_prints_decoded_lines(private_nats):
    import io
    from services.tap import tap
    from shared.schemas import GenerateRequest

    out, ready = io.StringIO(), asyncio.Event()
    settings = Settings.from_env({"TANDEM_NATS_URL": private_nats})
    bus = await Bus.connect(settings, name="publisher")
    task = asyncio.create_task(tap("tandem.>", count=3, out=out, settings=settings, ready=ready))
    await asyncio.wait_for(ready.wait(), 5)
    await bus.publish(subjects.worker_generate("cpu-0"), GenerateRequest(
        "r-tap", [101, 102, 103], {"max_tokens": 4}, "batch", subjects.stream("r-tap")))
    await bus.publish(subjects.stream("r-tap"), StreamChunk("r-tap", 0, [7], "secret words", "cpu-0"))
    await bus.nc.publish("tandem.test.junk", b"\x00junk")
    await bus.flush()
    assert await asyncio.wait_for(task, 30) == 0
    await bus.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "tandem.worker.cpu-0.generate" in lines[0] and f"GenerateRequest/v{GenerateRequest.VERSION}" in lines[0]
    assert "prompt_token_ids=<3 ids>" in lines[0] and "101" not in lines[0]
    assert "StreamChunk/v3" in lines[1] and "text=<12 chars>" in lines[1]
    assert "secret" not in lines[1]
    assert "undecodable" in lines[2] and "<5 bytes>" in lines[2]


def test_tap_says_a_message_without_payload_is_one():
    """A NATS status (JetStream's idle heartbeat, "no responders" on a reply) has no payload: it
    was an "undecodable (not JSON ...)" line every 5 s under --replies."""
    from services.tap import format_line
    line = format_line("_INBOX.gateway.x", b"", headers={"Status": "100", "Description": "Idle Heartbeat"})
    assert "no payload (Status=100 Description=Idle Heartbeat)" in line and "undecodable" not in line
    assert format_line("_INBOX.gateway.x", b"").endswith("no payload")


def test_tap_show_text_and_cli_parsing():
    import argparse
    from services import tap as tap_mod

    p = argparse.ArgumentParser()
    tap_mod.add_arguments(p)
    a = p.parse_args(["tandem.stream.*", "--show-text", "--url", "nats://x:1"])
    assert (a.subject, a.show_text, a.url) == ("tandem.stream.*", True, "nats://x:1")
    assert p.parse_args([]).subject == "tandem.>"
    from shared.schemas import encode
    line = tap_mod.format_line("tandem.stream.r", encode(StreamChunk("r", 0, [7], "hello there", "w")),
                               show_text=True)
    assert "'hello there'" in line


async def _ack(req):
    return Ack(request_id=req.request_id)


@pytest.mark.parametrize("subject", ["bad subject with spaces", "tandem..route", "tandem.>.x", ""])
def test_tap_refuses_a_subject_nats_would_refuse_in_one_line(subject, caplog):
    """It was nats.errors.BadSubjectError's traceback, after connecting."""
    import argparse
    from services import tap as tap_mod
    code = tap_mod.main(argparse.Namespace(subject=subject, url="nats://127.0.0.1:1", show_text=False,
                                           replies=False, count=1))
    assert code == 1 and "is not a NATS subject" in caplog.text


async def test_a_server_gone_is_not_a_warning_every_reconnect_attempt(caplog):
    """With NATS gone every service tried again every 0.5 s and logged each refusal as a warning:
    the 1st, 2nd, 4th, 8th... since the connection was lost is one (with the count), the rest
    debug; a reconnect starts the count again."""
    from shared.bus import log
    b = Bus(None)
    b.nc = object()          # connected once (before the first connect, the count says "trying to connect")
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(10):
            await b._on_error(ConnectionRefusedError(111, "Connection refused"))
        assert len([r for r in caplog.records if "NATS error" in r.getMessage()]) == 4
        assert caplog.records[-1].getMessage().endswith("(8 since connected)")
        await b._on_reconnected()
        caplog.clear()
        await b._on_error(ConnectionRefusedError(111, "Connection refused"))
        assert [r.getMessage() for r in caplog.records][-1].endswith("(1 since connected)")


async def test_closing_after_the_server_went_first_is_quiet():
    """NATS stopped with the rest (systemd's control-group stop): the client's close found the
    connection reset, and the worker exited with a ConnectionResetError traceback."""
    import nats.errors

    class Gone:
        is_closed = False

        async def flush(self):
            raise nats.errors.ConnectionClosedError()

        async def close(self):
            raise ConnectionResetError("Connection lost")
    await Bus(Gone()).close()


def test_tap_exits_at_once_on_sigterm_while_the_server_is_frozen():
    """`tandem tap` publishes nothing, so on SIGTERM it has nothing to flush: with its NATS server
    frozen (SIGSTOP: no PONG ever comes) it still exits at once, not after the bus's 5 s flush."""
    import subprocess
    import sys
    server = EmbeddedNats()
    url = server.start()
    tap = subprocess.Popen([sys.executable, "-m", "services.cli", "tap", "tandem.>", "--url", url],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        seen = ""
        while "tapping" not in seen and time.monotonic() < deadline and tap.poll() is None:
            seen += tap.stderr.readline()
        assert "tapping" in seen, seen
        os.kill(server.proc.pid, signal.SIGSTOP)
        termed = time.monotonic()
        tap.send_signal(signal.SIGTERM)
        rc = tap.wait(timeout=10)
        took = time.monotonic() - termed
        assert rc == 0 and took < 2.0, (rc, took)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        if tap.poll() is None:
            tap.kill()
        server.stop()
