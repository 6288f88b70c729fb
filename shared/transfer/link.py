"""What a link to a peer can do, and which path to use over it — pure functions plus sysfs reads.

- Same host: both ends exchange ``host_identity()`` (``/etc/machine-id`` + boot id) in a hello
  frame; equal identities mean shared memory works (a container with its own /dev/shm or a
  rebooted host gives a different identity: no false positive).
- RDMA: ``rdma_ports()`` lists ACTIVE ports under ``/sys/class/infiniband/*/ports/*/state`` with
  their rate.
- Otherwise the interface that reaches the peer reports its speed in
  ``/sys/class/net/<if>/speed`` (Mb/s); where the kernel reports none (loopback, some virtual
  NICs) a short timed probe transfer measures it. Results are cached per peer.

``choose_paths`` turns that into an ordered list of paths to try (the first that works wins):
shm on the same host; rdma where a NIXL transport and an active port exist; compressed TCP
only when the link is slower than the codec; plain TCP always last.
"""

from __future__ import annotations

import glob
import os
import socket
from dataclasses import dataclass


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_identity() -> str:
    """machine-id:boot-id of this kernel (empty parts where the files are missing)."""
    machine = _read("/etc/machine-id") or _read("/var/lib/dbus/machine-id")
    return f"{machine}:{_read('/proc/sys/kernel/random/boot_id')}"


def same_host(a: str, b: str) -> bool:
    """Two identities name the same running kernel (both parts known and equal)."""
    ma, _, ba = a.partition(":")
    mb, _, bb = b.partition(":")
    return bool(ma and ba) and (ma, ba) == (mb, bb)


@dataclass(frozen=True)
class RdmaPort:
    device: str
    port: str
    gbps: float | None      # from ports/N/rate ("100 Gb/sec (4X EDR)")


def rdma_ports(root: str = "/sys/class/infiniband") -> list[RdmaPort]:
    """ACTIVE InfiniBand / RoCE ports."""
    out = []
    for state in sorted(glob.glob(os.path.join(root, "*", "ports", "*", "state"))):
        if "ACTIVE" not in _read(state):
            continue
        port_dir = os.path.dirname(state)
        rate = _read(os.path.join(port_dir, "rate")).split()
        try:
            gbps = float(rate[0])
        except (IndexError, ValueError):
            gbps = None
        out.append(RdmaPort(port_dir.split(os.sep)[-3], os.path.basename(port_dir), gbps))
    return out


def interface_for(local_ip: str) -> str | None:
    """Name of the interface holding ``local_ip`` (IPv4), via SIOCGIFADDR."""
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(res[20:24]) == local_ip:
                return name
    return None


def interface_gbps(name: str, root: str = "/sys/class/net") -> float | None:
    """The interface's reported speed in Gb/s, None when the kernel reports none."""
    raw = _read(os.path.join(root, name, "speed"))
    try:
        mbps = int(raw)
    except ValueError:
        return None
    return mbps / 1000 if mbps > 0 else None


@dataclass(frozen=True)
class Link:
    same_host: bool          # hello identities match: shared memory works
    gbps: float | None       # usable rate estimate (None: unknown)
    source: str              # "shm", "rdma", "sysfs", "probe", "unknown"


def rdma_link(root: str = "/sys/class/infiniband") -> Link | None:
    """The link through the fastest ACTIVE RDMA port whose rate is known; None without one."""
    rates = [p.gbps for p in rdma_ports(root) if p.gbps]
    return Link(False, max(rates), "rdma") if rates else None


def choose_paths(link: Link, codec_gbps: float, compressible: bool, *, shm: bool = True,
                 rdma: bool = False) -> list[str]:
    """Paths to try in order. Compression only pays when the link is slower than the codec."""
    paths = []
    if link.same_host and shm:
        paths.append("shm")
    if rdma:
        paths.append("rdma")
    if compressible and not link.same_host and link.gbps is not None and link.gbps < codec_gbps:
        paths.append("tcp+zstd")
    paths.append("tcp")
    return paths
