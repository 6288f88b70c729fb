"""The gateway's backend over the bus: router → prefill → decode, tokens back on a stream subject,
and every request carried through the death of the worker that holds it.

Per request (docs/architecture.md numbers these steps):
1. subscribe to ``tandem.stream.<request_id>`` (before anything can be published there);
2. ask the router for a plan (``tandem.router.route``);
3. send the prompt to the planned prefill worker (or, with no prefill worker, to the decode
   worker's generate subject); the worker acks once its engine took the request;
4. yield the StreamChunks in ``seq`` order (prefill sends seq 0, decode continues from 1);
5. if the client goes away first, broadcast ``tandem.abort`` so every service drops it.

Resuming (docs/reliability.md). The gateway keeps what a request needs to go on anywhere: the
prompt, the tokens and characters the client has received, the next seq, and the sampling
parameters with a seed (one is drawn here when the client gave none; draws are keyed by
(seed, output index), so a resumed request draws what the lost worker would have). When a
stream goes quiet for ``TANDEM_LIVENESS_CHECK_S`` the gateway asks the request's holder
``Where`` it is (following hand-offs and migrations): *no responders* means the holder's process
is gone (the NATS server drops a dead client's subscriptions at once); a holder that no longer
has it, a stale heartbeat, a hung engine, a gap in the seqs that does not fill, a worker's
"unavailable" error, a stream that ends with a finish reason outside OpenAI's (a worker dropped
it) or a chunk that does not start where the client's text ends (two copies of one attempt) mean
the same. Then the request resumes: a new attempt is routed (the dead
worker excluded) and continues from the next token the client has not seen, computing its KV
from the prefix cache / KV pool where it can; chunks of older attempts are ignored and an
``Abort(below_attempt=...)`` fences any copy still running. No worker able to take it within
``TANDEM_RESUME_WAIT_S`` (or more than ``TANDEM_RESUME_ATTEMPTS`` losses) ends the stream with an
OpenAI-shaped error, never a silently closed stream. A hand-off refused for room (a ring member
or the decode worker full: an "overloaded" error from a sender that is fine) loses nobody: the
request goes on the same way, routed again once there is room, without counting as a loss
(``REQUEUES`` such refusals at most). While the gateway's own NATS connection is
down it waits (outages of a few seconds are ridden out), then checks every request. A route
request nobody answers (a router killed holding it, the bus reconnecting) is asked again within
the same wait. Workers renew their lease of each request with this gateway (``_alive``): it names
the attempt it waits for; what it no longer runs, the workers drop.

Health comes from heartbeats: ready when a router and a decode worker are live.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.errors import MaxPayloadError

from shared import metrics, subjects, tracing
from shared.bus import Bus, BusError, RemoteError
from shared.engine.sampling import RequestOutput, SamplingParams, TokenLogprob
from shared.liveness import Heartbeats
from shared.schemas import (MAX_PAYLOAD, Abort, ErrorReply, GenerateRequest, Lease, LeaseReply,
                            MessageTooLarge, PrefillRequest, Resume, RoutePlan, RouteRequest, SessionState,
                            SessionUpdate, StreamChunk, Where, WhereReply)
from shared.settings import GatewaySettings
from services.gateway.backend import BackendError, GenerationRequest

log = logging.getLogger("tandem.gateway")

CODE_MAP = {  # bus error code -> (gateway code, HTTP status)
    "bad_request": ("invalid_request", 400), "prompt_too_long": ("context_length_exceeded", 400),
    "not_found": ("not_found", 404), "overloaded": ("overloaded", 429), "unavailable": ("no_workers", 503),
    "timeout": ("timeout", 504), "internal": ("internal_error", 500),
}
RESUMABLE = {"unavailable", "timeout"}   # a worker's stream error that another worker may not hit
REQUEUES = 16            # hand-offs of one request refused for room, routed again each time, at most
FINISHES = {"stop", "length"}            # the finish reasons a worker may end a stream with (OpenAI's)
ROUTE_TRY_S = 3.0        # a route request unanswered this long is asked again (the router may have died
#                          holding it, or the bus be reconnecting), up to TANDEM_RESUME_WAIT_S in all
GAP_S = 1.0              # a missing seq not filled for this long (chunks lost in a NATS outage): resume
HOPS = 4                 # Where replies followed (prefill -> decode -> migration targets) per check
ABORTED_MAX = 4096       # request ids whose Abort was sent, remembered (a second one for the same is noise)
BUS_DOWN_S = 10.0        # a new request while this gateway has been cut off from NATS this long: 503 at once


def backend_error(code: str, message: str, retry_after: float = 0.0, param: str = "") -> BackendError:
    gw_code, status = CODE_MAP.get(code, ("internal_error", 500))
    return BackendError(gw_code, message, status, param=param or None, retry_after=retry_after)


def too_large(e: Exception) -> BackendError:
    """A request whose bus message is over the limit (ours, or the NATS server's max_payload)."""
    return BackendError("request_too_large", f"the request is too large to send to the workers ({e}); its prompt, "
                        f"stop strings, tools and response_format together must encode to under "
                        f"{MAX_PAYLOAD // 1024} KiB", 413)


@dataclass
class _Flight:
    """One request on its way: what it takes to resume it anywhere."""
    req: GenerationRequest
    sampling: SamplingParams             # the request's, with a seed
    attempt: int = 0                     # 0, then one more per resume
    losses: int = 0                      # resumes after a lost worker (TANDEM_RESUME_ATTEMPTS at most)
    requeues: int = 0                    # resumes after a hand-off refused for room (REQUEUES at most)
    next_seq: int = 0                    # the next chunk the client gets
    token_ids: list[int] = field(default_factory=list)   # tokens the client got
    chars: int = 0                       # characters of text the client got
    holder: str = ""                     # the worker believed to hold it (last chunk's, or dispatched to)
    exclude: set[str] = field(default_factory=set)       # workers found dead for it
    silent: dict[str, float] = field(default_factory=dict)  # ... of them found silent (no answer, no heartbeat,
                                                         # a hung step): when; a heartbeat since lets them back
    held: dict[int, StreamChunk] = field(default_factory=dict)  # chunks ahead of next_seq
    gap_since: float | None = None       # when a chunk ahead of a missing seq arrived
    suspect_since: float | None = None   # when the holder said it no longer has it (grace before resuming)
    stalled_since: float | None = None   # when the holder reported a hung engine
    deaf_since: float | None = None      # when its holder looked silent while no service at all was heard
    tier: str = ""                       # the router's plan's tier, until the first output says it


class NatsBackend:
    def __init__(self, bus: Bus, model_name: str, max_context: int, tokenizer,
                 settings: GatewaySettings | None = None, gateway_id: str = "gateway"):
        self.bus = bus
        self.model_name = model_name
        self.max_context = max_context
        self.tokenizer = tokenizer
        self.settings = settings or GatewaySettings()
        self.gateway_id = subjects.check_token(gateway_id, "gateway_id")
        self.heartbeats = Heartbeats(bus, name="gateway-heartbeats")   # who is alive (shared/liveness.py)
        self.flights: dict[str, _Flight] = {}   # request id -> the request under way (workers' leases)
        self.resumes = 0                 # requests resumed by this gateway (tests, logs)
        self.aborted: OrderedDict[str, None] = OrderedDict()   # ids whose Abort went out (ABORTED_MAX newest)

    async def start(self) -> None:
        await self.heartbeats.start()
        await self.bus.serve(subjects.gateway_alive(self.gateway_id), self._alive, expected=Lease)

    async def _alive(self, lease: Lease) -> LeaseReply:
        """A worker's lease check: the attempt this gateway waits for, per request of the worker's
        it still runs. What it does not list it let go: the worker drops it (services/worker.py)."""
        return LeaseReply(gateway=self.gateway_id, attempts={
            rid: self.flights[rid].attempt for rid in lease.requests if rid in self.flights})

    def health(self) -> tuple[bool, dict]:
        roles: dict[str, list[str]] = {}
        for beat in self.heartbeats.live():
            roles.setdefault(beat.role, []).append(beat.worker_id)
        decode = roles.get(subjects.GPU_DECODE, []) + roles.get(subjects.CPU_DECODE, [])
        ready = bool(roles.get(subjects.ROUTER)) and bool(decode)
        details = {r: {"ready": bool(roles.get(r)), "workers": sorted(roles.get(r, []))}
                   for r in (subjects.ROUTER, subjects.PREFILL, subjects.GPU_DECODE, subjects.CPU_DECODE,
                             subjects.KVPOOL)}
        refused, why = self.heartbeats.refused()
        if refused:   # a service this gateway cannot read (another release's heartbeat version) is not
            details["refused_heartbeats"] = {"count": refused, "last": why}   # counted above: say so
        return ready, details

    # ---- a request ------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        rid = req.request_id
        sampling = req.sampling
        if sampling.seed is None:  # a resumed request must draw what the lost worker would have
            sampling = dataclasses.replace(sampling, seed=random.getrandbits(63))
        st = _Flight(req, sampling)
        # no flush round trip: every chunk is caused by a request this connection sends after the
        # SUB, and the server handles one connection's protocol in order. A message that is no
        # chunk or error (a JetStream API answer some peer sent here as its reply subject) is
        # logged and skipped: it ended the client's stream with a 500 before
        sub = await self.bus.subscribe(subjects.stream(rid), flush=False, skip_invalid=True)
        finished = False
        self.flights[rid] = st
        try:
            with tracing.span("gateway.dispatch", tier=req.tier):  # parent of the router's and workers' spans
                await self._dispatch_patiently(st)
            while not finished:
                for chunk in await self._next_chunks(st, sub):
                    finished = chunk.finish_reason is not None
                    out = to_output(chunk)
                    out.tier, st.tier = st.tier, ""
                    yield out
                    if finished:
                        break
        finally:
            if self.flights.get(rid) is st:
                del self.flights[rid]
            await sub.unsubscribe()
            if not finished:
                await self.abort(rid)

    async def _next_chunks(self, st: _Flight, sub) -> list[StreamChunk]:
        """The next chunks in seq order (at least one); resumes the request when its holder is lost.
        A chunk is taken only where it continues what the client has (its ``offset``): two copies
        of one attempt (a hand-off that timed out, yet arrived) would otherwise interleave chunks
        cut at different tokens, a text with tokens repeated or skipped. A stream that ends with a
        finish reason other than OpenAI's (a worker dropped the request: "abort") is a lost holder
        too: its tokens are the client's, the rest comes from a resume."""
        check = self.settings.liveness_check_s
        while True:
            try:
                msg = await sub.next(timeout=check)
            except BusError:  # quiet for a while: is the holder still there?
                await self._check(st)
                continue
            if isinstance(msg, ErrorReply):
                if msg.attempt != st.attempt:
                    continue  # a fenced attempt's last words
                if msg.code in RESUMABLE:
                    # the worker found gone (a ring's member; the decode worker a prefill's hand-off
                    # did not reach), nobody (a live peer refused the sender's hand-off), else the sender
                    gone = msg.lost or ("" if msg.sender_ok else st.holder)
                    await self._resume(st, f"its worker failed: {msg.message}", gone, silent=bool(msg.lost))
                    continue
                if msg.code == "overloaded" and msg.sender_ok:   # its hand-off was refused: nobody lost
                    # (no room there, or the decode worker is stopping: then it is named, and left out)
                    await self._resume(st, f"its hand-off was refused: {msg.message}", msg.lost, lost=False)
                    continue
                raise backend_error(msg.code, msg.message, msg.retry_after)
            if not isinstance(msg, StreamChunk) or msg.attempt != st.attempt or msg.seq < st.next_seq:
                continue  # not a chunk, an older attempt's, or one already delivered
            st.holder, st.suspect_since, st.stalled_since = msg.worker, None, None
            st.held[msg.seq] = msg
            ready, broken = [], None
            while st.next_seq in st.held:  # prefill and decode publish from different connections
                chunk = st.held.pop(st.next_seq)
                if chunk.offset >= 0 and chunk.offset != len(st.token_ids):
                    broken = (f"chunk {chunk.seq} from {chunk.worker} starts at token {chunk.offset}, the client "
                              f"has {len(st.token_ids)} (two copies of attempt {st.attempt})", "")
                    break
                dropped = chunk.finish_reason is not None and chunk.finish_reason not in FINISHES
                if dropped:
                    broken = (f"{chunk.worker} dropped it (finish_reason {chunk.finish_reason!r})", chunk.worker)
                    chunk = dataclasses.replace(chunk, finish_reason=None, usage=None)
                st.next_seq += 1
                st.token_ids += chunk.token_ids
                st.chars += len(chunk.text)
                ready.append(chunk)
                if chunk.finish_reason is not None or dropped:
                    break
            if broken is not None:
                await self._resume(st, *broken)
                if ready:
                    return ready
                continue
            if ready and ready[-1].finish_reason is not None:
                return ready
            st.gap_since = None if not st.held else (st.gap_since or time.monotonic())
            if ready:
                return ready
            if st.gap_since is not None and time.monotonic() - st.gap_since > GAP_S:
                await self._resume(st, f"chunk {st.next_seq} never came (lost in a bus outage?)", "")

    async def _check(self, st: _Flight) -> None:
        """The stream is quiet: find the request's holder; resume when it is gone."""
        if self.bus.connected_for() < self.settings.liveness_check_s:
            return  # our own connection is down or just back: wait for it, then look
        now = time.monotonic()
        if st.gap_since is not None and now - st.gap_since > GAP_S:
            await self._resume(st, f"chunk {st.next_seq} never came (lost in a bus outage?)", "")
            return
        worker = st.holder
        for _ in range(HOPS):
            try:
                where = await self.bus.request(subjects.worker_where(worker), Where(request_id=st.req.request_id),
                                               timeout=max(1.0, self.settings.liveness_check_s), expected=WhereReply)
            except BusError as e:
                if e.code == "unavailable":  # no responders: the process is gone
                    await self._resume(st, f"worker {worker} is gone", worker, silent=True)
                elif self._stale(worker, now) and not self._deaf(st, now):
                    await self._resume(st, f"worker {worker} stopped answering (no heartbeat)", worker, silent=True)
                return  # a slow answer from a live worker: it is busy, not gone
            if where.holds and where.attempt == st.attempt:
                if where.ready:
                    st.suspect_since = st.stalled_since = None
                    return
                st.stalled_since = st.stalled_since or now  # its engine is stuck in a step
                if now - st.stalled_since > self.settings.liveness_check_s:
                    await self._resume(st, f"worker {worker}'s engine is not making progress", worker, silent=True)
                return
            if where.handed_to and not where.holds:
                worker = where.handed_to  # follow the hand-off / migration
                continue
            break
        # nobody holds it: its last chunks may still be on the way; give them a moment
        if st.suspect_since is None:
            st.suspect_since = now
        elif now - st.suspect_since >= self.settings.liveness_check_s:
            await self._resume(st, f"no worker holds it any more (last seen on {worker})", "")

    def _stale(self, worker: str, now: float) -> bool:
        return self.heartbeats.gone(worker, now)

    def _deaf(self, st: _Flight, now: float) -> bool:
        """No heartbeat from any service, this gateway's own included: its own link to the bus is
        the suspect (its nats-server frozen, its host cut off: the client leaves such a server
        after a few unanswered pings), not the holder — wait for the link, for up to
        TANDEM_RESUME_WAIT_S (every worker of the node frozen at once is then resumed). It
        blamed the holder: "worker decode-b stopped answering" while decode-b streamed on
        through another server of the cluster."""
        if self.heartbeats.heard_any(now):
            st.deaf_since = None
            return False
        if st.deaf_since is None:
            st.deaf_since = now
            log.warning("%s: no heartbeat from any service: this gateway's link to the bus is the suspect, not "
                        "%s; waiting for it", st.req.request_id, st.holder)
        return now - st.deaf_since < self.settings.resume_wait_s

    async def _resume(self, st: _Flight, why: str, dead: str, lost: bool = True, silent: bool = False) -> None:
        """Go on from the next token the client has not seen, on another worker (module doc);
        ``lost``: its worker was lost (else a hand-off was refused for room: routed again);
        ``silent``: ``dead`` was found silent — it may be back (a pause, not a death): excluded
        until it sends a heartbeat again (``_readmit``)."""
        rid = st.req.request_id
        if lost and st.losses >= self.settings.resume_attempts:
            raise BackendError("worker_lost", f"the request was lost {st.losses + 1} times ({why}); giving up", 502)
        if not lost and st.requeues >= REQUEUES:
            raise BackendError("overloaded", f"{why}; refused for room {st.requeues + 1} times: retry later", 429,
                               retry_after=5)
        st.losses += lost
        st.requeues += not lost
        st.attempt += 1
        self.resumes += 1
        metrics.RESUMES.labels("gateway").inc()
        if dead:
            st.exclude.add(dead)
            if silent:
                st.silent[dead] = time.monotonic()
        st.held.clear()
        st.gap_since = st.suspect_since = st.stalled_since = None
        log.warning("%s: %s; resuming at token %d (seq %d, attempt %d)", rid, why, len(st.token_ids), st.next_seq,
                    st.attempt)
        try:  # fence whatever still runs of older attempts
            await self.bus.publish(subjects.ABORT, Abort(request_id=rid, reason=f"resumed: {why}",
                                                         below_attempt=st.attempt))
        except Exception:
            log.warning("%s: could not fence older attempts", rid, exc_info=True)
        try:
            await self._dispatch_patiently(st, ("no_workers", "overloaded", "timeout"), keep_excluded=True)
        except BackendError as e:
            raise BackendError("worker_lost", f"{why}; no worker could take the request over: {e.message}",
                               502) from None

    async def _dispatch_patiently(self, st: _Flight, retry_on=("no_workers", "timeout"),
                                  keep_excluded: bool = False) -> None:
        """Dispatch; while the answer is one of ``retry_on`` (no worker or no router: a bus restart,
        copies reconnecting or restarting; a route request a dying router took with it), try again,
        up to TANDEM_RESUME_WAIT_S. A new request forgets the workers it found gone (they may be
        back); a resumed one keeps its dead worker out. A new request while this gateway has been
        cut off from NATS for BUS_DOWN_S already is a 503 at once (a NATS restart or a cluster's
        failover takes a few seconds: one that lasts is an outage, and a client waiting the whole
        TANDEM_RESUME_WAIT_S for the same answer gains nothing); a resumed one waits as ever."""
        down = self.bus.down_for()
        if not st.attempt and down > BUS_DOWN_S:
            raise BackendError("no_workers", f"the message bus (NATS) has been unreachable from this gateway for "
                               f"{down:.0f} s; try again shortly", 503, retry_after=5)
        wait = self.settings.resume_wait_s
        deadline = time.monotonic() + wait
        while True:
            try:
                await self._dispatch(st)
                return
            except BackendError as e:
                if e.code not in retry_on:
                    raise
                if time.monotonic() > deadline:
                    if not self.bus.connected_for():   # not the router's silence: the bus is gone
                        raise BackendError("no_workers", f"the message bus (NATS) is unreachable from this "
                                           f"gateway (tried for {wait:g} s); try again shortly", 503,
                                           retry_after=5) from None
                    raise BackendError(e.code, f"{e.message} (tried for {wait:g} s)", e.status,
                                       retry_after=e.retry_after) from None
                log.info("%s: %s; waiting for a worker", st.req.request_id, e.message)
            if not keep_excluded:
                st.exclude.clear()
            self._readmit(st)
            await asyncio.sleep(min(1.0, self.settings.liveness_check_s * 2))

    def _readmit(self, st: _Flight) -> None:
        """Workers excluded for silence that have sent a ready heartbeat since (stopped for a few
        seconds, a GC or swap pause, a step that hung and ended): routed to again — they dropped
        the attempt they held. A dead worker never beats again under its id (a restart has a new one)."""
        for wid, since in list(st.silent.items()):
            got = self.heartbeats.last.get(wid)
            if got is not None and got[1] > since and got[0].ready:
                st.exclude.discard(wid)
                del st.silent[wid]
                log.info("%s: %s is back (a heartbeat since it was found silent): it may take the request again",
                         st.req.request_id, wid)

    async def _dispatch(self, st: _Flight) -> None:
        """Route the request (its current attempt) and hand it to the planned worker; a planned
        worker that turns out to be gone is excluded and the request routed again."""
        req = st.req
        resume = None
        if st.attempt:
            resume = Resume(output_token_ids=list(st.token_ids), emitted_chars=st.chars, next_seq=st.next_seq,
                            attempt=st.attempt)
        for _ in range(3):
            route = RouteRequest(
                request_id=req.request_id, model=req.model, tier=req.tier, session_id=req.session_id,
                num_prompt_tokens=len(req.prompt_token_ids) + len(st.token_ids), max_tokens=req.sampling.max_tokens,
                prompt_token_ids=req.prompt_token_ids + st.token_ids, exclude=sorted(st.exclude),
                attempt=st.attempt, tenant=req.tenant, owner=req.owner)
            try:
                plan = await self._call(subjects.ROUTE, route, RoutePlan,
                                        timeout=min(ROUTE_TRY_S, self.bus.request_timeout))
            except BackendError as e:   # the router's "prompt" / "max_tokens": this endpoint's names
                if e.param in ("prompt", "max_tokens"):
                    e.param = req.params[e.param == "max_tokens"]
                raise
            if not st.attempt:
                st.tier = plan.tier
            target = plan.prefill_worker or plan.decode_worker
            sampling = st.sampling.to_dict()
            stream_subject = subjects.stream(req.request_id)
            try:
                # the plan's tier (a session's may raise it, fifo flattens it) and session (none when
                # the id is another key's session)
                if plan.prefill_worker:
                    await self.bus.request(subjects.worker_prefill(plan.prefill_worker), PrefillRequest(
                        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=sampling,
                        tier=plan.tier, decode_worker=plan.decode_worker,
                        decode_subject=subjects.worker_decode(plan.decode_worker), stream_subject=stream_subject,
                        decode_data_host=plan.decode_data_host, decode_data_port=plan.decode_data_port,
                        session_id=plan.session_id, resume=resume, origin=self.gateway_id, tenant=req.tenant,
                        ring=plan.ring, cache_retention=req.cache_retention))
                else:
                    await self.bus.request(subjects.worker_generate(plan.decode_worker), GenerateRequest(
                        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=sampling,
                        tier=plan.tier, stream_subject=stream_subject, session_id=plan.session_id, resume=resume,
                        origin=self.gateway_id, tenant=req.tenant, cache_retention=req.cache_retention))
            except RemoteError as e:
                if e.code != "not_found":
                    raise backend_error(e.code, e.message, e.retry_after) from None
                # the worker dropped this request (an abort this gateway did not send: a fence or a
                # lease of an older attempt): another worker takes it
                log.info("%s: %s refused it (%s); routing again", req.request_id, target, e.message)
                st.exclude.add(target)
                continue
            except (MessageTooLarge, MaxPayloadError) as e:
                raise too_large(e) from None
            except BusError as e:
                if e.code == "timeout":
                    # no ack: the worker may have died holding the message, or be slow to admit it.
                    # Either way the liveness check decides (Where): it holds it, or it is resumed.
                    log.warning("%s: no ack from %s in time; the liveness check decides", req.request_id, target)
                    st.holder = target
                    return
                if e.code != "unavailable":
                    raise backend_error(e.code, str(e), e.retry_after) from None
                log.info("%s: planned worker %s is gone; routing again", req.request_id, target)
                st.exclude.add(target)
                continue
            st.holder = target
            log.info("%s: %s%s", req.request_id, plan.reason, f" (attempt {st.attempt})" if st.attempt else "")
            return
        raise BackendError("no_workers", "every worker the router chose was gone", 503)

    async def update_session(self, session_id: str, tier: str, owner: str = "public") -> dict:
        """Set a session's tier (the router moves its running requests); the new state."""
        state = await self._call(subjects.ROUTER_SESSION, SessionUpdate(session_id=session_id, tier=tier, owner=owner),
                                 SessionState)
        return {"id": state.session_id, "object": "session", "tier": state.tier, "worker": state.worker,
                "running": state.running, "moved": state.moved}

    async def _call(self, subject: str, msg, expected=None, timeout: float | None = None):
        try:
            return await self.bus.request(subject, msg, timeout=timeout, expected=expected)
        except RemoteError as e:
            raise backend_error(e.code, e.message, e.retry_after, e.param) from None
        except BusError as e:
            raise backend_error(e.code, str(e), e.retry_after) from None
        except (MessageTooLarge, MaxPayloadError) as e:
            raise too_large(e) from None
        except Exception as e:  # e.g. a flush timeout while the connection is down: still a clear 503
            raise backend_error("unavailable", f"the bus is unavailable: {type(e).__name__}: {e}") from None

    async def abort(self, request_id: str) -> None:
        """Broadcast that ``request_id`` is over (its client left, it failed): once — the HTTP layer
        aborts a request whose client left, then closing its stream here would again."""
        if request_id in self.aborted:
            return
        self.aborted[request_id] = None
        if len(self.aborted) > ABORTED_MAX:
            self.aborted.popitem(last=False)
        try:
            await self.bus.publish(subjects.ABORT, Abort(request_id=request_id, reason="client gone"))
        except Exception:  # the bus is gone: the workers' gateway leases will clean up
            log.warning("%s: could not broadcast abort", request_id, exc_info=True)

    async def close(self) -> None:
        await self.heartbeats.close()


def to_output(c: StreamChunk) -> RequestOutput:
    lps = None
    if c.logprobs is not None:
        lps = [TokenLogprob(d["token_id"], d["logprob"], [tuple(t) for t in d["top"]]) for d in c.logprobs]
    u = c.usage or {}
    return RequestOutput(request_id=c.request_id, token_ids=c.token_ids, text=c.text,
                         finished=c.finish_reason is not None, finish_reason=c.finish_reason, logprobs=lps,
                         num_prompt_tokens=u.get("prompt_tokens", 0), num_cached_tokens=u.get("cached_tokens", 0),
                         num_output_tokens=u.get("completion_tokens", 0), reused_tokens=c.reused_tokens,
                         recomputed_tokens=c.recomputed_tokens)
