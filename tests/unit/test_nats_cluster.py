"""The cluster configuration (shared/nats_cluster.py, `tandem nats-auth --cluster`), the replica
setting, and Bus.jetstream_ensure; no server (tests/integration/test_nats_cluster.py runs one)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess

import nats.errors
import nats.js.errors
import pytest

from services import nats_auth
from shared import bus_auth
from shared.bus import Bus
from shared.nats_server import find_nats_server
from shared.nats_cluster import cluster_config, replicas_for, route_url
from shared.settings import NatsSettings, Settings


def test_creds_hold_a_route_credential_and_old_files_get_one(tmp_path):
    path = str(tmp_path / "nats.creds")
    old = bus_auth.new_creds()
    del old["route"]
    bus_auth.write_private(path, json.dumps(old))
    creds = bus_auth.ensure_creds(path)          # an old file: completed, role passwords kept
    assert creds["users"] == old["users"]
    user, password = bus_auth.route_login(creds)
    assert user == bus_auth.ROUTE_USER and len(password) >= 32
    assert bus_auth.ensure_creds(path) == creds  # then stable
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_every_server_gets_the_same_users_and_authenticated_routes():
    creds = bus_auth.new_creds()
    conf = cluster_config(creds, ["nats-0.nats", "nats-1.nats:7222", "10.0.0.3:6222"], name="c1")
    assert conf["authorization"] == bus_auth.server_config(creds)["authorization"]
    assert conf["jetstream"] == "enabled"
    cl = conf["cluster"]
    user, password = bus_auth.route_login(creds)
    assert cl["name"] == "c1" and cl["listen"] == "0.0.0.0:6222"
    assert cl["authorization"]["user"] == user and cl["authorization"]["password"] == password
    assert cl["routes"] == [f"nats-route://{user}:{password}@nats-0.nats:6222",
                            f"nats-route://{user}:{password}@nats-1.nats:7222",
                            f"nats-route://{user}:{password}@10.0.0.3:6222"]
    assert "tls" not in conf and "tls" not in cl


def test_tls_for_clients_and_mutual_tls_for_routes():
    conf = cluster_config(bus_auth.new_creds(), ["a", "b", "c"], tls_cert="/s.pem", tls_key="/s.key",
                          tls_ca="/ca.pem", store_dir="/data", max_file_store="10G", account="TANDEM")
    assert conf["tls"] == {"cert_file": "/s.pem", "key_file": "/s.key", "ca_file": "/ca.pem"}
    assert conf["cluster"]["tls"] == {**conf["tls"], "verify": True}
    assert conf["jetstream"] == {"store_dir": "/data", "max_file_store": "10G"}
    assert "TANDEM" in conf["accounts"] and "authorization" not in conf
    with pytest.raises(ValueError, match="go together"):
        cluster_config(bus_auth.new_creds(), ["a"], tls_cert="/s.pem")


def test_cluster_config_refuses_creds_without_a_route_entry_and_no_routes():
    creds = bus_auth.new_creds()
    with pytest.raises(ValueError, match="route"):
        cluster_config({"users": creds["users"]}, ["a"])
    with pytest.raises(ValueError, match="route addresses"):
        cluster_config(creds, [])


def test_route_url_quotes_the_password():
    assert route_url("h", ("u", "p/w@x")) == "nats-route://u:p%2Fw%40x@h:6222"
    assert route_url("nats-route://h:1", None) == "nats-route://h:1"


@pytest.mark.parametrize("setting, info, want", [
    (0, {}, 1),                                                                     # one server
    (0, {"cluster": "t", "connect_urls": ["a:1", "b:1"]}, 1),                       # two
    (0, {"cluster": "t", "connect_urls": ["a:1", "b:1", "c:1"]}, 3),                # three
    (0, {"cluster": "t", "connect_urls": ["a:1", "b:1", "c:1", "d:1", "e:1"]}, 3),  # five: still 3
    (1, {"cluster": "t", "connect_urls": ["a:1", "b:1", "c:1"]}, 1),                # the setting wins
    (5, {}, 5),
])
def test_replicas_auto_and_set(setting, info, want):
    n, why = replicas_for(setting, info)
    assert n == want and why


def test_replicas_auto_counts_the_configured_servers_while_a_cluster_forms():
    forming = {"cluster": "t", "connect_urls": ["a:1"]}          # routes not all up yet
    assert replicas_for(0, forming, configured=3)[0] == 3
    assert replicas_for(0, {}, configured=3)[0] == 1              # three URLs, but not a cluster


def test_replicas_setting_is_validated():
    assert Settings.from_env({"TANDEM_NATS_REPLICAS": "3"}).nats.replicas == 3
    for bad in ("-1", "7"):
        with pytest.raises(ValueError, match="TANDEM_NATS_REPLICAS"):
            NatsSettings(replicas=int(bad)).validate()


class _NC:
    def __init__(self, info):
        self._server_info = info


async def test_jetstream_ensure_looks_up_creates_with_replicas_and_waits_out_timeouts(caplog):
    bus = Bus(_NC({"cluster": "t", "connect_urls": ["a:1", "b:1", "c:1"]}))
    calls = []

    async def lookup():
        calls.append("lookup")
        if len(calls) < 3:
            raise nats.errors.TimeoutError       # a cluster electing its meta leader answers nothing
        raise nats.js.errors.NotFoundError

    async def create(replicas):
        calls.append(replicas)
        return "made"

    with caplog.at_level(logging.INFO, "shared.bus"):
        assert await bus.jetstream_ensure("stream S", lookup, create, wait=5) == "made"
    assert calls == ["lookup", "lookup", "lookup", 3]
    assert "stream S created with 3 replica(s) (auto: cluster 't', 3 advertised)" in caplog.text
    assert "trying again" in caplog.text

    async def missing():
        raise nats.js.errors.NotFoundError

    tries = []

    async def placed_later(replicas):   # an R3 create while only 2 of 3 servers are up
        tries.append(replicas)
        if len(tries) == 1:
            raise nats.js.errors.APIError(code=500, err_code=10023, description="insufficient resources")
        return "placed"
    assert await bus.jetstream_ensure("stream S", missing, placed_later, wait=5) == "placed"
    assert tries == [3, 3]

    async def refused(replicas):         # any other API error is not waited out
        raise nats.js.errors.APIError(code=400, err_code=10058, description="stream name already in use")
    with pytest.raises(nats.js.errors.APIError):
        await bus.jetstream_ensure("stream S", missing, refused, wait=5)

    async def found():
        return "there"
    assert await bus.jetstream_ensure("stream S", found, create) == "there"   # exists: no create

    async def never():
        raise nats.errors.TimeoutError
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(asyncio.TimeoutError):
        await bus.jetstream_ensure("stream S", never, create, wait=0.5)
    assert asyncio.get_running_loop().time() - t0 < 3


async def test_jetstream_retry_waits_out_a_leader_election(caplog):
    """A consumer's creation right after the meta leader's server died times out until a new
    leader is elected (tests/integration/test_nats_cluster.py once failed there, a new router's
    prefix-index feed): tried again, each attempt a call of its own; other API errors raised."""
    bus = Bus(_NC({}))
    made = []

    async def subscribe():
        made.append(len(made))
        if len(made) < 3:
            raise nats.errors.TimeoutError
        return f"sub {made[-1]}"
    with caplog.at_level(logging.WARNING, "shared.bus"):
        assert await bus.jetstream_retry("consumer C", subscribe, wait=5) == "sub 2"
    assert made == [0, 1, 2] and caplog.text.count("consumer C") == 2

    async def refused():
        raise nats.js.errors.APIError(code=400, err_code=10013, description="consumer name already in use")
    with pytest.raises(nats.js.errors.APIError):
        await bus.jetstream_retry("consumer C", refused, wait=5)


def test_nats_auth_cluster_writes_a_config_nats_server_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_NATS_CREDS_FILE", str(tmp_path / "nats.creds"))
    p = argparse.ArgumentParser()
    nats_auth.add_arguments(p)
    out = tmp_path / "nats.conf"
    args = p.parse_args(["--config", str(out), "--cluster", "nats-0.nats,nats-1.nats,nats-2.nats",
                         "--store-dir", "/data/js", "--max-file-store", "8G"])
    assert nats_auth.main(args) == 0
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    text = out.read_text()
    conf = {k: json.loads(v) for k, v in (line.split(": ", 1) for line in _blocks(text))}
    assert len(conf["cluster"]["routes"]) == 3 and conf["jetstream"]["store_dir"] == "/data/js"
    assert {u["user"] for u in conf["authorization"]["users"]} == {f"tandem-{r}" for r in bus_auth.ROLES}
    check = subprocess.run([str(find_nats_server()), "-c", str(out), "-t"], capture_output=True, text=True)
    assert check.returncode == 0 and "is valid" in check.stdout + check.stderr, check.stderr
    # without --cluster: the single-server block, as before
    args = p.parse_args(["--config", str(out)])
    assert nats_auth.main(args) == 0
    assert out.read_text().startswith("authorization: ") and "cluster" not in out.read_text()
    assert nats_auth.main(p.parse_args(["--config", str(tmp_path)])) == 2   # a directory: one line, exit 2


def _blocks(text: str) -> list[str]:
    """``key: {json}`` blocks of a config nats_auth wrote."""
    blocks, cur = [], ""
    for line in text.splitlines(keepends=True):
        if cur and not line.startswith((" ", "}", "]")):
            blocks.append(cur)
            cur = ""
        cur += line
    return blocks + ([cur] if cur else [])


@pytest.mark.parametrize("argv, said", [
    (["--cluster", "nats-0.nats,http://nats-1.nats"], "no http:// scheme"),
    (["--cluster", "nats-0.nats:99999,nats-1.nats"], "1..65535"),
    (["--cluster", "nats-0.nats,u:pw@nats-1.nats"], "credential"),
    (["--cluster", "nats 0,nats-1"], "no host name"),
    (["--cluster", "a,b", "--cluster-listen", "0.0.0.0"], "needs a port"),
    (["--cluster", "a,b", "--cluster-name", "my cluster"], "without spaces"),
    (["--cluster", "a,b", "--max-file-store", "banana"], "a positive size"),
    (["--cluster", "a,b", "--max-file-store=-5G"], "a positive size"),
    (["--max-file-store", "20G"], "--max-file-store: only with --cluster"),    # was ignored in silence
    (["--cluster", ""], "expected every server's route address"),             # an unset variable: was a
    (["--cluster", "h1,,h3"], "expected every server's route address"),       # single-server config, exit 0
    (["--cluster", "nats-0"], "names one server"),                          # a one-server "cluster", exit 0
    (["--tls-cert", "s.pem", "--tls-key", "k.pem"], "--tls-cert, --tls-key: only with --cluster"),
])
def test_nats_auth_refuses_what_nats_server_would_and_writes_nothing(tmp_path, monkeypatch, caplog, argv, said):
    """A route, listen address, cluster name or store size nats-server refuses at start (or, for
    ``-5G``, takes): one line and exit 2 before anything is written — it wrote such a config and
    exited 0, and nats-server's own complaint about a bad route printed the route password."""
    monkeypatch.setenv("TANDEM_NATS_CREDS_FILE", str(tmp_path / "nats.creds"))
    p = argparse.ArgumentParser()
    nats_auth.add_arguments(p)
    out = tmp_path / "nats.conf"
    assert nats_auth.main(p.parse_args(["--config", str(out), *argv])) == 2
    assert not out.exists() and said in caplog.text


@pytest.mark.parametrize("size, written", [("20GB", "20G"), ("512mib", "512M"), ("1073741824", 1073741824)])
def test_nats_auth_writes_store_sizes_as_nats_server_reads_them(tmp_path, monkeypatch, size, written):
    """``20GB`` in a quoted string is refused by nats-server ("must end in K, M, G, T"): written as ``20G``."""
    monkeypatch.setenv("TANDEM_NATS_CREDS_FILE", str(tmp_path / "nats.creds"))
    p = argparse.ArgumentParser()
    nats_auth.add_arguments(p)
    out = tmp_path / "nats.conf"
    args = p.parse_args(["--config", str(out), "--cluster", "[::1]:7222,nats-route://nats-1:6222",
                         "--max-file-store", size])
    assert nats_auth.main(args) == 0
    conf = {k: json.loads(v) for k, v in (line.split(": ", 1) for line in _blocks(out.read_text()))}
    assert conf["jetstream"]["max_file_store"] == written
    assert [r.rsplit("@", 1)[1] for r in conf["cluster"]["routes"]] == ["[::1]:7222", "nats-1:6222"]
    check = subprocess.run([str(find_nats_server()), "-c", str(out), "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_nats_auth_makes_the_deployment_s_other_secrets_once(tmp_path, monkeypatch, caplog):
    """``--data-key-file`` / ``--pool-key-file`` (compose's nats-auth step, the N-hosts recipe):
    random keys, mode 0600, made once — a second run keeps them. The log names the credentials
    file the configuration is for (it named the last key file, or None)."""
    import os
    monkeypatch.setenv("TANDEM_NATS_CREDS_FILE", str(tmp_path / "nats.creds"))
    p = argparse.ArgumentParser()
    nats_auth.add_arguments(p)
    argv = ["--config", str(tmp_path / "nats.conf"), "--data-key-file", str(tmp_path / "k" / "data.key"),
            "--pool-key-file", str(tmp_path / "p" / "pool.key")]
    with caplog.at_level("INFO", logger="tandem"):
        assert nats_auth.main(p.parse_args(argv)) == 0
    assert f"for the roles of {tmp_path / 'nats.creds'} written to" in caplog.text, caplog.text
    data, pool = (tmp_path / "k" / "data.key").read_text(), (tmp_path / "p" / "pool.key").read_text()
    assert len(data) == len(pool) == 64 and data != pool
    assert os.stat(tmp_path / "k" / "data.key").st_mode & 0o777 == 0o600
    assert nats_auth.main(p.parse_args(argv)) == 0
    assert (tmp_path / "k" / "data.key").read_text() == data and (tmp_path / "p" / "pool.key").read_text() == pool
    assert nats_auth.main(p.parse_args([*argv[:2], "--data-key-file", "/proc/nope/data.key"])) == 2


def test_a_cluster_s_ports_are_all_distinct_even_where_the_picks_repeat(monkeypatch, tmp_path):
    """free_port's picks are free when made, not yet bound: two of a cluster's nine could be the
    same (seen once in CI: a server exited at start-up). ``free_ports`` keeps them distinct."""
    from shared import nats_cluster, nats_server
    picks = iter([18433, 18433, 29305, 18433, 29305, 20001, 20002, 20002, 20003, 20004, 20005, 20006, 20007])
    monkeypatch.setattr(nats_server, "free_port", lambda host="127.0.0.1": next(picks))
    c = nats_cluster.EmbeddedCluster(3, base_dir=tmp_path)
    c._make()
    client = [s.port for s in c.servers]
    monitor = list(c.monitor_ports.values())
    routes = [int(r.rsplit(":", 1)[1]) for r in c.servers[0].config["cluster"]["routes"]]
    assert len(set(client + monitor + routes)) == 9
