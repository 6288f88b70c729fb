"""``tandem up``: the whole stack on one machine — NATS (embedded unless TANDEM_NATS_URL is set)
and one process per service copy, with prefixed logs; Ctrl-C / SIGTERM stops it all cleanly.

Start order: NATS → KV pool → decode and prefill workers → router → gateway. Shutdown (SIGINT /
SIGTERM only): the gateway first (it drains in-flight requests), then the engine workers (they
finish what they hold and hand their KV write-backs to the pool, TANDEM_POOL_DRAIN_S at most),
then router and KV pool (which stores what it was handed), then NATS.

Supervision: a copy that exits, whatever its code, is restarted with a backoff (0.5 s doubling
to 10 s) under a new worker id; more than 5 exits within 60 s and that copy is given up, loudly,
while the rest keeps serving — but the gateway, NATS, the last router or the last decode copy
given up stops the stack (exit 1): nothing could be served. The embedded nats-server is restarted on the same address with its
JetStream store. Each restart is one log line and ``tandem_restarts_total{service}`` on the
supervisor's own /metrics (its address is in the start-up line).

Topologies on one budget: ``TOPOLOGY_HELP`` below (also in ``tandem up --help``).

OS priorities (``os_priorities``, docs/routing.md): without TANDEM_THREADS each engine role gets
its threads from the core count (the interactive path leaves a core to the gateway, router and
NATS), the engines a bounded OpenMP spin where their threads outnumber the cores, and every
child stays in this process's session (autogroup scheduling shares the CPU equally between
sessions, whatever the nice values); one log line at start says what was applied.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
import time
import urllib.parse
from typing import Callable, Mapping

from shared import bus_auth, metrics, subjects, tracing
from shared.engine.model_files import load_tokenizer
from shared.nats_server import EmbeddedNats, die_with_parent
from shared.os_priority import describe, engine_threads, omp_env
from shared.settings import Settings, env_help, unknown_env

log = logging.getLogger("tandem.up")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=None, help="gateway HTTP port (TANDEM_PORT, default 8000)")
    p.add_argument("--topology", choices=TOPOLOGIES, default=None,
                   help="a named topology on one budget (overrides the per-service counts; see above)")
    p.add_argument("--workers", type=int, default=2, help="--topology: engine processes (default 2)")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="--topology: CPU cores the engines share (default: all of this machine's)")
    p.add_argument("--prefill", type=int, default=1, help="prefill worker copies (default 1)")
    p.add_argument("--gpu-decode", type=int, default=1, help="gpu-decode worker copies (default 1)")
    p.add_argument("--cpu-decode", type=int, default=1, help="cpu-decode worker copies (default 1)")
    p.add_argument("--router", type=int, default=1, help="router copies (default 1)")
    p.add_argument("--kvpool", type=int, default=1, help="KV pool service copies (default 1; 0: no pool, and the workers use none "
                   "unless TANDEM_POOL is set)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (TANDEM_MODEL; default bundled)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (TANDEM_SERVED_MODEL_NAME; "
                   "default the model file's stem, e.g. SmolLM2-135M-Instruct)")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = TOPOLOGY_HELP + "\n\nEvery service it starts reads these (set them for `tandem up`):\n" + env_help()


TOPOLOGIES = ("single", "replicated", "disaggregated", "heterogeneous")
TOPOLOGY_HELP = """\
topologies on one budget (--topology; --workers W engine processes share --cores C: each engine
gets C // W threads, a single engine all C; NATS, router, gateway and KV pool come on top):
  single          one colocated cpu-decode worker (it prefills and decodes), C threads
  replicated      W colocated cpu-decode workers behind a round-robin router
  disaggregated   W // 2 prefill + the rest cpu-decode workers, KV over the data plane
  heterogeneous   one gpu-decode + W - 1 cpu-decode workers, the SLA router (tier -> pool)
without --topology the per-service counts (--prefill ...) apply, with the SLA router"""


def topology(args: argparse.Namespace) -> dict[str, str]:
    """Apply ``--topology``: set the per-service counts on ``args``; the environment every child
    gets (TANDEM_THREADS, TANDEM_ROUTER_POLICY). Empty without a topology."""
    name = args.topology
    if name is None:
        return {}
    w, cores = args.workers, args.cores
    if w < 1 or cores < 1:
        raise ValueError("--workers and --cores must be >= 1")
    if name in ("disaggregated", "heterogeneous") and w < 2:
        raise ValueError(f"--topology {name} needs --workers >= 2")
    counts = {"single": (0, 0, 1), "replicated": (0, 0, w), "disaggregated": (w // 2, 0, w - w // 2),
              "heterogeneous": (0, 1, w - 1)}[name]
    args.prefill, args.gpu_decode, args.cpu_decode = counts
    threads = cores if name == "single" else max(1, cores // w)
    return {"TANDEM_THREADS": str(threads), "TANDEM_ROUTER_POLICY": "round-robin" if name == "replicated" else "sla"}


def pool_env(args: argparse.Namespace, environ) -> dict[str, str]:
    """``--kvpool 0`` means no pool: the workers are told (TANDEM_POOL=0) unless the environment
    says otherwise (a pool elsewhere on a shared bus), so they neither look prefixes up in a pool
    nobody answers for nor copy out a finished request's KV to write back (~23 KB a token of the
    bundled model, on the engine's thread)."""
    return {"TANDEM_POOL": "0"} if getattr(args, "kvpool", 1) == 0 and "TANDEM_POOL" not in environ else {}


def engines(name: str, workers: int) -> dict[str, int]:
    """Engine processes per role of topology ``name`` with ``workers`` engines (bench, tests)."""
    args = argparse.Namespace(topology=name, workers=workers, cores=1)
    topology(args)
    counts = {"prefill": args.prefill, "gpu-decode": args.gpu_decode, "cpu-decode": args.cpu_decode}
    return {role: n for role, n in counts.items() if n}


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, service) for every child process, in start order."""
    out = []
    for service, n in (("kvpool", getattr(args, "kvpool", 0)), ("cpu-decode", args.cpu_decode),
                       ("gpu-decode", args.gpu_decode), ("prefill", args.prefill), ("router", args.router)):
        if n < 0:
            raise ValueError(f"--{service} must be >= 0")
        out += [(f"{service}-{i + 1}" if n > 1 else service, service) for i in range(n)]
    if args.cpu_decode + args.gpu_decode == 0:
        raise ValueError("at least one decode worker is needed (--cpu-decode or --gpu-decode)")
    if args.router < 1:
        raise ValueError("at least one router is needed")
    return out + [("gateway", "gateway")]


def os_priorities(args: argparse.Namespace, env: dict[str, str]) -> tuple[dict[str, dict[str, str]], str]:
    """What ``tandem up`` applies for the OS priorities (shared/os_priority.py): the environment
    each engine role gets on top of ``env`` (its threads when TANDEM_THREADS is unset, the
    OpenMP spin), and the start-up line saying so. The engines start their batch lanes
    themselves (TANDEM_OS_PRIORITY); every child stays in this process's session, as an autogroup
    (Linux's sched_autogroup) shares the CPU equally between sessions whatever the nice values."""
    p = Settings.from_env(env).priority
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    counts = {"prefill": args.prefill, "gpu-decode": args.gpu_decode, "cpu-decode": args.cpu_decode}
    given = int(env.get("TANDEM_THREADS") or 0)
    if given:
        threads, how = dict.fromkeys(counts, given), "TANDEM_THREADS"
    elif p.role_threads:
        threads, how = {role: engine_threads(role, cores) for role in counts}, "per role"
    else:
        threads, how = dict.fromkeys(counts, cores), "torch's default"
    total = sum(threads[role] * n for role, n in counts.items())
    omp, spin = omp_env(p.omp_spin, total, cores, env)
    extra = {role: dict(omp, **({"TANDEM_THREADS": str(threads[role])} if how == "per role" else {}))
             for role in counts}
    lane = (f"batch-only steps at {describe(p.batch_nice, p.batch_sched)}" if p.enabled
            else "every step at normal priority (TANDEM_OS_PRIORITY off)")
    line = (f"OS priorities on {cores} core(s): engine threads ({how}) "
            + ", ".join(f"{role} {threads[role]}" for role, n in counts.items() if n)
            + f" ({total} in all); OpenMP wait: {spin}; {lane}; gateway, router, NATS at normal priority")
    return extra, line


_METRICS_LINE = re.compile(rb"metrics on http://\S+:(\d+)/metrics")   # shared/metrics.py ``serve_http``'s


def _bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not bind ``host:port`` now (0: any port), or None where it could — with
    address reuse on, as the metrics server (http.server) and the others bind."""
    try:
        socket.create_server((host, port)).close()
        return None
    except OSError as e:
        return e


async def _pump(name: str, stream: asyncio.StreamReader, seen: Callable[[bytes], None] | None = None) -> None:
    width = 12
    while line := await stream.readline():
        if seen is not None:
            seen(line)
        sys.stderr.write(f"{name:<{width}}| {line.decode(errors='replace')}")
        sys.stderr.flush()


RESTART_LIMIT = 5         # restarts of one copy within RESTART_WINDOW_S before it is given up
RESTART_WINDOW_S = 60.0
BACKOFF_S = (0.5, 10.0)   # first and longest wait before a restart (doubling in between)
ESSENTIAL = ((subjects.ROUTER,), subjects.DECODE_ROLES)   # the last copy of either given up: nothing is served
STOP_ORDER = ("gateway", "prefill", "gpu-decode", "cpu-decode", "router", "kvpool")  # see the module doc


class Child:
    """One service copy under supervision: started, restarted when it exits (with backoff and a
    crash-loop limit), stopped on request. Each start gets a new worker id (``<name>-<pid>-<n>``),
    so messages from a dead incarnation are never taken for the new one's."""

    def __init__(self, name: str, service: str, env: dict[str, str]):
        self.name, self.service, self.env = name, service, env
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0
        self.exits: list[float] = []          # monotonic times of unexpected exits
        self.stopping = False
        self.fatal = False                    # given up, and the stack cannot serve without it
        self.given_up = False
        self.left: Callable[[tuple[str, ...]], bool] = lambda services: True   # a copy of one of these services
                                                                               # is not given up (set by _up)
        self.wake = asyncio.Event()           # set by stop(): cut a backoff short
        self.metrics_port: int | None = None  # the port its first incarnation's /metrics bound (its log says)

    def _saw(self, line: bytes) -> None:
        if self.metrics_port is None and (m := _METRICS_LINE.search(line)):
            self.metrics_port = int(m.group(1))

    def _env(self, wid: str) -> dict[str, str]:
        """The environment of the next incarnation. A restart keeps the /metrics port the first one
        bound (a free one, TANDEM_METRICS_PORT=0): a scraper's target stays put — unless another
        process took the port meanwhile (then a free one again, said here)."""
        env = dict(self.env, TANDEM_WORKER_ID=wid)
        if self.metrics_port is not None and self.env.get("TANDEM_METRICS_PORT", "0") == "0":
            if _bind_error(self.env.get("TANDEM_METRICS_HOST", "127.0.0.1"), self.metrics_port) is None:
                env["TANDEM_METRICS_PORT"] = str(self.metrics_port)
            else:
                log.warning("%s: its metrics port %d is taken now; this copy takes a free one", self.name,
                            self.metrics_port)
                self.metrics_port = None
        return env

    async def start(self) -> None:
        wid = f"{self.name}-{os.getpid()}" + (f"-{self.starts}" if self.starts else "")
        self.starts += 1
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "serve", self.service, env=self._env(wid),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            process_group=0, preexec_fn=die_with_parent)
        self.pump = asyncio.create_task(_pump(self.name, self.proc.stdout, self._saw))

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restart the copy whenever it exits, until stop() or the crash-loop limit. A copy that
        exits once the stack is stopping is not restarted (a SIGTERM that reached every process
        at once, as systemd sends it, ends each copy before its turn in STOP_ORDER)."""
        while True:
            code = await self.proc.wait()
            await asyncio.gather(self.pump, return_exceptions=True)
            if self.stopping or stop.is_set():
                return
            now = time.monotonic()
            self.exits = [t for t in self.exits if now - t < RESTART_WINDOW_S] + [now]
            if len(self.exits) > RESTART_LIMIT:
                metrics.GIVEN_UP.labels(self.service).inc()
                if self.service == "gateway":   # nothing reaches the stack without it: stop, exit 1
                    log.error("!!! %s exited with code %s, its %d%s exit in %.0f s: GIVING UP on it, and with no "
                              "gateway the stack serves nothing: stopping it", self.name, code, len(self.exits),
                              _nth(len(self.exits)), RESTART_WINDOW_S)
                    self.fatal = True
                    stop.set()
                    return
                self.given_up = True
                needed = next((kind for kind in ESSENTIAL if self.service in kind), ())
                if needed and not self.left(needed):
                    # no router, or no decode copy of any kind, left: every request would wait, then fail
                    log.error("!!! %s exited with code %s, its %d%s exit in %.0f s: GIVING UP on it, and with "
                              "every %s copy given up the stack serves nothing: stopping it (its log above says "
                              "why)", self.name, code, len(self.exits), _nth(len(self.exits)), RESTART_WINDOW_S,
                              " or ".join(needed))
                    self.fatal = True
                    stop.set()
                    return
                log.error("!!! %s exited with code %s, its %d%s exit in %.0f s: GIVING UP on this copy; the "
                          "rest of the stack keeps serving", self.name, code, len(self.exits),
                          _nth(len(self.exits)), RESTART_WINDOW_S)
                return
            wait = backoff(len(self.exits))
            metrics.RESTARTS.labels(self.service).inc()
            log.warning("%s exited with code %s; restarting in %.1f s (restart %d in %.0f s)", self.name, code, wait,
                        len(self.exits), RESTART_WINDOW_S)
            try:
                await asyncio.wait_for(self.wake.wait(), wait)
            except asyncio.TimeoutError:
                pass
            if self.stopping or stop.is_set():
                return
            await self.start()

    def kill(self) -> None:
        """SIGKILL now (a second Ctrl-C): no drain, no hand-over."""
        self.stopping = True
        self.wake.set()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    async def stop(self, timeout: float) -> None:
        self.stopping = True
        self.wake.set()
        p = self.proc
        if p is None or p.returncode is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(p.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("%s did not stop in %.0f s; killing it", self.name, timeout)
            p.kill()
            await p.wait()


def backoff(restarts: int) -> float:
    """Seconds to wait before restart number ``restarts`` (1, 2, ...) within the window: the first
    of ``BACKOFF_S``, doubling, at most the second."""
    return min(BACKOFF_S[0] * 2 ** (restarts - 1), BACKOFF_S[1])


def _nth(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


async def _watch_nats(nats: EmbeddedNats, stop: asyncio.Event, fatal: list[str]) -> None:
    """The embedded nats-server is supervised too: restarted on the same address with its
    JetStream store, so every service reconnects to it and streams and buckets survive."""
    failures: list[float] = []
    while not stop.is_set():
        await asyncio.sleep(0.2)
        code = nats.exited()
        if code is None or stop.is_set():
            continue
        now = time.monotonic()
        failures = [t for t in failures if now - t < RESTART_WINDOW_S] + [now]
        metrics.RESTARTS.labels("nats").inc()
        log.warning("embedded nats-server exited with code %s; restarting it on %s", code, nats.url)
        try:
            await asyncio.to_thread(nats.restart)
            log.info("embedded nats-server back on %s", nats.url)
        except Exception as e:
            log.error("embedded nats-server did not restart: %s", e)
            if len(failures) > RESTART_LIMIT:
                metrics.GIVEN_UP.labels("nats").inc()
                log.error("!!! GIVING UP on the embedded nats-server: no service can talk to another; stopping the "
                          "stack")
                fatal.append("nats")
                stop.set()
                return
            await asyncio.sleep(backoff(len(failures)))


def embedded_nats(env: dict[str, str]) -> EmbeddedNats:
    """The embedded nats-server: it accepts only the role users of TANDEM_NATS_CREDS_FILE (created
    when missing), each with its role's permissions (shared/bus_auth.py); every child logs in
    with its role's entry. TANDEM_NATS_CREDS_FILE empty: no authentication, loudly."""
    s = Settings.from_env(env).nats
    if s.user is not None or s.token is not None:
        raise ValueError("TANDEM_NATS_USER / TANDEM_NATS_TOKEN are credentials of an external NATS server "
                         "(set TANDEM_NATS_URL too); the embedded one uses TANDEM_NATS_CREDS_FILE")
    config = None
    if s.creds_file:
        config = bus_auth.server_config(bus_auth.ensure_creds(s.creds_file))
        log.info("embedded NATS accepts only the role credentials in %s", s.creds_file)
    else:
        log.warning("!!! TANDEM_NATS_CREDS_FILE is empty: the embedded NATS server has NO AUTHENTICATION; "
                    "anyone who reaches its port reads every prompt and can inject tokens")
    return EmbeddedNats(store_dir=s.store_dir, config=config, supervised=True)


def _reachable(url: str, timeout: float) -> bool:
    """A TCP connection to the NATS server of ``url`` (nats://, tls://; port 4222 unless given) opens."""
    u = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    try:
        socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def _bindable(host: str, what: str) -> None:
    """``host`` (a TANDEM_*_HOST) is an address of this machine a server can bind: ValueError naming ``what``."""
    if (err := _bind_error(host, 0)) is not None:
        raise ValueError(f"{what}={host} cannot be bound ({err.strerror or err}): an address of this machine, "
                         "e.g. 127.0.0.1 or 0.0.0.0")


def preflight(settings: Settings, pool: bool = True, metrics_servers: int = 1,
              data_servers: int = 1, ring_servers: int = 1) -> None:
    """What would make every copy of a service fail the same way, checked before anything starts
    (ValueError naming it: one clear line and exit 2, not five tracebacks a copy and a stack that
    serves nothing): the model's file, the gateway's port, the pool secret and the data-plane key
    (their files made when missing, and readable), and (``pool``: a kvpool copy runs) the pool's
    directories — made as the pool makes them, and writable; a fixed TANDEM_METRICS_PORT,
    TANDEM_DATA_PORT or TANDEM_RING_PORT, which only one of the processes that serve them
    (``metrics_servers``, ``data_servers``, ``ring_servers``) could bind, and the hosts they bind;
    the embedded NATS server's store directory; and the NATS server TANDEM_NATS_URL names, when it
    names one (every copy would crash-loop on it)."""
    load_tokenizer(settings.worker.model)   # its header, tensor list and tokenizer: a complete GGUF, or a clear error
    cfg = settings.pool.pool_config() if pool else None
    for name, where in (("TANDEM_POOL_DIR", cfg and cfg.disk_dir), ("TANDEM_POOL_SHARED_DIR", cfg and cfg.shared_dir)):
        if not where:
            continue
        try:
            os.makedirs(where, mode=0o700, exist_ok=True)
            if not os.access(where, os.W_OK | os.X_OK):
                raise PermissionError(f"not writable by this user ({os.getuid()})")
        except OSError as e:
            raise ValueError(f"the KV pool's directory {name}={where} cannot be used ({e.strerror or e}): "
                             f"set another (empty: no such tier), or --kvpool 0") from None
    if settings.nats.servers() and not any(_reachable(url, settings.nats.connect_timeout)
                                           for url in settings.nats.servers()):
        raise ValueError(f"no NATS server answers at TANDEM_NATS_URL={settings.nats.url}: start it (or unset "
                         "TANDEM_NATS_URL: `tandem up` then starts an embedded one)")
    for var, port, servers in (("TANDEM_METRICS_PORT", settings.worker.metrics_port, metrics_servers),
                               ("TANDEM_DATA_PORT", settings.data.port, data_servers),
                               ("TANDEM_RING_PORT", settings.data.ring_port, ring_servers)):
        if port > 0 and servers > 1:
            raise ValueError(f"{var}={port} is one port, but {servers} processes of this stack would bind it: "
                             "leave it 0 (each a free port, said in its log and heartbeats); a fixed port is for "
                             "one service a container (`tandem serve`)")
    if settings.worker.metrics_port >= 0:
        _bindable(settings.worker.metrics_host, "TANDEM_METRICS_HOST")
    _bindable(settings.data.host, "TANDEM_DATA_HOST")
    store = settings.nats.store_dir
    if store and not settings.nats.servers() and os.path.exists(os.path.expanduser(store)) \
            and not os.path.isdir(os.path.expanduser(store)):
        raise ValueError(f"TANDEM_NATS_STORE_DIR={store} is not a directory: name one (made when missing)")
    for what, keyed in (("pool secret", settings.pool), ("data-plane key", settings.data)):
        if not keyed.key:
            bus_auth.key_file(keyed.key_file, what)
        keyed.secret()   # a file that cannot be read: ValueError naming it
    if os.environ.get(tracing.OTLP_ENV):
        tracing.check_exporter()
    host, port = settings.gateway.host, settings.gateway.port
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        raise ValueError(f"the gateway's port {host}:{port} cannot be used ({e.strerror or e}): another "
                         "server has it? (--port / TANDEM_PORT)") from None


def stack_env(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of every copy: ``environ`` with the command line's settings, less the
    ``TANDEM_*`` names nothing reads (said once by services/cli.py, not again by every copy)."""
    chosen = topology(args)
    for name, value in chosen.items():   # the topology decides these: say so where the user set another
        if environ.get(name, value) != value:
            log.warning("--topology %s sets %s=%s (the environment's %r is not used)", args.topology, name, value,
                        environ[name])
    env = dict(environ, **chosen, **pool_env(args, environ))
    if args.port is not None:           # --port 0 is refused by the settings, not taken for unset
        env["TANDEM_PORT"] = str(args.port)
    if args.model:
        env["TANDEM_MODEL"] = args.model
    if args.served_model_name:
        env["TANDEM_SERVED_MODEL_NAME"] = args.served_model_name
    for name in unknown_env(env):
        del env[name]
    return env


async def _up(args: argparse.Namespace) -> int:
    Settings.from_env(os.environ)       # what the user set, checked as set (a topology may replace some)
    env = stack_env(args, os.environ)
    settings = Settings.from_env(env)   # every setting checked before anything starts
    services = [service for _, service in plan(args)]
    await asyncio.to_thread(preflight, settings, "kvpool" in services,
                            sum(service != "gateway" for service in services),   # the gateway's are on its port
                            sum(service in ("prefill", *subjects.DECODE_ROLES, "kvpool") for service in services),
                            services.count(subjects.CPU_DECODE))
    nats = None
    if not env.get("TANDEM_NATS_URL"):
        nats = embedded_nats(env)
        env["TANDEM_NATS_URL"] = await asyncio.to_thread(nats.start)
        log.info("embedded NATS (JetStream) at %s", env["TANDEM_NATS_URL"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    children: list[Child] = []
    drain_s = settings.gateway.drain_s

    def signalled(sig: signal.Signals) -> None:
        """The first SIGINT / SIGTERM stops the stack in order, draining; a second Ctrl-C (SIGINT)
        stops it now. A second SIGTERM changes nothing (a process manager or a script that sends
        it twice means "stop", and has SIGKILL for "now"; forced, it lost the KV write-backs the
        workers drain into the pool)."""
        if not stop.is_set():
            log.info("%s: stopping — the gateway drains its streams (up to %.0f s, TANDEM_DRAIN_S), then the "
                     "engines, router and pool, NATS last; Ctrl-C again stops everything at once", sig.name,
                     drain_s)
            stop.set()
        elif sig == signal.SIGINT:
            log.warning("SIGINT again: stopping at once (streams still going are cut)")
            for c in children:
                c.kill()
        else:
            log.info("%s again: already stopping, in order (Ctrl-C or SIGKILL stops at once)", sig.name)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled, sig)
    # the supervisor's own /metrics (restarts, given-up copies), off with the services' (-1)
    port = metrics.serve_http(0, "127.0.0.1") if settings.worker.metrics_port >= 0 else None
    extra, priorities = os_priorities(args, env)
    log.info("%s", priorities)
    children += [Child(name, service, dict(env, **extra.get(service, {}))) for name, service in plan(args)]
    for c in children:
        c.left = lambda services: any(d.service in services and not d.given_up for d in children)
    tasks, fatal = [], []   # fatal: what was given up that the stack cannot serve without
    try:
        for c in children:
            await c.start()
        tasks = [asyncio.create_task(c.supervise(stop), name=f"supervise-{c.name}") for c in children]
        if nats is not None:
            tasks.append(asyncio.create_task(_watch_nats(nats, stop, fatal), name="supervise-nats"))
        log.info("started %s%s; gateway on port %s; %s", ", ".join(c.name for c in children),
                 f" (topology {args.topology}, {env['TANDEM_THREADS']} thread(s) per engine)" if args.topology else "",
                 env.get("TANDEM_PORT", "8000"),
                 f"supervisor metrics on http://127.0.0.1:{port}/metrics" if port else "no metrics (TANDEM_METRICS_PORT=-1)")
        await stop.wait()
        return 1 if fatal or any(c.fatal for c in children) else 0
    finally:
        # gateway first (drains HTTP), then the engines (finish or hand over what they hold, write
        # KV back to the pool), then router and pool, then NATS
        for service in STOP_ORDER:
            await asyncio.gather(*(c.stop(40) for c in children if c.service == service))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if nats is not None:
            await asyncio.to_thread(nats.stop)
        log.info("stack stopped")


def main(args: argparse.Namespace) -> int:
    try:
        topology(args)
        plan(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    try:
        return asyncio.run(_up(args))
    except ValueError as e:  # bad settings (each checked before anything starts)
        log.error("%s", e)
        return 2
