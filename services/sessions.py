"""The router's session table, kept in a JetStream KV bucket so that it outlives any router copy
and a NATS restart (the bucket is on the server's JetStream store).

Every change a router makes to a session (its tier, the worker holding its KV, its last request,
the API key's tenant that owns it)
is written to bucket ``tandem_sessions`` under the session id (base64url: any visible ASCII id
becomes a valid key), coalesced per ``flush_s``. A router that starts loads the whole bucket;
router copies also follow each other's decisions live (``tandem.router.decision``), so the
bucket is only read at start. Entries age out after ``max_age`` seconds without a write. Without
JetStream (a plain NATS server) the table lives in memory only, and the router says so.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

import nats.errors
import nats.js.errors
import orjson
from nats.js import api

from services.placement import SessionView
from shared.bus import Bus

log = logging.getLogger("tandem.router.sessions")

BUCKET = "tandem_sessions"
READ_TRIES = 4   # tries of one entry at start (0.5, 1, 2 s apart: a cluster electing leaders)


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

    async def start(self) -> dict[str, SessionView]:
        """Open (or create) the bucket and return the sessions it holds, with ``last`` on this
        process's monotonic clock."""
        js = self.bus.nc.jetstream()
        try:
            self.kv = await self.bus.jetstream_ensure(
                f"KV bucket {self.bucket}", lambda: js.key_value(self.bucket), lambda replicas: js.create_key_value(
                    bucket=self.bucket, history=1, ttl=self.max_age, storage=api.StorageType.FILE,
                    replicas=replicas))
            keys = await self.bus.kv_keys(self.bucket)
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            log.warning("no JetStream for the session table (%s): sessions live in this router's memory only", e)
            self.kv = None
            return {}
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
        self._task = asyncio.create_task(self._flusher(), name="sessions-flush")
        log.info("session table: %d session(s) restored from JetStream", len(out))
        return out

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
        """Record a change; written within ``flush_s``."""
        if self.kv is not None:
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
