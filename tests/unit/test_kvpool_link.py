"""Path choice by link (pure), same-host identity, sysfs readers."""

from __future__ import annotations

import os

from shared.transfer.link import Link, choose_paths, interface_gbps, rdma_link, rdma_ports, same_host


def test_same_host_needs_both_ids_equal():
    assert same_host("m1:b1", "m1:b1")
    assert not same_host("m1:b1", "m1:b2")       # rebooted / other kernel
    assert not same_host(":b1", ":b1")           # machine id unknown: never assume


def test_choose_paths():
    local = Link(True, None, "shm")
    slow = Link(False, 1.0, "sysfs")
    fast = Link(False, 100.0, "sysfs")
    assert choose_paths(local, 8.0, True) == ["shm", "tcp"]
    assert choose_paths(local, 8.0, True, shm=False) == ["tcp"]
    assert choose_paths(slow, 8.0, True) == ["tcp+zstd", "tcp"]      # link slower than the codec
    assert choose_paths(slow, 8.0, False) == ["tcp"]                 # already compressed
    assert choose_paths(fast, 8.0, True) == ["tcp"]
    assert choose_paths(fast, 8.0, True, rdma=True) == ["rdma", "tcp"]
    assert choose_paths(Link(False, None, "unknown"), 8.0, True) == ["tcp"]


def test_sysfs_readers(tmp_path):
    port = tmp_path / "ib" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("100 Gb/sec (4X EDR)\n")
    down = tmp_path / "ib" / "mlx5_1" / "ports" / "1"
    down.mkdir(parents=True)
    (down / "state").write_text("1: DOWN\n")
    ports = rdma_ports(str(tmp_path / "ib"))
    assert [(p.device, p.port, p.gbps) for p in ports] == [("mlx5_0", "1", 100.0)]
    os.makedirs(tmp_path / "net" / "eth0")
    (tmp_path / "net" / "eth0" / "speed").write_text("25000\n")
    assert interface_gbps("eth0", str(tmp_path / "net")) == 25.0
    assert interface_gbps("lo", str(tmp_path / "net")) is None


def _port(root, dev: str, state: str, rate: str | None) -> None:
    port = root / dev / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state)
    if rate is not None:
        (port / "rate").write_text(rate)


def test_rdma_link_from_fake_sysfs(tmp_path):
    """The fastest ACTIVE port with a known rate makes an rdma link, and rdma goes first."""
    assert rdma_link(str(tmp_path / "none")) is None                  # no /sys/class/infiniband
    _port(tmp_path, "mlx5_0", "1: DOWN\n", "400 Gb/sec (4X NDR)\n")
    _port(tmp_path, "mlx5_1", "4: ACTIVE\n", None)                    # rate unknown: not used
    assert rdma_link(str(tmp_path)) is None
    _port(tmp_path, "mlx5_2", "4: ACTIVE\n", "100 Gb/sec (4X EDR)\n")
    _port(tmp_path, "rocep1s0", "4: ACTIVE\n", "200 Gb/sec (2X HDR)\n")
    link = rdma_link(str(tmp_path))
    assert link == Link(False, 200.0, "rdma")
    assert choose_paths(link, 8.0, True, rdma=True) == ["rdma", "tcp"]
    assert choose_paths(link, 8.0, True, rdma=False) == ["tcp"]       # nixl missing: never rdma
