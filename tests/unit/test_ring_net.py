"""The ring connections' messages (shared/ring/): tagged, so a changed, replayed or
reflected message is refused, on the socket or through a same-host region."""

from __future__ import annotations

import os
import socket
import stat

import pytest
import torch

from shared.ring.wire import Channel as _Channel
from shared.ring.wire import map_region as _map_region, new_region as _new_region, session_key as _session_key


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


shm = pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no /dev/shm here")


def shared_pair(area: int = 1 << 16):
    """A channel pair whose payloads go through a member's region (mapped by both, unlinked)."""
    c, s, a, b = pair()
    name, region = _new_region(area)
    path = os.path.join("/dev/shm", name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    s.attach(region, area)
    c.attach(_map_region(name, area), area)
    assert not os.path.exists(path)      # gone once mapped: no one else can open it
    return c, s, a, b


@shm
@pytest.mark.parametrize("size", [1, 5000, 1 << 16, (1 << 16) + 1])   # the last does not fit the area
def test_payloads_go_through_the_region_verified(size):
    c, s, a, b = shared_pair()
    body = os.urandom(size)
    c.send(3, {"sid": "r"}, body)
    op, meta, payload = s.recv()
    assert bytes(payload) == body and c.link == s.link == "shm"
    s.send(0, {"shape": [1]}, body[::-1])
    assert bytes(c.recv()[2]) == body[::-1]
    b.setblocking(False)
    with pytest.raises(BlockingIOError):   # nothing of it left on the socket
        b.recv(1)


@shm
def test_a_payload_changed_in_the_region_is_refused():
    """The tag is checked over the receiver's private copy: whoever rewrites the region between
    the send and the receive (a peer with the region but without the connection's key) is caught."""
    c, s, a, b = shared_pair()
    c.send(3, {"sid": "r"}, b"\x01" * 1000)
    s._in[10:11] = b"\x02"
    with pytest.raises(ConnectionError, match="tag"):
        s.recv()


def test_only_a_ring_region_is_mapped():
    for name in ["tandem-kv-" + "0" * 32, "tandem-ring-../../etc/passwd", "tandem-ring-" + "0" * 31]:
        with pytest.raises(ValueError, match="not a ring region"):
            _map_region(name, 1 << 16)


class _NoMember:
    """Enough of a member for a connection's setup (no op reaches it)."""
    name, kv = "m", torch.zeros(1)


@shm
@pytest.mark.parametrize("server_shm, client_shm, other_host, want", [
    (True, True, False, "shm"), (False, True, False, "tcp"), (True, False, False, "tcp"), (True, True, True, "tcp")])
def test_a_connection_takes_shm_only_on_one_host_with_both_ends_willing(monkeypatch, server_shm, client_shm,
                                                                       other_host, want):
    from shared import ring as ring_net
    from shared.ring import remote
    server = ring_net.RingServer(_NoMember(), key=b"k", shm=server_shm)
    server.start()
    if other_host:   # the coordinator's identity as another kernel's
        monkeypatch.setattr(remote.links, "host_identity", lambda: "another-machine:another-boot")
    try:
        member = ring_net.RemoteMember("m", "127.0.0.1", server.port, b"k", None, shm=client_shm)
        assert member.link == want
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("tandem-ring-")]
        member.close()
    finally:
        server.close()


@shm
def test_messages_in_flight_each_keep_their_slot():
    """The fold sends a layer's head groups' states before the receiver reads one: each small
    payload takes its own slot of the area (message counter % SLOTS), so none overwrites another."""
    from shared.ring.wire import SLOTS
    c, s, a, b = shared_pair()
    slot = (1 << 16) // SLOTS
    bodies = [os.urandom(n) for n in [1, slot, 7, slot - 1] * ((SLOTS - 1) // 4)]
    for i, body in enumerate(bodies):
        c.send(11, {"g": i}, body)
    for i, body in enumerate(bodies):
        op, meta, payload = s.recv()
        assert (op, meta["g"], bytes(payload)) == (11, i, body)


def test_a_link_no_fold_announced_is_refused():
    """A member's link into the next member must carry the ticket the coordinator announced there
    (``CHAIN``); any other is refused and closed (and opening one needs the key, as always)."""
    from shared import ring as ring_net
    from shared.ring import wire
    server = ring_net.RingServer(_NoMember(), key=b"k", shm=False)
    server.start()
    try:
        link = ring_net.RemoteMember("m", "127.0.0.1", server.port, b"k", None, shm=False)
        with pytest.raises(ring_net.RingMemberError, match="no fold awaits"):
            link._call(wire.Op.PEER, {"ticket": "0" * 32})
        with pytest.raises(ring_net.RingMemberLost):
            link._call(wire.Op.PEER, {"ticket": "0" * 32})
        link.close()
        with pytest.raises(ring_net.RingMemberLost, match="refused our proof"):
            ring_net.RemoteMember("m", "127.0.0.1", server.port, b"another key", None, shm=False)
    finally:
        server.close()


def test_connections_that_prove_nothing_are_bounded(monkeypatch):
    """At most HANDSHAKES connections wait on their proof of the key at once, a thread each; a new
    one closes the oldest (counted, logged), so silent connections never lock a member with the
    key out: it gets in at once, while they are still open."""
    import threading
    import time
    from shared import ring as ring_net
    from shared.ring import server as ring_server
    monkeypatch.setattr(ring_server, "HANDSHAKES", 4)
    server = ring_net.RingServer(_NoMember(), key=b"k", shm=False, timeout=30.0)
    server.start()
    silent = []
    try:
        threads = threading.active_count()
        for _ in range(10):
            silent.append(socket.create_connection(("127.0.0.1", server.port)))
            time.sleep(0.02)                                # accepted in this order
        for _ in range(100):
            if server.turned_away >= 6:
                break
            time.sleep(0.02)
        assert server.turned_away == 6
        for s in silent[:6]:                                # the six oldest: closed
            s.settimeout(5)
            assert s.recv(64)[:4] == b"TRG1" and s.recv(64) == b""
        for _ in range(100):
            if threading.active_count() <= threads + 4:
                break
            time.sleep(0.02)
        assert threading.active_count() <= threads + 4
        link = ring_net.RemoteMember("m", "127.0.0.1", server.port, b"k", None, shm=False)
        link.close()
        assert server.turned_away == 7
    finally:
        for s in silent:
            s.close()
        server.close()


def test_a_hello_sent_byte_by_byte_is_still_due_within_the_deadline(monkeypatch):
    """HANDSHAKE_S is a deadline from accept for the whole hello, not a wait between bytes: a
    peer sending a byte every 0.1 s is closed after ~0.3 s."""
    import time
    from shared import ring as ring_net
    from shared.ring import server as ring_server
    monkeypatch.setattr(ring_server, "HANDSHAKE_S", 0.3)
    server = ring_net.RingServer(_NoMember(), key=b"k", shm=False, timeout=30.0)
    server.start()
    slow = socket.create_connection(("127.0.0.1", server.port))
    try:
        slow.settimeout(0.1)
        t0, closed = time.monotonic(), False
        while time.monotonic() - t0 < 5 and not closed:
            try:
                slow.sendall(b"T")
                while True:
                    got = slow.recv(64)
                    if not got:
                        closed = True
                        break
            except TimeoutError:
                pass
            except OSError:
                closed = True
        assert closed and time.monotonic() - t0 < 2.0
    finally:
        slow.close()
        server.close()


def test_both_kinds_of_member_speak_the_ring_member_protocol():
    """``Ring`` calls a member through ``RingMember`` only: the one in this process and the proxy
    of one in another worker both have every call, with the same parameters."""
    import inspect

    from shared.ring.remote import RemoteMember
    from shared.ring.session import LocalMember, RingMember
    calls = [n for n, v in vars(RingMember).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"reserve", "load", "owns", "post", "collect", "read", "release"} <= set(calls)
    for cls in (LocalMember, RemoteMember):
        for n in calls:
            want = list(inspect.signature(getattr(RingMember, n)).parameters)
            assert list(inspect.signature(getattr(cls, n)).parameters) == want, (cls.__name__, n)


def test_ring_steps_and_bytes_reach_the_metrics():
    from prometheus_client import REGISTRY

    from shared import metrics

    def value(name, labels=None):
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0
    steps, out = value("tandem_ring_steps_total"), value("tandem_ring_bytes_total", {"direction": "out"})
    metrics.ring_step(0.01, out=4096, back=512, ring=0)
    assert value("tandem_ring_steps_total") == steps + 1
    assert value("tandem_ring_bytes_total", {"direction": "out"}) == out + 4096


def test_a_cpu_decode_worker_hosts_ring_members_on_the_port_it_is_given(monkeypatch):
    """TANDEM_RING_PORT: a fixed port a firewall rule can name (0: a free one, as before)."""
    import socket

    import shared.ring.connector as connector
    from shared.ring.session import LocalMember
    from shared.settings import Settings

    import torch

    class Member(LocalMember):
        def __init__(self, engine, on_engine, name):
            self.name, self.kv = name, torch.zeros(4)

    monkeypatch.setattr(connector, "EngineMember", Member)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = Settings.from_env({"TANDEM_RING_PORT": str(port), "TANDEM_DATA_KEY": "k"}).data
    ring = connector.RingConnector("c1", data, None, type("E", (), {"engine": None, "run_blocking": None})())
    try:
        assert ring.host() == port
    finally:
        if ring.server is not None:
            ring.server.close()
    with pytest.raises(ValueError, match="must differ"):
        Settings.from_env({"TANDEM_RING_PORT": "7000", "TANDEM_DATA_PORT": "7000"})
    with pytest.raises(ValueError, match="TANDEM_RING_PORT must be in"):
        Settings.from_env({"TANDEM_RING_PORT": "70000"})


def test_a_member_that_stopped_beating_is_named_lost_and_an_unknown_address_is_refused():
    """A ring planned with a member that died since: the coordinator's (or the prefill's) check
    names that member (RingMemberLost: the gateway resumes without it, not without the sender);
    an address no heartbeat named, or another live worker's, stays a "forbidden" refusal."""
    import asyncio

    from shared.bus import BusError
    from shared.kv_connector import DataPeers
    from shared.liveness import clock
    from shared.ring.connector import RingConnector, bus_error
    from shared.ring.wire import RingMemberLost
    from shared.schemas import Heartbeat, RingPeer
    from shared.settings import Settings

    def beat(wid, port, ring_port):
        return Heartbeat(worker_id=wid, role="cpu-decode", device="cpu", model="m", ready=True, queue_depth=0,
                         running=0, free_kv_blocks=1, total_kv_blocks=1, max_context=1, data_host="127.0.0.1",
                         data_port=port, ts=0.0, interval=1.0, ring_port=ring_port)

    async def main():
        peers = DataPeers(None, wait_s=0.05)
        peers._seen_beat(beat("c1", 9001, 7001), clock())
        peers._seen_beat(beat("c2", 9002, 7002), clock())
        peers._seen_beat(beat("c3", 9003, 7003), clock() - 100.0)   # its last heartbeat long ago: dead
        ring = RingConnector("c1", Settings.from_env({}).data, peers, None)
        me = RingPeer("c1", "127.0.0.1", 7001)
        assert await ring.check([me, RingPeer("c2", "127.0.0.1", 7002)], "c1", "r1") == 0
        with pytest.raises(RingMemberLost) as lost:
            await ring.check([me, RingPeer("c2", "127.0.0.1", 7002), RingPeer("c3", "127.0.0.1", 7003)], "c1", "r1")
        assert lost.value.lost == "c3" and bus_error(lost.value, "r1").lost == "c3"
        for member in (RingPeer("c3", "127.0.0.1", 7999), RingPeer("c3", "127.0.0.1", 7002)):  # nobody's / c2's
            with pytest.raises(BusError) as e:
                await ring.check([me, member], "c1", "r1")
            assert e.value.code == "forbidden"

    asyncio.run(main())


def test_a_coordinator_gives_up_on_a_silent_member_before_its_own_step_deadline():
    """The gateway finds a worker whose engine step runs past TANDEM_STEP_DEADLINE_S stuck and
    resumes without it; a coordinator waiting on a stopped member is in such a step. So it waits
    for the member a little less long: the ring's error names the member first."""
    from shared.ring.connector import RingConnector
    from shared.settings import Settings

    data = Settings.from_env({}).data
    assert data.timeout == 30.0
    assert RingConnector("c1", data, None, None, step_deadline_s=30.0).member_timeout == 24.0
    assert RingConnector("c1", data, None, None, step_deadline_s=120.0).member_timeout == 30.0
    assert RingConnector("c1", data, None, None).member_timeout == 30.0


def test_a_member_that_timed_out_is_not_asked_to_release():
    """A coordinator whose member stopped answering (SIGSTOP) fails the step after its timeout,
    then releases the session: asking that member again held the engine for another whole
    timeout — past the step deadline, so the gateway took the coordinator's engine for stuck and
    resumed without it (a member frozen 40 s lost the request though a spare worker was free).
    A member whose connection broke or timed out is not asked again; a healthy one is."""
    from shared.ring.remote import RemoteMember
    from shared.ring.wire import RingMemberLost

    class Channel:
        def __init__(self, answers):
            self.sent, self.answers = [], answers

        def send(self, op, meta, payload=b""):
            self.sent.append(op)

        def recv(self):
            if not self.answers:
                raise socket.timeout("timed out")
            return self.answers.pop(0)

    def member(answers):
        m = RemoteMember.__new__(RemoteMember)
        m.name, m.ranges, m.lost, m.bytes_out, m.bytes_back = "b", {"s": (0, 256)}, False, 0, 0
        m.ch = Channel(answers)
        return m

    silent = member([])
    with pytest.raises(RingMemberLost) as e:
        silent._call(1, {})
    assert e.value.lost == "b" and silent.lost
    silent.release("s")
    assert silent.ch.sent == [1] and silent.ranges == {}   # no RELEASE sent to it
    healthy = member([(0, {}, b"")])
    healthy.release("s")
    assert len(healthy.ch.sent) == 1 and not healthy.lost
