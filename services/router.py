"""Router: decides per request how it runs, and moves sessions between CPU and GPU decode.

The policy is pure (services/placement.py); this service feeds it and carries out its output:
- heartbeats give each worker's load, measured TPOT and the requests it holds;
- the prefix index (services/prefix_index.py, fed by KV events, rebuilt after a restart from a
  JetStream snapshot plus replay) gives each holder's cached prefix of a prompt;
- the session table (tier override, the worker holding the session's KV, the API key's tenant
  that owns it: another key's request runs without the session, its update is "not_found") is
  kept the same in every router copy: each decision is published on ``tandem.router.decision``
  (RoutePlan, and SessionState for tier changes) and every copy applies the others' — so does
  its load view (requests routed to a worker since its last heartbeat);
- moves (services/migrate.py) happen on a session tier change (``tandem.router.session``, from
  POST /v1/sessions/{id}), when a session's request comes at a better tier than its running
  ones, under GPU KV pressure, and — a cpu-decode worker short of KV for what its requests may
  still need — spreading its longest background request onto a ring of cpu-decode workers
  (checked every heartbeat interval by one router copy: the live router with the smallest id;
  counted in ``tandem_router_moves_total{kind, strategy, outcome}``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvpool.keys import chunk_keys_from_seed
from shared import metrics, subjects, tracing
from shared.bus import Bus, BusError
from shared.liveness import Heartbeats
from shared.schemas import Heartbeat, InFlight, RingPeer, RoutePlan, RouteRequest, SessionState, SessionUpdate
from shared.settings import Settings
from shared.tier import Tier
from services.migrate import migrate, to_target
from services.placement import (POOL, Limits, Move, SessionView, WorkerView, context_digest, decide, evacuate,
                                rebalance, session_held, with_moves)
from services.prefix_index import IndexFeed, PrefixIndex
from services.sessions import SessionStore

log = logging.getLogger("tandem.router")

FORGET_S = 60.0          # a worker silent this long leaves the view (and the prefix index)
MOVE_BACKOFF_S = 5.0     # no move is planned onto a worker for this long after one onto it failed
SESSION_GRACE_S = 3.0    # a session's tier change is moved by the copy that took it; the tick follows up after
TARGET_FAULTS = ("timeout", "overloaded", "forbidden")  # a move's failures that are its target's part


class Router:
    def __init__(self, settings: Settings):
        self.settings = settings
        rs = settings.router
        self.worker_id = settings.worker.resolved_worker_id(subjects.ROUTER)
        self.policy = rs.policy
        self.limits = Limits(queue={str(t): rs.queue_limit(t) for t in Tier},
                             pressure_free=rs.pressure_free, session_idle_s=rs.session_idle_s,
                             local_prefill_tokens=rs.local_prefill_tokens)
        self.workers: dict[str, WorkerView] = {}
        self.sessions: dict[str, SessionView] = {}
        self.moving: set[str] = set()                # request ids being migrated now
        self.under_way: dict[str, Move] = {}         # ... their moves (counted on their targets)
        self.move_failed: dict[str, float] = {}      # worker id -> when a move onto it last failed
        self.index = PrefixIndex()
        self.turn = 0                                # round-robin counter
        self.metrics_port = 0
        self.bus: Bus | None = None
        self.feed: IndexFeed | None = None
        self.store: SessionStore | None = None           # the session table in JetStream (services/sessions.py)
        self._tasks: list[asyncio.Task] = []
        self.heartbeats: Heartbeats | None = None   # every worker's last heartbeat (shared/liveness.py)
        self._moves: set[asyncio.Task] = set()
        self.started = time.monotonic()
        self._swept = False                          # stale holders of the restored index dropped

    async def start(self) -> None:
        tracing.setup(subjects.ROUTER)
        self.metrics_port = metrics.serve_http(self.settings.worker.metrics_port,
                                               self.settings.worker.metrics_host) or 0
        self.bus = await Bus.connect(self.settings, name=self.worker_id, role=subjects.ROUTER)
        self.feed = IndexFeed(self.bus, self.index, self.settings)
        await self.feed.start()
        self.store = SessionStore(self.bus)
        self.sessions.update(await self.store.start(on_opened=self._sessions_restored))
        self.heartbeats = Heartbeats(self.bus, self._seen)
        await self.heartbeats.start()
        decisions = await self.bus.subscribe(subjects.ROUTER_DECISION, skip_invalid=True)
        self._tasks = [asyncio.create_task(self._follow(decisions), name="decisions"),
                       asyncio.create_task(self._tick(), name="rebalance")]
        await self.bus.serve(subjects.ROUTE, self.route, queue=subjects.ROUTE_QUEUE, expected=RouteRequest)
        await self.bus.serve(subjects.ROUTER_SESSION, self.update_session, queue=subjects.ROUTE_QUEUE,
                             expected=SessionUpdate)
        self.bus.start_heartbeat(subjects.heartbeat(subjects.ROUTER, self.worker_id), self.heartbeat,
                                 self.settings.worker.heartbeat_interval)
        log.info("router %s ready (policy %s)", self.worker_id, self.policy)

    def _sessions_restored(self, restored: dict[str, SessionView]) -> None:
        """The session table's bucket answered only after this router started: the sessions it
        holds that this router has no view of are taken; the others keep this router's (newer)."""
        for sid, view in restored.items():
            self.sessions.setdefault(sid, view)

    def heartbeat(self) -> Heartbeat:
        metrics.set_ready(subjects.ROUTER, self.bus.nc.is_connected)
        return Heartbeat(worker_id=self.worker_id, role=subjects.ROUTER, device="cpu", model="", ready=True,
                         queue_depth=0, running=0, free_kv_blocks=0, total_kv_blocks=0, max_context=0,
                         data_host="", data_port=0, ts=time.time(),
                         interval=self.settings.worker.heartbeat_interval, metrics_port=self.metrics_port)

    # ---- what the router knows -------------------------------------------------------
    def _seen(self, beat: Heartbeat, now: float) -> None:
        """A heartbeat (``Heartbeats``, shared/liveness.py): the worker's view renewed."""
        old = self.workers.get(beat.worker_id)
        self.workers[beat.worker_id] = old.renewed(beat, now) if old else WorkerView(beat, now, since=now)
        if beat.draining and (old is None or not old.beat.draining):
            log.info("%s is stopping (draining): no new work to it%s", beat.worker_id,
                     f"; moving the {len(beat.requests)} request(s) it holds" if beat.requests else "")
            if self._leader(now):
                self._spawn_evacuation()

    def _view(self, now: float) -> list[WorkerView]:
        """Every worker heard from in the last FORGET_S seconds, ready or not (the rest forgotten)."""
        for wid, w in list(self.workers.items()):
            if now - w.seen > FORGET_S:
                del self.workers[wid]
                self.index.drop_holder(wid)
        if now - self.started > FORGET_S and not self._swept:  # holders that died while no router ran
            self._swept = True
            for holder in list(self.index.holders):
                if holder not in self.workers and self.index.role(holder) != subjects.KVPOOL:
                    self.index.drop_holder(holder)
        return list(self.workers.values())

    def cached(self, tokens: list[int], tenant: str = "") -> tuple[dict[str, int], int]:
        """Prefix tokens of ``tokens`` each holder has cached for ``tenant`` (pools under POOL), and
        the chunk size."""
        scope = next((w.beat for w in self.workers.values() if w.beat.kv_scope and w.beat.chunk_tokens), None)
        if scope is None or not tokens:
            return {}, 256
        keys = chunk_keys_from_seed(scope.kv_scope, scope.chunk_tokens, tokens, len(tokens) - 1, tenant)
        out: dict[str, int] = {}
        for holder, chunks in self.index.overlap(keys).items():
            name = POOL if self.index.role(holder) == subjects.KVPOOL else holder
            if chunks and (name == POOL or holder in self.workers):
                out[name] = max(out.get(name, 0), chunks * scope.chunk_tokens)
        return out, scope.chunk_tokens

    def _block_tokens(self) -> int:
        return next((w.beat.kv_block_tokens for w in self.workers.values() if w.beat.kv_block_tokens), 16)

    def _session(self, sid: str | None) -> SessionView | None:
        if sid is None:
            return None
        return self.sessions.setdefault(sid, SessionView())

    def _owned(self, sid: str | None, owner: str) -> SessionView | None:
        """Session ``sid`` when ``owner`` may use it (an unowned one becomes theirs); None for
        another owner's session (or no session)."""
        s = self._session(sid)
        if s is not None and s.owner is None:
            s.owner = owner
        return s if s is not None and s.owner == owner else None

    def _apply(self, plan: RoutePlan, now: float) -> None:
        """A decision (ours or another copy's): the load it adds, the session it moves."""
        for wid in (plan.decode_worker, plan.prefill_worker):
            w = self.workers.get(wid) if wid else None
            if w is not None and not plan.moved_from:
                w.routed.append([plan.request_id, plan.session_id or "", plan.tier, now, plan.owner])
        s = self._owned(plan.session_id, plan.owner)
        if s is not None:
            if plan.context_tokens:
                s.turn(plan.decode_worker, plan.context_tokens, plan.context_digest)
            elif plan.moved_from:
                s.moved(plan.moved_from, plan.decode_worker)
            s.worker, s.last = plan.decode_worker, now
            # a placement's better tier raises the session's; a move only follows the session's
            # tier as it was when planned — one that lands after a later change must not undo it
            if not plan.moved_from and (s.tier is None or Tier(plan.tier).priority < Tier(s.tier).priority):
                s.tier, s.changed = plan.tier, now
            if plan.router == self.worker_id and self.store is not None:
                self.store.changed(plan.session_id, s)

    async def _follow(self, decisions) -> None:
        async for msg in decisions:
            now = time.monotonic()
            if isinstance(msg, RoutePlan) and msg.router != self.worker_id:
                self._apply(msg, now)
            elif isinstance(msg, SessionState) and msg.router != self.worker_id:
                s = self._owned(msg.session_id, msg.owner)
                if s is not None:
                    s.tier, s.last, s.changed = msg.tier, now, now

    # ---- decisions --------------------------------------------------------------------
    async def route(self, req: RouteRequest) -> RoutePlan:
        now = time.monotonic()
        session = self._owned(req.session_id, req.owner)  # another key's session id: no session
        before = session.tier if session is not None else None
        cached, chunk = self.cached(req.prompt_token_ids, req.tenant)
        at, held = session_held(session, req.tenant, req.prompt_token_ids, cached, chunk, self._block_tokens())
        if held > cached.get(at, 0):
            cached[at] = held  # a recent turn's prompt and reply, block by block: no prefill worker
        plan = decide(req, self._view(now), now, self.policy, self.turn, cached=cached, session=session,
                      limits=self.limits, chunk_tokens=chunk)
        plan.router, plan.owner = self.worker_id, req.owner
        if session is None:
            plan.session_id = None
        elif req.prompt_token_ids and not req.attempt:
            plan.context_tokens = len(req.prompt_token_ids)
            plan.context_digest = context_digest(req.tenant, req.prompt_token_ids)
        self.turn += 1
        self._apply(plan, now)
        metrics.ROUTES.labels(self.policy, plan.decode_role, "yes" if plan.prefill_worker else "no").inc()
        metrics.STRATEGIES.labels(plan.strategy).inc()
        log.info("%s: %s", req.request_id, plan.reason)
        await self.bus.publish(subjects.ROUTER_DECISION, plan)
        if session is not None and session.tier != before and before is not None:
            self._spawn_moves(req.session_id, pressure=False)  # a better tier came: its running work follows
        return plan

    async def update_session(self, upd: SessionUpdate) -> SessionState:
        """POST /v1/sessions/{id}: set the session's tier; its running requests move now. Another
        owner's session: "not_found" (whether it exists is not told)."""
        s = self._owned(upd.session_id, upd.owner)
        if s is None:
            raise BusError("not_found", f"no session {upd.session_id!r} for this API key")
        s.tier, s.last = upd.tier, time.monotonic()
        s.changed = s.last
        if self.store is not None:
            self.store.changed(upd.session_id, s)
        moves = self._plan_moves(upd.session_id, pressure=False)  # before any await: the tick cannot take them
        await self.bus.publish(subjects.ROUTER_DECISION, SessionState(
            session_id=upd.session_id, tier=upd.tier, worker=s.worker, running=[], router=self.worker_id,
            owner=upd.owner))
        done = await self._run_moves(moves)
        running = list(dict.fromkeys(r.request_id for w in self.workers.values() for r in w.held()
                                     if r.session_id == upd.session_id))   # a prompt's prefill and decode worker both count it
        log.info("session %s -> %s: %d request(s) moved", upd.session_id, upd.tier, len(done))
        return SessionState(session_id=upd.session_id, tier=upd.tier, worker=s.worker, running=running,
                            moved=done, reason=f"tier {upd.tier}", router=self.worker_id, owner=upd.owner)

    def _plan_moves(self, session_id: str | None, pressure: bool) -> list[Move]:
        """Moves to make now (of ``session_id``'s requests, or all); they count as moving at once,
        so a second plan made before they run leaves them alone."""
        now = time.monotonic()
        moves = rebalance(self._move_view(now), self.sessions, now, self.limits, self.moving, pressure,
                          SESSION_GRACE_S if session_id is None else 0.0)
        moves = [m for m in self._not_failing(moves, now) if session_id is None or m.session_id == session_id]
        self.moving.update(m.request_id for m in moves)
        self.under_way.update((m.request_id, m) for m in moves)
        return moves

    def _move_view(self, now: float) -> list[WorkerView]:
        """The view moves are planned on: the moves under way counted on their targets."""
        return with_moves(self._view(now), list(self.under_way.values()), now)

    def _not_failing(self, moves: list[Move], now: float) -> list[Move]:
        """``moves`` less those onto a worker a move failed onto in the last ``MOVE_BACKOFF_S``
        (unreachable, refusing: planned again a tick after that, not every tick — one warning a
        second until its heartbeat went stale)."""
        self.move_failed = {w: t for w, t in self.move_failed.items() if now - t < MOVE_BACKOFF_S}
        return [m for m in moves if m.target.id not in self.move_failed]

    def _spawn_evacuation(self) -> None:
        """Move what stopping workers hold to others (``placement.evacuate``), whatever the policy."""
        now = time.monotonic()
        moves = self._not_failing(evacuate(self._move_view(now), now, self.moving), now)
        self.moving.update(m.request_id for m in moves)
        self.under_way.update((m.request_id, m) for m in moves)
        self._spawn(moves)

    def _spawn_moves(self, session_id: str | None, pressure: bool) -> None:
        self._spawn(self._plan_moves(session_id, pressure))

    def _spawn(self, moves: list[Move]) -> None:
        if moves:
            t = asyncio.create_task(self._run_moves(moves), name="moves")
            self._moves.add(t)
            t.add_done_callback(self._moves.discard)

    async def _run_moves(self, moves: list[Move]) -> list[dict]:
        done = await asyncio.gather(*(self._move(m) for m in moves))
        return [d for d in done if d is not None]

    async def _move(self, m: Move) -> dict | None:
        t0 = time.monotonic()
        target = self.workers.get(m.target.id)
        if target is None or not target.alive(t0):   # not ready since the plan (stopping, gone): plan again
            self.moving.discard(m.request_id)
            self.under_way.pop(m.request_id, None)
            log.info("%s: not moved to %s, which is not ready any more", m.request_id, m.target.id)
            return None
        fallback = None
        try:
            reply = await migrate(self.bus, m.source, to_target(m.request_id, m.target.beat, m.tier, m.reason,
                                                                 [v.beat for v in m.ring]))
        except Exception as e:  # the request goes on where it was; a later tick may try again
            code = getattr(e, "code", "")
            if m.source != m.target.id and code in TARGET_FAULTS:
                self.move_failed[m.target.id] = time.monotonic()
            src = self.workers.get(m.source)
            if code in ("unavailable", "overloaded") and m.source != m.target.id \
                    and m.kind in ("promote", "demote") and not m.ring and src is not None \
                    and any(r.request_id == m.request_id and r.tier != m.tier for r in src.beat.requests):
                # a tier change not movable now (prefilling, queued, moving), its target unreachable
                # or full: it runs at its new tier where it is meanwhile (a probe's promoted
                # 3,920-token prompt prefilled 30 s at batch priority while the move failed every 6 s)
                fallback = Move(m.request_id, m.session_id, m.source, src, m.tier, f"retier: {m.reason}; it cannot "
                                                                                   "move now")
            metrics.ROUTER_MOVES.labels(m.kind, m.strategy, "failed").inc()
            log.warning("%s: %s -> %s failed: %s", m.request_id, m.source, m.target.id, e)
            if fallback is None:
                return None
        finally:
            self.moving.discard(m.request_id)
            self.under_way.pop(m.request_id, None)
        if fallback is not None:   # (what a session update answers it did: the re-tier in place)
            return await self._move(fallback)
        if m.source == m.target.id:   # re-tiered in place: the views say its tier until the next beat
            for view in {id(m.target): m.target, id(target): target}.values():
                view.beat.requests = [InFlight(r.request_id, r.session_id, m.tier) if r.request_id == m.request_id
                                      else r for r in view.beat.requests]
            metrics.ROUTER_MOVES.labels(m.kind, m.strategy, "ok").inc()
            log.info("%s: %s (in place on %s)", m.request_id, m.reason, m.source)
            return {"request_id": m.request_id, "source": m.source, "target": m.source, "next_seq": 0,
                    "num_tokens": 0, "seconds": reply.seconds}
        src = self.workers.get(m.source)
        kv = None
        if src is not None:  # until the next heartbeats say so
            kv = src.beat.kv_tokens.get(m.request_id)
            src.beat.requests = [r for r in src.beat.requests if r.request_id != m.request_id]
            src.beat.kv_tokens = {r: v for r, v in src.beat.kv_tokens.items() if r != m.request_id}
            src.routed = [r for r in src.routed if r[0] != m.request_id]
            src.beat.running = max(0, src.beat.running - 1)
        # the target as the router sees it now (a heartbeat since the plan replaced the plan's view):
        # it runs one more sequence, in the KV blocks the move filled — so that the next tick, before
        # its next heartbeat, does not plan onto the room this one took
        now_target = self.workers.get(m.target.id, m.target)
        for view in {id(m.target): m.target, id(now_target): now_target}.values():
            b = view.beat
            b.requests = [*b.requests, InFlight(m.request_id, m.session_id, m.tier)]
            b.running += 1
            if b.kv_block_tokens:
                b.free_kv_blocks = max(0, b.free_kv_blocks - -(-reply.num_tokens // b.kv_block_tokens))
                b.kv_tokens = {**b.kv_tokens, m.request_id: [reply.num_tokens, kv[1] if kv else reply.num_tokens, 1]}
        session = self.sessions.get(m.session_id)
        plan = RoutePlan(request_id=m.request_id, prefill_worker=None, decode_worker=m.target.id,
                         decode_role=m.target.role, tier=m.tier, session_id=m.session_id or None,
                         router=self.worker_id, moved_from=m.source, owner=(session.owner or "") if session else "",
                         reason=f"{m.reason}; moved {reply.num_tokens} tokens of KV from {m.source} in "
                                f"{reply.seconds * 1e3:.0f} ms over {reply.path}")
        plan.strategy = m.strategy
        plan.ring = [RingPeer(v.id, v.beat.data_host, v.beat.ring_port) for v in m.ring]
        metrics.ROUTER_MOVES.labels(m.kind, m.strategy, "ok").inc()
        self._apply(plan, time.monotonic())
        await self.bus.publish(subjects.ROUTER_DECISION, plan)
        log.info("%s: %s (%.0f ms)", m.request_id, plan.reason, (time.monotonic() - t0) * 1e3)
        return {"request_id": m.request_id, "source": reply.source, "target": reply.target,
                "next_seq": reply.next_seq, "num_tokens": reply.num_tokens, "seconds": reply.seconds}

    def _leader(self, now: float) -> bool:
        routers = [w.id for w in self.workers.values() if w.role == subjects.ROUTER and w.alive(now)]
        return not routers or min(routers + [self.worker_id]) == self.worker_id

    async def _tick(self) -> None:
        """Every heartbeat interval, on the leader copy only (no double moves): move what stopping
        workers still hold (a request not decoding yet at the first try), and with the SLA policy
        lapse idle sessions, follow tier changes, relieve GPU pressure."""
        while True:
            await asyncio.sleep(self.settings.worker.heartbeat_interval)
            if not self._leader(time.monotonic()):
                continue
            try:
                self._spawn_evacuation()
                if self.policy == "sla":
                    self._spawn_moves(None, pressure=True)
            except Exception:
                log.exception("rebalance failed")

    async def run_until(self, stop: asyncio.Event) -> None:
        """Started: serve until ``stop`` is set, then drain and close."""
        await stop.wait()
        await self.close()

    async def close(self) -> None:
        for t in [*self._tasks, *self._moves]:
            t.cancel()
        if self.heartbeats is not None:
            await self.heartbeats.close()
        if self.feed is not None:
            await self.feed.close()   # writes a last snapshot of the prefix index
        if self.store is not None:
            await self.store.close()
        if self.bus is not None:
            await self.bus.close()
