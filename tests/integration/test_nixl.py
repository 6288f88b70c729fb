"""The rdma path (NIXL): byte-exact READs, corruption detected, selection only with an ACTIVE
RDMA port, retry on TCP when the receiver has no NIXL.

Without an RDMA NIC, UCX (inside nixl-cu12) moves the bytes over its shared-memory / TCP
transports: the NIXL code path (agents, registration, metadata, READ, completion) is the same.
``test_rdma_over_verbs`` needs a real ACTIVE port and is skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import functools
import os

import pytest

from shared.transfer import (
    ChecksumError, DataPlaneSender, TcpKVReceiver, TcpKVSender, TransferError, TransferState, checksum,
)
from shared.transfer import link as links
from shared.transfer import nixl

pytestmark = pytest.mark.timeout(120)
needs_nixl = pytest.mark.skipif(not nixl.available(),
                                reason="nixl not installed (optional extra: pip install --no-deps nixl nixl-cu12)")
MiB = 1 << 20
_rdma_link = links.rdma_link


@pytest.fixture
async def rx():
    r = TcpKVReceiver("127.0.0.1", 0, max_bytes=256 * MiB, timeout=10.0)
    await r.listen()
    yield r
    await r.close()


@pytest.fixture
async def tx():
    t = TcpKVSender(timeout=10.0, connect_timeout=1.0)
    yield t
    await t.close()


def _fake_sysfs(root, state: str) -> None:
    port = root / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state)
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")


def _other_host(sender: DataPlaneSender, monkeypatch, sysfs) -> None:
    """The peer looks like another host whose link has no reported speed; RDMA ports from ``sysfs``."""
    sender.identity = "other-machine:other-boot"
    monkeypatch.setattr(links, "rdma_link", functools.partial(_rdma_link, str(sysfs)))
    monkeypatch.setattr("shared.transfer.select._interface_gbps_towards", lambda h, p: None)


@needs_nixl
@pytest.mark.parametrize("n", [1, 3 * MiB + 7, 64 * MiB], ids=["1B", "3MiB", "64MiB"])
async def test_rdma_path_is_byte_exact(rx, tx, n):
    payload = os.urandom(n)
    host, port = rx.address
    tid = f"rdma-{n}"
    sent, got = await asyncio.gather(tx.send(host, port, tid, payload, mode="rdma"), rx.take(tid, 30))
    with got:
        assert bytes(got.data) == payload
        assert got.checksum == sent.checksum == checksum(payload)
    assert sent.path == "rdma" and sent.wire_bytes == n
    assert not rx.nixl.stuck


@needs_nixl
async def test_agents_do_not_spin_when_idle(rx, tx):
    """NIXL's own progress thread would keep a core busy for as long as an agent exists."""
    import resource
    payload = os.urandom(MiB)
    host, port = rx.address
    sent, got = await asyncio.gather(tx.send(host, port, "idle", payload, mode="rdma"), rx.take("idle", 10))
    got.release()

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0 = cpu()
    await asyncio.sleep(1.0)
    assert cpu() - c0 < 0.2   # two spinning agents would take ~1 s each


@needs_nixl
async def test_rdma_corruption_is_detected(rx, tx):
    host, port = rx.address
    payload = os.urandom(2 * MiB)
    wrong = checksum(payload[:-1] + bytes([payload[-1] ^ 1]))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        await tx.send(host, port, "bad", payload, checksum=wrong, mode="rdma")
    assert rx.poll("bad") is TransferState.FAILED
    with pytest.raises(ChecksumError):
        await rx.take("bad", 1)
    assert rx.pool.allocated <= 4 * MiB  # the buffer went back to the pool


@needs_nixl
async def test_bad_offer_fails_the_transfer(rx, tx, monkeypatch):
    """An offer naming memory the sender never registered: the READ fails, no partial payload."""
    real_offer = tx.nixl.offer

    def lying_offer(view):
        body, release = real_offer(view)
        addr, n = nixl.OFFER.unpack_from(body)
        return nixl.OFFER.pack(addr + (1 << 40), n) + body[nixl.OFFER.size:], release

    monkeypatch.setattr(tx.nixl, "offer", lying_offer)
    host, port = rx.address
    with pytest.raises(TransferError, match="NIXL"):
        await tx.send(host, port, "lie", os.urandom(MiB), mode="rdma")
    with pytest.raises(TransferError, match="NIXL"):
        await rx.take("lie", 1)


@needs_nixl
async def test_selection_picks_rdma_only_with_an_active_port(rx, monkeypatch, tmp_path):
    payload = os.urandom(MiB)
    host, port = rx.address
    _fake_sysfs(tmp_path / "up", "4: ACTIVE\n")
    sender = DataPlaneSender(TcpKVSender(timeout=10.0))
    _other_host(sender, monkeypatch, tmp_path / "up")
    assert await sender.link(host, port) == links.Link(False, 200.0, "rdma")
    res, got = await asyncio.gather(sender.send(host, port, "a", payload, compressible=False), rx.take("a", 10))
    with got:
        assert res.path == "rdma" and res.attempts == 1 and bytes(got.data) == payload

    _fake_sysfs(tmp_path / "down", "1: DOWN\n")
    sender = DataPlaneSender(TcpKVSender(timeout=10.0), probe_bytes=MiB)
    _other_host(sender, monkeypatch, tmp_path / "down")
    assert (await sender.link(host, port)).source == "probe"
    res, got = await asyncio.gather(sender.send(host, port, "b", payload, compressible=False), rx.take("b", 10))
    with got:
        assert res.path == "tcp" and bytes(got.data) == payload


async def test_no_nixl_at_the_sender_means_no_rdma(rx, monkeypatch, tmp_path):
    _fake_sysfs(tmp_path, "4: ACTIVE\n")
    sender = DataPlaneSender(TcpKVSender(timeout=10.0))
    _other_host(sender, monkeypatch, tmp_path)
    monkeypatch.setattr(nixl, "available", lambda: False)
    payload = os.urandom(MiB)
    res, got = await asyncio.gather(sender.send(*rx.address, "a", payload, compressible=False), rx.take("a", 10))
    with got:
        assert res.path == "tcp" and res.attempts == 1 and bytes(got.data) == payload


@needs_nixl
async def test_receiver_without_nixl_is_retried_on_tcp(rx, monkeypatch, tmp_path):
    _fake_sysfs(tmp_path, "4: ACTIVE\n")
    sender = DataPlaneSender(TcpKVSender(timeout=10.0))
    _other_host(sender, monkeypatch, tmp_path)

    def no_agent():
        raise nixl.PathUnavailable("nixl is not installed (pip install --no-deps nixl nixl-cu12)")

    monkeypatch.setattr(rx.nixl, "agent", no_agent)
    payload = os.urandom(MiB)
    res, got = await asyncio.gather(sender.send(*rx.address, "a", payload, compressible=False), rx.take("a", 10))
    with got:
        assert res.path == "tcp" and res.attempts == 2 and bytes(got.data) == payload


@needs_nixl
async def test_rdma_over_verbs(monkeypatch):
    """On a host with an ACTIVE InfiniBand / RoCE port: UCX limited to its RDMA transports."""
    if not links.rdma_ports():
        pytest.skip("no ACTIVE RDMA port in /sys/class/infiniband")
    monkeypatch.setenv("UCX_TLS", "rc,ud,self")  # read when the agents start (first use)
    r = TcpKVReceiver("127.0.0.1", 0, max_bytes=256 * MiB, timeout=10.0)
    host, port = await r.listen()
    t = TcpKVSender(timeout=10.0)
    try:
        payload = os.urandom(64 * MiB)
        sent, got = await asyncio.gather(t.send(host, port, "v", payload, mode="rdma"), r.take("v", 30))
        with got:
            assert bytes(got.data) == payload and sent.path == "rdma"
    finally:
        await t.close()
        await r.close()
