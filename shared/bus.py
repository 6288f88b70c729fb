"""Bus: a thin wrapper over nats-py speaking shared.schemas messages.

    bus = await Bus.connect(settings.nats, name="router-1")
    await bus.serve(subjects.ROUTE, handle_route, queue=subjects.ROUTE_QUEUE, expected=RouteRequest)
    plan = await bus.request(subjects.ROUTE, RouteRequest(...), timeout=2.0, expected=RoutePlan)
    async with await bus.subscribe(subjects.stream(rid), expected=StreamChunk) as chunks:
        await bus.request(subjects.worker_prefill(w), PrefillRequest(...))
        async for chunk in chunks: ...
    bus.start_heartbeat(subjects.heartbeat(role, wid), make_heartbeat, interval=2.0)
    await bus.close()                        # stops heartbeats, finishes handlers, drains

Error envelope: a handler that raises answers with an ``ErrorReply`` (never silence) and the
exception is logged. ``BusError(code, message)`` keeps its code; ValueError (SchemaError
included) -> ``bad_request``; TimeoutError -> ``timeout``; anything else -> ``internal``.
A requester receiving an ErrorReply raises ``RemoteError`` with the same code; no responder ->
``BusError("unavailable")``; no reply in time -> ``BusError("timeout")``.

Trace context: every message sent while a request's context is current (shared/tracing.py)
carries ``traceparent`` and ``Tandem-Request-Id`` NATS headers; a handler runs with the
context of the message it handles, inside one span per hop when span export is on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import ssl
import time
from typing import Any, Awaitable, Callable

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from shared import bus_auth, nats_cluster, schemas, tracing
from shared.logs import sparse
from shared.schemas import ERROR_STATUS, Ack, ErrorReply, SchemaError
from shared.settings import PINGS_OUTSTANDING, NatsSettings, Settings

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[Any]]
_CONNECT_ATTEMPTS = 3  # per server, before Bus.connect gives up
RECONNECT_TIMEOUT_S = 2.0  # a reconnect's wait for a server's INFO (the first connect: TANDEM_NATS_CONNECT_TIMEOUT)


SUBJECTS_PAGE = 100_000   # subjects one STREAM.INFO answer lists at most (the server pages past it)
REPLY_PREFIX = bus_auth.INBOX + "."   # every request's reply subject (a role's inbox, or nats-py's default)
_refusals: dict[str, float] = {}   # subject served -> when a refused reply subject was last logged


def _refused_reply(subject: str, reply: str) -> None:
    """Log (at most once a minute a served subject) a request whose reply subject is no inbox."""
    now = time.monotonic()
    if now - _refusals.get(subject, -60.0) >= 60.0:
        _refusals[subject] = now
        log.warning("ignoring a request on %s whose reply subject %r is no inbox (a peer directing the answer "
                    "at another's subject); more in the next minute are not logged", subject, reply[:120])


def _placement(e: Exception) -> bool:
    """A JetStream API error that a forming cluster gives: too few servers up for the replicas."""
    text = f"{getattr(e, 'description', '')} {e}".lower()
    return getattr(e, "err_code", None) in (10005, 10023) or "insufficient resources" in text \
        or "no suitable peers" in text


class BusError(Exception):
    """An error with a wire code (a key of schemas.ERROR_STATUS); handlers raise it on purpose."""

    def __init__(self, code: str, message: str, retry_after: float = 0.0, lost: str = "", sender_ok: bool = False,
                 param: str = ""):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.param = param               # the request field at fault (ErrorReply.param)
        self.retry_after = retry_after   # "overloaded": seconds until a retry may succeed
        self.lost = lost                 # a stream's error: the worker found gone (ErrorReply.lost)
        self.sender_ok = sender_ok       # ... or nobody: a live peer's answer failed it (ErrorReply.sender_ok)

    @property
    def status(self) -> int:
        return ERROR_STATUS.get(self.code, 500)


class RemoteError(BusError):
    """The remote handler answered with an ErrorReply."""

    def __init__(self, code: str, message: str, status: int | None = None, request_id: str = "",
                 retry_after: float = 0.0, lost: str = "", param: str = ""):
        super().__init__(code, message, retry_after, lost=lost, param=param)
        self.remote_status = status if status is not None else ERROR_STATUS.get(code, 500)
        self.request_id = request_id

    @property
    def status(self) -> int:
        return self.remote_status

    @classmethod
    def from_reply(cls, reply: ErrorReply) -> "RemoteError":
        return cls(reply.code, reply.message, reply.status, reply.request_id, reply.retry_after, reply.lost,
                   reply.param)


def error_reply_for(exc: BaseException, request_id: str = "") -> ErrorReply:
    """The ErrorReply an exception becomes (the coded error envelope)."""
    if isinstance(exc, BusError):
        return ErrorReply(exc.code, exc.message, exc.status, request_id, exc.retry_after, lost=exc.lost,
                          sender_ok=exc.sender_ok, param=exc.param)
    if isinstance(exc, ValueError):
        return ErrorReply.of("bad_request", str(exc), request_id)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return ErrorReply.of("timeout", str(exc) or "timed out", request_id)
    return ErrorReply.of("internal", f"{type(exc).__name__}: {exc}", request_id)


def ssl_context(s: NatsSettings) -> ssl.SSLContext | None:
    """A client TLS context from settings, or None when TLS is off."""
    if not s.use_tls:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=s.tls_ca)
    if s.tls_cert:
        ctx.load_cert_chain(s.tls_cert, s.tls_key)
    return ctx


_END = object()  # Subscription._read: the subscription ended


class Subscription:
    """Decoded messages of one subject, in arrival order; an async iterator and context manager."""

    def __init__(self, sub, expected: type | None, skip_invalid: bool):
        self._sub = sub                  # nats-py Subscription
        self._expected = expected        # message class to enforce (None: any registered)
        self._skip_invalid = skip_invalid  # log and skip bad messages instead of raising
        self.skipped = 0                   # ... how many so far, the last one's error and time
        self.last_skipped, self.last_skipped_at = "", 0.0
        self._it = sub.messages.__aiter__()
        self._next: asyncio.Future | None = None  # a read still under way when ``next`` timed out

    @property
    def subject(self) -> str:
        return self._sub.subject

    def __aiter__(self) -> "Subscription":
        return self

    async def _read(self) -> Any:
        while True:
            try:
                msg = await self._it.__anext__()
            except StopAsyncIteration:  # unsubscribed, or the connection closed: the end, not an error
                return _END
            try:
                return schemas.decode(msg.data, self._expected)
            except SchemaError as e:
                if not self._skip_invalid:
                    raise
                self.skipped += 1          # a peer of another release sends one a beat: not a line each
                self.last_skipped, self.last_skipped_at = f"{msg.subject}: {e}", time.monotonic()
                sparse(log, self.skipped)("skipping invalid message on %s: %s (%d so far)", msg.subject, e,
                                          self.skipped)

    async def __anext__(self) -> Any:
        return await self.next()

    async def next(self, timeout: float | None = None) -> Any:
        """The next message; BusError("timeout") after ``timeout`` seconds. A timeout never loses a
        message: the read goes on and the next call gets its result. (Cancelling nats-py's
        iterator instead drops a message it took from the queue in the same instant: a stream
        chunk lost once in thousands under load, the gateway then resumed a healthy request.)"""
        if self._next is None:
            self._next = asyncio.ensure_future(self._read())
            # a read left pending by a timeout may fail with nobody waiting: mark its error seen
            # (the next call still raises it) so asyncio does not log it at shutdown
            self._next.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, _ = await asyncio.wait({self._next}, timeout=timeout)
        if not done:
            raise BusError("timeout", f"no message on {self.subject} within {timeout}s")
        fut, self._next = self._next, None
        msg = fut.result()
        if msg is _END:
            raise StopAsyncIteration
        return msg

    async def unsubscribe(self) -> None:
        if self._next is not None and not self._next.done():
            self._next.cancel()
        try:
            await self._sub.unsubscribe()
        except nats.errors.BadSubscriptionError:
            pass  # already gone (connection drained or closed)

    async def __aenter__(self) -> "Subscription":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.unsubscribe()


class Bus:
    """One NATS connection plus the tasks it runs (handlers, heartbeats)."""

    def __init__(self, nc: NatsClient | None, request_timeout: float = 10.0):
        self.nc = nc                              # the nats-py client (JetStream: nc.jetstream())
        self.request_timeout = request_timeout    # default for request()
        self._tasks: set[asyncio.Task] = set()    # in-flight handler calls
        self._heartbeats: set[asyncio.Task] = set()
        self._subs: list = []                     # serve() subscriptions
        self._closing = False                     # close() called: disconnects are expected
        self.connected_since: float | None = None  # monotonic time of the last (re)connect; None: down
        self.down_since: float | None = None      # monotonic time the connection was lost; None: up
        self.replicas_setting = 0                 # TANDEM_NATS_REPLICAS (0: auto, see stream_replicas)
        self.jetstream_wait = 60.0                # seconds jetstream_ensure waits for JetStream to answer
        self.configured_servers = 0               # the servers TANDEM_NATS_URL lists
        self.refused_login = False                # the server said "Authorization Violation"
        self._refused = asyncio.Event()           # ... _CONNECT_ATTEMPTS times before a first connect
        self._refusals = 0
        self._errors = 0                          # errors since the connection was last (re)made

    # -- connection ---------------------------------------------------------------------------

    @classmethod
    async def connect(cls, settings: Settings | NatsSettings | None = None, *, url: str | None = None,
                      name: str | None = None, role: str | None = None) -> "Bus":
        """Connect with settings (url, credentials, TLS); reconnects forever once connected.

        ``role`` (a service name, or ``tap``; shared/bus_auth.py): without TANDEM_NATS_USER or
        TOKEN, log in as that role with its entry of TANDEM_NATS_CREDS_FILE (when there is one),
        and take replies on the role's own inbox prefix. Credentials count at connect time only.
        """
        s = settings.nats if isinstance(settings, Settings) else (settings or NatsSettings())
        servers = [u.strip() for u in url.split(",")] if url else s.servers()
        if not servers:
            raise ValueError("no NATS server: set TANDEM_NATS_URL (or run `tandem up`, which "
                             "starts an embedded one)")
        bus = cls(None, s.request_timeout)
        bus.replicas_setting = s.replicas
        bus.configured_servers = len(servers)
        opts: dict[str, Any] = dict(
            servers=servers, name=name or s.name, connect_timeout=s.connect_timeout,
            # a few tries to connect at all (bad credentials fail fast); forever once connected
            allow_reconnect=True, max_reconnect_attempts=_CONNECT_ATTEMPTS, reconnect_time_wait=0.5,
            # a server that stops answering with its connection open (frozen, its host's network
            # gone) is left after ~PINGS_OUTSTANDING pings for another of the cluster: nats-py's
            # defaults (2 of 120 s) kept every service of that host on it for ~4 minutes
            ping_interval=s.ping_s, max_outstanding_pings=PINGS_OUTSTANDING,
            error_cb=bus._on_error, disconnected_cb=bus._on_disconnected,
            reconnected_cb=bus._on_reconnected,
        )
        if role is not None:
            role = bus_auth.role_of(role)
            opts.update(inbox_prefix=bus_auth.inbox_prefix(role))
        anonymous = ""
        if s.user is not None:
            opts.update(user=s.user, password=s.password)
        elif s.token is not None:
            opts.update(token=s.token)
        elif role is not None and (login := bus_auth.role_login(s.creds_file, role)) is not None:
            opts.update(user=login[0], password=login[1])
        elif role is not None:
            how = (f"TANDEM_NATS_CREDS_FILE ({s.creds_file}) has no entry for role {bus_auth.role_of(role)!r}"
                   if s.creds_file and os.path.exists(os.path.expanduser(s.creds_file)) else
                   f"TANDEM_NATS_CREDS_FILE ({s.creds_file}) does not exist" if s.creds_file else
                   "TANDEM_NATS_CREDS_FILE is empty")
            anonymous = f"no credentials: {how}, TANDEM_NATS_USER and TANDEM_NATS_TOKEN are unset"
            log.info("connecting to NATS with %s", anonymous)
        ctx = ssl_context(s)
        if ctx is not None:
            opts.update(tls=ctx)
        nc = nats.NATS()
        connecting = asyncio.ensure_future(nc.connect(**opts))
        refused = asyncio.ensure_future(bus._refused.wait())
        try:
            await asyncio.wait({connecting, refused}, return_when=asyncio.FIRST_COMPLETED)
            if not connecting.done():
                # refused again and again: nats-py would go on for good, as a cluster's INFO gives
                # back the servers it gave up on (their client URLs)
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
                await nc.close()
                raise ConnectionRefusedError(f"the login was refused {_CONNECT_ATTEMPTS} times")
            connecting.result()
            bus.nc = nc
            bus.nc.options["max_reconnect_attempts"] = -1  # nats-py reads it at each reconnect
            # (so it does this one): a reconnect that picks a frozen server of the pool — its TCP
            # accepted, no INFO — waited the whole connect timeout (5 s) before the next server
            bus.nc.options["connect_timeout"] = min(s.connect_timeout, RECONNECT_TIMEOUT_S)
            bus.connected_since = time.monotonic()
        except Exception as e:
            hint = (f" (the server refused this login: {anonymous})" if anonymous and bus.refused_login
                    else " (the server refused this login: wrong credentials)" if bus.refused_login else "")
            raise BusError("unavailable", f"cannot connect to NATS at {', '.join(servers)}: "
                           f"{type(e).__name__}: {e}{hint}") from e
        finally:
            refused.cancel()
            if not connecting.done():   # this connect was cancelled (a service stopped while starting)
                connecting.cancel()
        log.info("connected to NATS %s as %s", bus.nc.connected_url.netloc
                 if bus.nc.connected_url else servers, opts["name"])
        return bus

    async def close(self, timeout: float = 5.0) -> None:
        """Stop heartbeats, stop taking messages, let running handlers finish (up to ``timeout``),
        flush what was published, close."""
        self._closing = True
        for t in list(self._heartbeats):
            t.cancel()
        await asyncio.gather(*self._heartbeats, return_exceptions=True)
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except nats.errors.BadSubscriptionError:
                pass
        if self._tasks:
            done, pending = await asyncio.wait(list(self._tasks), timeout=timeout)
            for t in pending:
                log.warning("cancelling a handler still running at close")
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if not self.nc.is_closed:
            # flush what was published, then close. Not nc.drain(): it waits until every
            # subscription's pending messages are read, and an iterator subscription (abort
            # listener, stream readers) nobody reads any more held every shutdown for ``timeout``.
            try:
                await asyncio.wait_for(self.nc.flush(), timeout)
            except (asyncio.TimeoutError, nats.errors.ConnectionClosedError, nats.errors.FlushTimeoutError):
                pass
            try:
                await self.nc.close()
            except OSError as e:   # the server went first (NATS stopped with the rest): nothing to flush
                log.debug("closing the NATS connection: %s: %s", type(e).__name__, e)

    # -- serve --------------------------------------------------------------------------------

    async def serve(self, subject: str, handler: Handler, queue: str | None = None,
                    expected: type | None = None, max_concurrency: int | None = None):
        """Run ``handler(decoded_msg)`` for each message on ``subject`` (each in its own task).

        The handler returns a message (sent as the reply; None -> Ack) or raises (-> ErrorReply).
        ``queue`` shares work between copies; ``max_concurrency`` bounds in-flight handlers
        (further messages wait in the subscription's pending buffer).
        """
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def on_msg(msg: Msg) -> None:
            if msg.reply and not msg.reply.startswith(REPLY_PREFIX):
                # a peer's request whose answer would go to a subject of another's (a client's
                # stream: an ErrorReply there ended it): every requester here waits on its inbox
                _refused_reply(subject, msg.reply)
                return
            if sem is not None:
                await sem.acquire()  # backpressure: the subscription callback waits
            task = asyncio.create_task(self._handle(msg, handler, expected, subject),
                                       name=f"bus-handler:{subject}")
            self._tasks.add(task)

            def done(t: asyncio.Task) -> None:
                self._tasks.discard(t)
                if sem is not None:
                    sem.release()

            task.add_done_callback(done)

        sub = await self.nc.subscribe(subject, queue=queue or "", cb=on_msg)
        await self.flush()  # registered at the server before we announce ourselves
        self._subs.append(sub)
        log.debug("serving %s (queue %s)", subject, queue)
        return sub

    async def _handle(self, msg: Msg, handler: Handler, expected: type | None, pattern: str) -> None:
        """One request: decoded, handled, answered on its reply subject (an inbox: ``serve``)."""
        request_id = ""
        try:
            req = schemas.decode(msg.data, expected)
            request_id = getattr(req, "request_id", "") or ""
            tracing.adopt(msg.headers, request_id)
            with tracing.span(pattern):
                result = await handler(req)
            if msg.reply:
                await self.nc.publish(msg.reply, schemas.encode(result if result is not None else
                                                                Ack(request_id=request_id)))
            return
        except asyncio.CancelledError:
            if msg.reply:
                await self._reply_error(msg, ErrorReply.of("unavailable", "service shutting down",
                                                           request_id))
            raise
        except (BusError, ValueError) as e:
            reply = error_reply_for(e, request_id)
            log.warning("%s on %s (request %s): %s", reply.code, msg.subject, request_id or "-",
                        reply.message)
        except Exception as e:  # the envelope: every failure becomes a coded reply
            reply = error_reply_for(e, request_id)
            log.exception("handler for %s failed (request %s)", pattern, request_id or "-")
        if msg.reply:
            await self._reply_error(msg, reply)

    async def _reply_error(self, msg: Msg, reply: ErrorReply) -> None:
        try:
            await self.nc.publish(msg.reply, schemas.encode(reply))
        except Exception:
            log.exception("could not send the error reply on %s", msg.subject)

    # -- request / publish / subscribe --------------------------------------------------------

    async def request(self, subject: str, msg: Any, timeout: float | None = None,
                      expected: type | None = None) -> Any:
        """Send ``msg`` and return the decoded reply; an ErrorReply raises RemoteError."""
        timeout = self.request_timeout if timeout is None else timeout
        data = schemas.encode(msg)
        try:
            reply = await self.nc.request(subject, data, timeout=timeout, headers=tracing.headers())
        except nats.errors.NoRespondersError:
            raise BusError("unavailable", f"no service is listening on {subject}") from None
        except nats.errors.TimeoutError:
            raise BusError("timeout", f"no reply on {subject} within {timeout}s") from None
        obj = schemas.decode(reply.data)
        if isinstance(obj, ErrorReply):
            raise RemoteError.from_reply(obj)
        if expected is not None and not isinstance(obj, expected):
            raise SchemaError(f"reply on {subject}: expected {expected.SCHEMA}, got {obj.SCHEMA}",
                              "schema")
        return obj

    async def publish(self, subject: str, msg: Any) -> None:
        await self.nc.publish(subject, schemas.encode(msg), headers=tracing.headers())

    async def flush(self, timeout: float = 10.0) -> None:
        """Return once the server has processed everything this connection sent before the call.

        nats-py's ``flush()`` writes its PING straight to the socket, ahead of the commands still
        queued for its flusher task (a SUB or PUB made just before), so its PONG alone does not
        prove the server has them: on a loaded machine another connection's request can reach
        the server before a SUB "flushed" that way (a "no responders" right after ``serve()``
        returned). The first round trip lets the flusher write the queue; the second PING goes
        out after it, and the server answers commands in order.
        """
        await self.nc.flush(timeout)
        await self.nc.flush(timeout)

    async def subscribe(self, subject: str, expected: type | None = None, queue: str | None = None,
                        skip_invalid: bool = False, flush: bool = True) -> Subscription:
        """Subscribe and iterate decoded messages.

        With ``flush`` (default) the server has registered the subscription when this returns,
        so nothing any connection publishes afterwards is missed (two round trips: ``flush``). Without it,
        only messages caused by a later request on this same connection are guaranteed.
        """
        sub = await self.nc.subscribe(subject, queue=queue or "")
        if flush:
            await self.flush()
        return Subscription(sub, expected, skip_invalid)

    async def subscribe_raw(self, subject: str):
        """The raw nats-py subscription (tap): iterate ``.messages`` for Msg objects."""
        sub = await self.nc.subscribe(subject)
        await self.flush()
        return sub

    # -- heartbeats ---------------------------------------------------------------------------

    def start_heartbeat(self, subject: str, make_msg: Callable[[], Any], interval: float,
                        wake: asyncio.Event | None = None, min_gap: float = 0.2) -> asyncio.Task:
        """Publish ``make_msg()`` (sync or async) on ``subject`` now and every ``interval`` s;
        ``wake`` set: the next one sooner, but not within ``min_gap`` s of the one before."""
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval}")

        async def beat() -> None:
            while True:
                sent = time.monotonic()
                try:
                    if wake is not None:
                        wake.clear()
                    m = make_msg()
                    if inspect.isawaitable(m):
                        m = await m
                    await self.publish(subject, m)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("heartbeat on %s failed; retrying in %.1fs", subject, interval)
                if wake is None:
                    await asyncio.sleep(interval)
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), interval)
                except TimeoutError:
                    continue
                await asyncio.sleep(max(0.0, sent + min(min_gap, interval) - time.monotonic()))

        task = asyncio.create_task(beat(), name=f"heartbeat:{subject}")
        self._heartbeats.add(task)
        task.add_done_callback(self._heartbeats.discard)
        return task

    # -- JetStream ----------------------------------------------------------------------------

    def stream_replicas(self) -> tuple[int, str]:
        """(replicas, why) for a stream or KV bucket this service creates: TANDEM_NATS_REPLICAS,
        or auto from the connected server's INFO (3 in a cluster of >= 3 servers, else 1)."""
        info = getattr(self.nc, "_server_info", None) or {}
        return nats_cluster.replicas_for(self.replicas_setting, info, self.configured_servers)

    async def kv_keys(self, bucket: str, pattern: str = ">") -> list[str]:
        """The keys of KV ``bucket`` matching the subject ``pattern`` (``tenant.*``; ``>``: all),
        sorted: the bucket stream's per-subject state, one STREAM.INFO request (the roles that
        use a bucket may make it). Not nats-py's ``KeyValue.keys()``: its watcher can end before
        a key already in flight to it arrives (NoKeysError or a partial list: nats.py #842; seen
        in this project's tests), and its ``filters`` match as substrings, not subject patterns.
        A deleted or purged key may be listed (its marker is its last message): ``get`` raises
        KeyNotFoundError for it."""
        prefix = f"$KV.{bucket}."
        info = await self.nc.jetstream().stream_info(f"KV_{bucket}", subjects_filter=prefix + pattern)
        subjects = info.state.subjects or {}
        if len(subjects) >= SUBJECTS_PAGE:
            raise BusError("internal", f"KV bucket {bucket}: {len(subjects)} keys match {pattern!r}, more than "
                                       "one page of the stream's subject state; listing them needs paging")
        return sorted(s[len(prefix):] for s in subjects)

    async def jetstream_ensure(self, what: str, lookup: Callable[[], Awaitable[Any]],
                               create: Callable[[int], Awaitable[Any]], wait: float | None = None) -> Any:
        """A stream or KV bucket: ``await lookup()`` when it exists (NotFoundError: it does not),
        else ``await create(replicas)``, logged with its replica count (``stream_replicas``).

        Timeouts are tried again (``jetstream_retry``): a cluster that is still electing its
        JetStream meta leader (every server started at once, as a StatefulSet does) answers
        nothing, and a fresh cluster's first create can time out while its meta group settles (a
        create of the same config is idempotent); so is a placement error (fewer servers up than
        replicas, for now)."""
        n, why = self.stream_replicas()

        async def once() -> tuple[Any, bool]:
            try:
                return await lookup(), False
            except nats.js.errors.NotFoundError:
                return await create(n), True
        result, created = await self.jetstream_retry(what, once, wait, retry_api=_placement)
        if created:
            log.info("JetStream %s created with %d replica(s) (%s)", what, n, why)
        return result

    async def jetstream_retry(self, what: str, call: Callable[[], Awaitable[Any]], wait: float | None = None,
                              retry_api: Callable[[Exception], bool] | None = None) -> Any:
        """``await call()``, tried again on a timeout (and on a JetStream API error ``retry_api``
        accepts) for ``wait`` seconds (default ``jetstream_wait``), then raised: JetStream
        requests that need the meta leader (creating a stream, a bucket, a consumer) go
        unanswered while a cluster elects one — at start, or for a few seconds after the leader's
        server died. ``call`` must be safe to repeat (a new consumer gets a new inbox)."""
        deadline = time.monotonic() + (self.jetstream_wait if wait is None else wait)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await call()
            except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.js.errors.APIError) as e:
                if time.monotonic() >= deadline or (isinstance(e, nats.js.errors.APIError)
                                                    and not (retry_api and retry_api(e))):
                    raise
                log.warning("JetStream %s: %s (attempt %d; a cluster still forming or electing its leader "
                            "answers nothing, or has fewer servers up than replicas); trying again", what,
                            str(e) or type(e).__name__, attempt)
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    # -- connection events --------------------------------------------------------------------

    async def _on_error(self, e: Exception) -> None:
        if "authorization violation" in str(e).lower():
            self.refused_login = True
            self._refusals += 1
            if self.nc is None and self._refusals >= _CONNECT_ATTEMPTS:
                self._refused.set()
        self._errors += 1
        since = "since connected" if self.nc is not None else "trying to connect"
        if self._closing:
            log.debug("NATS error while closing: %s: %s", type(e).__name__, e)
        else:   # a server gone is not a line every reconnect attempt
            sparse(log, self._errors)("NATS error: %s: %s (%d %s)", type(e).__name__, e, self._errors, since)

    async def _on_disconnected(self) -> None:
        self.connected_since = None
        if self.down_since is None:
            self.down_since = time.monotonic()
        if not self._closing:
            log.warning("NATS disconnected; reconnecting")

    async def _on_reconnected(self) -> None:
        self.connected_since = time.monotonic()
        self.down_since = None
        self._errors = 0
        log.info("NATS reconnected")

    def connected_for(self) -> float:
        """Seconds since this connection was (re)established; 0 while it is down."""
        return 0.0 if self.connected_since is None else time.monotonic() - self.connected_since

    def down_for(self) -> float:
        """Seconds since this connection was lost; 0 while it is up."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since
