"""The router's session table, kept in a JetStream KV bucket so that it outlives any router copy
and a NATS restart (the bucket is on the server's JetStream store).

Every change a router makes to a session (its tier, the worker holding its KV, its last request,
the API key's tenant that owns it)
is written to bucket ``tandem_sessions`` under the session id (base64url: any visible ASCII id
becomes a valid key), coalesced per ``flush_s``. A router that starts loads the whole bucket;
router copies also follow each other's decisions live (``tandem.router.decision``), so the
bucket is only read at start. Entries age out after ``max_age`` seconds without a write. Without
JetStream at start (a plain NATS server, a cluster that has not formed) the table lives in memory,
the router says so and opens the bucket again every ``REOPEN_S`` (doubling to ``REOPEN_MAX_S``):
once it answers, the sessions it holds that this router does not know are restored and this
router's are written.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
import orjson
from nats.js import api

from services.placement import SessionView
from shared.bus import Bus

log = logging.getLogger("tandem.router.sessions")

BUCKET = "tandem_sessions"
READ_TRIES = 4   # tries of one entry at start (0.5, 1, 2 s apart: a cluster electing leaders)
REOPEN_S, REOPEN_MAX_S = 2.0, 30.0   # without JetStream at start: the bucket tried again this often


def _key(session_id: str) -> str:
    return base64.urlsafe_b64encode(session_id.encode()).decode().rstrip("=") or "_"


def _session_id(key: str) -> str:
    return base64.urlsafe_b64decode(key + "=" * (-len(key) % 4)).decode()


class SessionStore:
    def __init__(self, bus: Bus, bucket: str = BUCKET, flush_s: float = 0.5, max_age: float = 86400.0):
        self.bus, self.bucket, self.flush_s, self.max_age = bus, bucket, flush_s, max_age
        self.kv = None                                  # the JetStream KV bucket (None: memory only)
        self._dirty: dict[str, SessionView] = {}
        self._task: asyncio.Task | None = None

    async def start(self, on_opened: Callable[[dict[str, SessionView]], None] | None = None
                    ) -> dict[str, SessionView]:
        """Open (or create) the bucket and return the sessions it holds, with ``last`` on this
        process's monotonic clock. Without JetStream: {} now, and the bucket tried again in the
        background until it answers — then ``on_opened`` gets the sessions it held."""
        if self._task is not None:          # (started again: the last start's task is done with)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            out = await self._open()
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            log.warning("no JetStream for the session table (%s): sessions live in this router's memory until "
                        "it answers (tried again every %g-%g s)", e, REOPEN_S, REOPEN_MAX_S)
            self.kv = None
            self._task = asyncio.create_task(self._reopen(on_opened), name="sessions-reopen")
            return {}
        self._task = asyncio.create_task(self._flusher(), name="sessions-flush")
        log.info("session table: %d session(s) restored from JetStream", len(out))
        return out

    async def _open(self) -> dict[str, SessionView]:
        js = self.bus.nc.jetstream()
        kv = await self.bus.jetstream_ensure(
            f"KV bucket {self.bucket}", lambda: js.key_value(self.bucket), lambda replicas: js.create_key_value(
                bucket=self.bucket, history=1, ttl=self.max_age, storage=api.StorageType.FILE,
                replicas=replicas))
        keys = await self.bus.kv_keys(self.bucket)
        self.kv = kv
        out: dict[str, SessionView] = {}
        now_mono, now_wall = time.monotonic(), time.time()
        for k in keys:
            try:
                d = orjson.loads((await self._read(k)).value)
                out[_session_id(k)] = SessionView(d.get("tier"), d.get("worker"), now_mono - (now_wall - d["last"]),
                                                  d.get("owner"))
            except (nats.js.errors.KeyNotFoundError, KeyError, ValueError, orjson.JSONDecodeError) as e:
                log.warning("session entry %s unreadable (%s): skipped", k, e)
            except (nats.errors.Error, asyncio.TimeoutError) as e:   # JetStream still without a leader
                log.warning("session entry %s not read (%s, %d tries): skipped", k, e, READ_TRIES)
        return out

    async def _reopen(self, on_opened) -> None:
        """The bucket tried again until JetStream answers; then the flusher (this task goes on as it)."""
        delay = REOPEN_S
        while True:
            await asyncio.sleep(delay)
            try:
                out = await self._open()
                break
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                self.kv = None
                delay = min(2 * delay, REOPEN_MAX_S)
                log.debug("session table: JetStream still not answering (%s)", e)
                stale = time.monotonic() - self.max_age        # (what the bucket would have aged out)
                self._dirty = {sid: v for sid, v in self._dirty.items() if v.last > stale}
        log.info("session table: JetStream answers now; %d session(s) restored, %d of this router's to write",
                 len(out), len(self._dirty))
        if on_opened is not None:
            on_opened(out)
        await self._flusher()

    async def _read(self, key: str):
        """One entry; again after a JetStream error but "no such key" (a cluster that lost a server
        answers "JetStream system temporarily unavailable" while it elects leaders: a router
        starting then exited with that traceback)."""
        for i in range(READ_TRIES):
            try:
                return await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                raise
            except (nats.errors.Error, asyncio.TimeoutError):
                if i == READ_TRIES - 1:
                    raise
                await asyncio.sleep(0.5 * 2 ** i)

    def changed(self, session_id: str, view: SessionView) -> None:
        """Record a change; written within ``flush_s`` (without JetStream: once it answers)."""
        self._dirty[session_id] = view

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        if self.kv is None or not self._dirty:
            return
        dirty, self._dirty = self._dirty, {}
        now_mono, now_wall = time.monotonic(), time.time()
        for sid, v in dirty.items():
            value = orjson.dumps({"tier": v.tier, "worker": v.worker, "last": now_wall - (now_mono - v.last),
                                  "owner": v.owner})
            try:
                await self.kv.put(_key(sid), value)
            except (nats.errors.Error, asyncio.TimeoutError) as e:  # kept for the next flush
                self._dirty.setdefault(sid, v)
                log.warning("session %s not written to JetStream yet: %s", sid, e)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await asyncio.wait_for(self.flush(), 5)
        except asyncio.TimeoutError:
            log.warning("session table: last changes not written")
