"""The data plane as services use it: one sender that picks a path per peer and falls back.

``DataPlaneSender.send`` learns each peer once (cached): a hello frame exchanges host
identities (same host → shm), then the link rate comes from RDMA sysfs, the interface's
reported speed, or a short timed probe. ``link.choose_paths`` orders the paths (rdma only with
an ACTIVE RDMA port and ``nixl`` importable); a path that fails (shm segment or NIXL refused
by the receiver, checksum, connection lost) is retried on the next one, and the
last error is raised only when every path failed. ``PeerUnavailable`` (nobody listening) and
``NotAuthorized`` (the receiver refused the frame's tag: another data-plane key) are raised at
once: no other path gets through either.

    transport = make_transport(settings.data)
    rx = transport.receiver(host, port)        # accepts every path's frames
    tx = transport.sender()                    # DataPlaneSender
    res = await tx.send(host, port, tid, payload)   # res.path, res.wire_bytes, res.attempts
"""

from __future__ import annotations

import logging
import socket
import time

import numpy as np

from shared import metrics
from shared.transfer import link as links
from shared.transfer import nixl
from shared.transfer.base import Discarded, KVSender, KVTransport, NotAuthorized, PeerUnavailable, SendResult, TransferError
from shared.transfer.shm import available as shm_available
from shared.transfer.frames import MiB
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender, TcpTransport
from shared.transfer.zstd import compress

log = logging.getLogger(__name__)

_codec_gbps: float | None = None


def codec_gbps() -> float:
    """zstd level-1 compression rate on float16 KV-like data, Gb/s (measured once per process)."""
    global _codec_gbps
    if _codec_gbps is None:
        sample = np.random.default_rng(0).normal(0, 1, 2 * MiB).astype(np.float16)
        t0 = time.perf_counter()
        compress(memoryview(sample.tobytes()))
        _codec_gbps = sample.nbytes * 8 / 1e9 / (time.perf_counter() - t0)
    return _codec_gbps


class DataPlaneSender(KVSender):
    def __init__(self, tcp: TcpKVSender, *, shm: bool = True, rdma: bool = True, probe_bytes: int = 8 * MiB):
        self.tcp = tcp
        self.shm = shm and shm_available()
        self.rdma = rdma                  # try NIXL where an RDMA port is ACTIVE and nixl imports
        self.probe_bytes = probe_bytes
        self.identity = links.host_identity()
        self.links: dict[tuple[str, int], links.Link] = {}   # peer -> what its link can do
        self.sent: list[SendResult] = []                      # recent transfers (metrics, tests)

    async def link(self, host: str, port: int) -> links.Link:
        """What the link to (host, port) can do; detected once, then cached."""
        key = (host, port)
        if key not in self.links:
            self.links[key] = await self._detect(host, port)
            log.info("data plane link to %s:%d: %s", host, port, self.links[key])
        return self.links[key]

    async def _detect(self, host: str, port: int) -> links.Link:
        peer = await self.tcp.hello(host, port, self.identity)
        if links.same_host(self.identity, peer):
            return links.Link(True, None, "shm")
        rdma = links.rdma_link()
        if rdma is not None:
            return rdma
        gbps = _interface_gbps_towards(host, port)
        if gbps is not None:
            return links.Link(False, gbps, "sysfs")
        seconds = await self.tcp.probe(host, port, self.probe_bytes)
        return links.Link(False, self.probe_bytes * 8 / 1e9 / seconds, "probe")

    async def send(self, host: str, port: int, transfer_id: str, payload, *, checksum: str | None = None,
                   timeout: float | None = None, compressible: bool = True, mode: str | None = None
                   ) -> SendResult:
        """Send over the best path (``mode`` forces one); retried on the next path on failure."""
        if mode is None:
            lk = await self.link(host, port)
            paths = links.choose_paths(lk, codec_gbps(), compressible, shm=self.shm,
                                       rdma=lk.source == "rdma" and self.rdma and nixl.available())
        else:
            paths = [mode]
        error: TransferError | None = None
        for i, path in enumerate(paths):
            try:
                res = await self.tcp.send(host, port, transfer_id, payload, checksum=checksum,
                                          timeout=timeout, mode=path)
            except (PeerUnavailable, NotAuthorized, Discarded):   # another path would fare no better
                raise
            except TransferError as e:
                error = e
                log.warning("KV transfer %s over %s failed (%s)%s", transfer_id, path, e,
                            "; retrying on " + paths[i + 1] if i + 1 < len(paths) else "")
                continue
            res.attempts = i + 1
            self.sent = self.sent[-99:] + [res]
            metrics.transfer(res.path, res.nbytes, res.seconds)
            return res
        assert error is not None
        raise error

    async def close(self) -> None:
        await self.tcp.close()


def _interface_gbps_towards(host: str, port: int) -> float | None:
    """Reported speed of the interface this host uses to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            local = s.getsockname()[0]
    except OSError:
        return None
    name = links.interface_for(local)
    return links.interface_gbps(name) if name else None


class DataPlane(KVTransport):
    """Every path behind one interface: the receiver takes shm, tcp, tcp+zstd and rdma frames."""
    name = "auto"

    def __init__(self, tcp: TcpTransport, shm: bool = True):
        self.tcp_transport = tcp
        self.shm = shm

    def sender(self) -> DataPlaneSender:
        return DataPlaneSender(self.tcp_transport.sender(), shm=self.shm)

    def receiver(self, host: str = "127.0.0.1", port: int = 0) -> TcpKVReceiver:
        return self.tcp_transport.receiver(host, port)


def make_transport(settings) -> DataPlane:
    """From a shared.settings.DataPlaneSettings."""
    return DataPlane(TcpTransport.from_settings(settings), shm=getattr(settings, "shm", True))
