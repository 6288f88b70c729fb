"""The router's placement policy: pure functions of what the router knows, tested over tables.

``decide(req, workers, now, ...)`` decides how one request runs (its strategy, then ``place``
when no ring is needed); ``rebalance(workers, sessions, now, ...)`` lists the moves of running requests the router should make now. Neither does I/O.

Inputs: the request (tier, prompt length, session), the live workers' heartbeats (queue depth
per tier, running sequences, free KV blocks, measured TPOT, the requests they hold), the
cached-prefix overlap of the prompt per holder (worker ids and "pool", in tokens: the prefix
index), the session's state (its tier override, the worker that last held its KV) and the
router's own count of requests it sent each worker since that worker's last heartbeat.

Policies:
- ``sla``: the tier picks the pool (interactive -> gpu-decode, standard and batch -> cpu-decode;
  each falls back to the other pool when its own has no open worker; interactive work starts on
  a cpu-decode worker with a free slot when no gpu-decode worker has a slot for it
  (``homecoming`` moves it back once one has room); standard and batch
  overflow to the GPU pool when every CPU worker is ``OVERFLOW`` requests busier and the GPU has
  no interactive work waiting (never to a gpu-decode worker whose engine runs on the host's CPU:
  it would take the cores the CPU pool and the prefill workers' batch lane use) — the GPU engine's scheduler preempts them when interactive work
  comes; a session that overflowed stays on its GPU worker while that is no busier than the
  best CPU worker and has no interactive work waiting, as going back recomputes its context). In the pool: the session's worker when it is not much busier than the best
  (affinity), else the worker holding the longest cached prefix among the nearly least loaded,
  else the least loaded. Admission: each tier has a bounded queue across its pools; full ->
  "overloaded" with a Retry-After estimate.
- ``fifo``: no tiers — every request runs at the standard tier on the least-loaded decode
  worker of either pool (the baseline the tiers are measured against).
- ``round-robin``: every decode worker in turn (the replicated topology: N plain replicas).
Prefill: none when the decode worker already holds all but the last partial chunk of the
prompt; none for a short interactive prompt bound for gpu-decode when every prefill worker
holds worse-tier work (``Limits.local_prefill_tokens``: a prompt that arrives while a prefill
worker's batch step runs waits for that step, and a batch-only step runs at the batch priority —
docs/routing.md); else a prefill worker when one is live (GPU first, then one without worse-tier
work, then cache overlap, then load) and the decode worker has a data plane; else the decode
worker prefills.

Execution strategy and placement are one decision (``decide``: ``strategy_plan``, else ``place``;
shared/strategy.py, docs/strategies.md):
``choose`` sees the tier, the session's prospective context (prompt + max_tokens) and each live
decode worker's free KV. When no single worker can hold it (its context, capped by its KV budget,
is shorter: a worker that is only busy queues the request until its KV frees) and a ring of
cpu-decode workers does, the plan is ``cpu-ring(N)``: its members in shard order (the coordinator first), a prefill
worker that holds the prompt (it hands the KV to the coordinator, which scatters it). Otherwise
``place`` decides as above and the plan's strategy is its decode pool's (``gpu`` / ``cpu``).
Spreading (``spread``, run by ``rebalance``): a cpu-decode worker whose free KV is below what its
running requests may still need moves its longest background request onto a ring of others.
Homecoming (``homecoming``, run by ``rebalance``): an interactive request running on cpu-decode
(no gpu-decode worker was ready when it was placed, or its own was stopped) goes back to a
gpu-decode worker once one has room.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from dataclasses import dataclass, field

import numpy as np

from shared import subjects
from shared.bus import BusError
from shared.liveness import fresh
from shared.strategy import CPU, GPU, MAX_RING, RING, NoCapacity, PoolWorker, Strategy, choose, smallest_ring
from shared.tier import Tier, fair_share
from shared.schemas import Heartbeat, InFlight, RingPeer, RoutePlan, RouteRequest

OVERFLOW = 2             # standard/batch use the GPU pool when every CPU worker is this much busier
AFFINITY_SLACK = 2       # a session's (or a cache holder's) worker wins unless this much busier
DEFAULT_TPOT_S = 0.05    # per output token, for Retry-After, before any worker measured one
POLICIES = ("sla", "fifo", "round-robin")
POOLS = {
    Tier.INTERACTIVE: (subjects.GPU_DECODE, subjects.CPU_DECODE),
    Tier.STANDARD: (subjects.CPU_DECODE, subjects.GPU_DECODE),
    Tier.BATCH: (subjects.CPU_DECODE, subjects.GPU_DECODE),
}
POOL = "pool"            # the KV pool's key in the overlap map
CONTEXTS = 4             # a session's recent turns whose prompts the router remembers (SessionView.turn)
HOME_MIN_TOKENS = 64     # an interactive request off the GPU pool goes back with at least this many tokens left


@dataclass
class Limits:
    """Admission and move thresholds (shared.settings.RouterSettings)."""
    queue: dict[str, int] = field(default_factory=lambda: {Tier.INTERACTIVE: 64, Tier.STANDARD: 256, Tier.BATCH: 1024})
    pressure_free: float = 0.1    # gpu-decode below this free-KV fraction demotes batch/standard work
    session_idle_s: float = 300.0  # a session's tier override lapses after this long idle
    local_prefill_tokens: int = 256  # an interactive prompt of at most this many uncached tokens
                                     # skips prefill workers busy with worse tiers (0: never)


@dataclass
class WorkerView:
    beat: Heartbeat
    seen: float                    # router's clock when the last heartbeat arrived
    routed: list = field(default_factory=list)  # [request id, session id, tier, router clock, owner]
                                                # routed here and not in a heartbeat yet
    since: float = 0.0             # router's clock when its first heartbeat arrived

    def renewed(self, beat: Heartbeat, now: float) -> WorkerView:
        """The view after a new heartbeat. A request routed here less than one heartbeat interval
        ago that the beat does not list may still be on its way (the beat was built before it
        arrived): it stays counted until the next beat, which was built after it arrived — unless
        the beat says it ended (``Heartbeat.ended``: a request that ended sends a beat sooner)."""
        gone = {r.request_id for r in beat.requests} | set(beat.ended)
        return WorkerView(beat, now, [r for r in self.routed if r[0] not in gone and now - r[3] < beat.interval],
                          self.since)

    @property
    def pending(self) -> dict[str, int]:
        """Tier -> requests routed here that no heartbeat lists yet."""
        out: dict[str, int] = {}
        for r in self.routed:
            out[r[2]] = out.get(r[2], 0) + 1
        return out

    def alive(self, now: float) -> bool:
        return self.beat.ready and fresh(self.seen, self.beat.interval, now)   # shared/liveness.py

    @property
    def id(self) -> str:
        return self.beat.worker_id

    @property
    def role(self) -> str:
        return self.beat.role

    @property
    def on_host_cpu(self) -> bool:
        """Its engine runs on the host's CPU (a gpu-decode worker on a node without CUDA)."""
        return self.beat.device == "cpu"

    def load(self) -> int:
        return self.beat.queue_depth + self.beat.running + len(self.routed)

    def held(self) -> list[InFlight]:
        """The requests this worker holds: its heartbeat's, and those routed here since."""
        return [*self.beat.requests, *(InFlight(r[0], r[1], r[2]) for r in self.routed)]

    def has_free_slot(self) -> bool:
        """A sequence slot free now, as its heartbeat says (``max_running``), less the requests
        routed here since; False when it does not say its slots."""
        b = self.beat
        return bool(b.max_running) and b.running + b.queue_depth + len(self.routed) < b.max_running

    def full_for(self, tier: str) -> bool:
        """No slot for a request of ``tier`` now: one of that tier waits here already, or every
        slot is taken (it says its slots) and nothing it holds is of a worse tier — which its
        scheduler would preempt for it."""
        return bool(self.waiting(tier)) or (bool(self.beat.max_running) and not self.has_free_slot()
                                             and not self.holds_worse_than(tier))

    def holds_worse_than(self, tier: str) -> bool:
        """Holds (or was just sent) a request of a worse tier than ``tier``: a prompt of ``tier``
        that arrives may find that request's step in flight."""
        mine = Tier(tier).priority
        return any(Tier(r.tier).priority > mine for r in self.held())

    def waiting(self, tier: str) -> int:
        return self.beat.waiting_by_tier.get(tier, 0) + self.queued.get(tier, 0)

    def owners_waiting(self, tier: str) -> dict[str, int]:
        """Owner (API key's tenant) -> its ``tier`` requests waiting here: its heartbeat's, and
        every one routed here since (counted as waiting: the share errs against the heavy key)."""
        out = {o: by.get(tier, 0) for o, by in self.beat.waiting_by_owner.items() if by.get(tier, 0)}
        for r in self.routed:
            if r[2] == tier:
                o = r[4] if len(r) > 4 else ""
                out[o] = out.get(o, 0) + 1
        return out

    @property
    def queued(self) -> dict[str, int]:
        """Tier -> requests routed here that no heartbeat lists yet and that find no free sequence
        slot (``Heartbeat.max_running`` less those running and waiting there): they wait. The
        better tiers take the free slots first, as the engine's scheduler admits them. A worker
        that does not say its slots: every such request waits."""
        b = self.beat
        free = max(0, b.max_running - b.running - b.queue_depth)
        out: dict[str, int] = {}
        for tier, n in sorted(self.pending.items(), key=lambda kv: Tier(kv[0]).priority):
            took = min(n, free)
            free -= took
            if n > took:
                out[tier] = n - took
        return out

    def key(self) -> tuple:
        """Least loaded first, then more free KV, then id (deterministic)."""
        return (self.load(), -self.beat.free_kv_blocks, self.id)


@dataclass
class SessionView:
    tier: str | None = None        # tier override (POST /v1/sessions/{id}, or raised by a request)
    worker: str | None = None      # decode worker that last held the session's KV
    last: float = 0.0              # router clock of the session's last request or update
    owner: str | None = None       # the API key's tenant that created it (None: not known yet)
    changed: float = 0.0           # router clock when its tier last changed (its moves: that copy's)
    contexts: list = field(default_factory=list)  # its last turns' prompts, the latest last (CONTEXTS at
                                                  # most): [decode worker, prompt tokens, context_digest]

    def turn(self, worker: str, tokens: int, digest: str) -> None:
        """A turn's prompt of ``tokens`` (``context_digest``), run on ``worker``: its KV and its reply's
        stay there. The last few are kept, not just the last: a conversation forked from an
        earlier turn (two replies tried from one ``previous_response_id``) continues that turn's."""
        self.contexts = [c for c in self.contexts if c[2] != digest][-(CONTEXTS - 1):] + [[worker, tokens, digest]]

    def moved(self, source: str, target: str) -> None:
        """Its running turn moved from ``source`` to ``target`` with its KV (the turn's prompt with it)."""
        if self.contexts and self.contexts[-1][0] == source:
            self.contexts[-1][0] = target


def context_digest(tenant: str, token_ids: list[int]) -> str:
    """What identifies a turn's prompt: a hash of its tenant and token ids."""
    h = hashlib.blake2b(tenant.encode() + b"\0", digest_size=16)
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    return h.hexdigest()


def session_held(session: SessionView | None, tenant: str, token_ids: list[int], cached: dict[str, int],
                 chunk_tokens: int, block_tokens: int) -> tuple[str, int]:
    """(worker, prompt tokens it holds for this turn at block granularity): the longest of the
    session's recent turns' prompts that this prompt continues (same tenant and tokens) — its KV
    and the reply's stay in that worker's prefix cache (the reply's blocks too: the next prompt
    renders the reply as the tokens it was generated as, so they match up to the first
    difference, which the worker's block match finds). The prefix index sees whole chunks only;
    it must still list the chunks of that prompt on the worker (none evicted). ("", 0): nothing
    known."""
    best = ("", 0)
    for worker, tokens, digest in reversed(session.contexts if session is not None else []):
        held = tokens // block_tokens * block_tokens
        if (not worker or len(token_ids) <= tokens or held <= best[1]
                or cached.get(worker, 0) < tokens // chunk_tokens * chunk_tokens):  # some chunks evicted there
            continue
        if context_digest(tenant, token_ids[:tokens]) == digest:
            best = (worker, held)
    return best


@dataclass
class Move:
    """Move a running request to another decode worker (migration at a step boundary), or spread
    it onto a ring of cpu-decode workers (``ring``: the members in shard order, ``target`` first)."""
    request_id: str
    session_id: str
    source: str
    target: WorkerView
    tier: str
    reason: str
    ring: list[WorkerView] = field(default_factory=list)
    tokens: int = 0               # its KV now (tokens), where the plan knew (it takes that much room)

    @property
    def kind(self) -> str:
        """promote, demote, evacuate, spread or retier (in place: ``source`` is the target) — the
        reason's first word."""
        return self.reason.split(":", 1)[0]

    @property
    def strategy(self) -> str:
        if self.ring:
            return str(Strategy(RING, tuple(w.id for w in self.ring)))
        return GPU if self.target.role == subjects.GPU_DECODE else CPU


def effective_tier(tier: str, session: SessionView | None) -> str:
    """The better of the request's tier and its session's override."""
    if session is None or session.tier is None:
        return tier
    return min(tier, session.tier, key=lambda t: Tier(t).priority)


def _decoders(workers: list[WorkerView], now: float, need: int = 0) -> list[WorkerView]:
    return [w for w in workers if w.alive(now) and w.role in subjects.DECODE_ROLES
            and w.beat.max_context >= need]


def _retry_after(pool: list[WorkerView], max_tokens: int) -> float:
    """Seconds until the tier's queue likely has room again: one request's output (its max_tokens,
    at most 256 counted) at the pool's slowest measured time per token — by then the requests
    running now have finished and as many waiting ones have started — times a random 1-1.5, so
    that a burst's refused clients do not all come back at the same instant; 1..60 s. (It was the
    waiting requests times that over the running ones, as of the last heartbeat: a burst on a pool
    idle a second before said 60 s for a queue that drained in under 10.)"""
    tpot = max((w.beat.tpot_ms / 1e3 for w in pool if w.beat.tpot_ms > 0), default=DEFAULT_TPOT_S)
    return float(min(60, max(1, math.ceil(min(max_tokens, 256) * tpot * random.uniform(1.0, 1.5)))))


def admit(req: RouteRequest, tier: str, pool: list[WorkerView], limit: int) -> None:
    """Raise BusError("overloaded", retry_after=...) when the tier's queue over ``pool`` is full —
    for the request's API key: one under its share of the queue still gets in (``fair_share``)."""
    waiting = sum(w.waiting(tier) for w in pool)
    held: dict[str, int] = {}
    if waiting >= limit:
        for w in pool:
            for o, n in w.owners_waiting(tier).items():
                held[o] = held.get(o, 0) + n
        # waiting requests no heartbeat names an owner for count as this key's (errs against it)
        held[req.owner] = held.get(req.owner, 0) + max(0, waiting - sum(held.values()))
    if not fair_share(waiting, limit, req.owner, held):
        raise BusError("overloaded", f"{waiting} {tier} requests are waiting (limit {limit}), "
                                     f"{held.get(req.owner, 0)} of them this API key's; retry later",
                       retry_after=_retry_after(pool, req.max_tokens))


def _choose_pool(tier: str, decoders: list[WorkerView], home: WorkerView | None = None) -> tuple[list[WorkerView], str]:
    """The pool for ``tier``; ``home``: the live worker holding the session's KV."""
    first, second = POOLS[tier]
    own = [w for w in decoders if w.role == first]
    other = [w for w in decoders if w.role == second]
    if not own:
        return other, f"{tier} -> {second} ({first} pool empty)"
    if tier == Tier.INTERACTIVE and other and (home is None or home.role != first) \
            and all(w.full_for(tier) for w in own):
        # no GPU worker has a slot for it now: start it where one is free (``homecoming`` moves it
        # to the GPU pool once a worker there has room), not at the end of a queue — a probe saw 4
        # of 8 interactive streams wait 18 s while cpu-decode sat idle
        free = [w for w in other if w.has_free_slot() and not w.waiting(tier)]
        if free:
            return free, f"{tier} -> {second} (no {first} worker has a slot for it now; back when one has room)"
    if tier != Tier.INTERACTIVE and other and not any(w.waiting(Tier.INTERACTIVE) for w in other):
        best_own = min(w.load() for w in own)
        if home is not None and home.role == second and home.load() <= best_own + AFFINITY_SLACK:
            # an overflowed session stays where its KV is while that is not much busier (the
            # affinity slack, as within a pool): going back would recompute its whole context
            return other, f"{tier} -> {second} (session's KV on {home.id}, load {home.load()} <= {first} {best_own})"
        # overflow adds capacity only where the other pool has a processor of its own: a
        # gpu-decode engine on the host's CPU runs on the cores the cpu-decode engines and the
        # prefill workers' batch lane already use, so work sent there takes them from those
        # (and from interactive work) instead of joining the cpu-decode engine's batch
        other = [w for w in other if not w.on_host_cpu]
        best_other = min((w.load() for w in other), default=None)
        if best_other is not None and best_own >= best_other + OVERFLOW:
            if home is not None and home.role == first and home.load() < best_other + OVERFLOW + AFFINITY_SLACK:
                # a session at home in its own pool overflows only past the affinity slack too:
                # an agent's turns come faster than heartbeats, and the requests routed since the
                # last one count as load until the next
                return own, f"{tier} -> {first} (session's KV on {home.id}, load {home.load()}, " \
                            f"{second} {best_other})"
            return other, f"{tier} -> {second} (overflow: {first} load {best_own}, {second} {best_other})"
    return own, f"{tier} -> {first}"


def _pick(pool: list[WorkerView], cached: dict[str, int], session: SessionView | None) -> tuple[WorkerView, str]:
    best = min(pool, key=WorkerView.key)
    near = [w for w in pool if w.load() <= best.load() + AFFINITY_SLACK]
    if session is not None and session.worker is not None:
        mine = next((w for w in near if w.id == session.worker), None)
        if mine is not None:
            return mine, "session affinity"
    holder = max(near, key=lambda w: (cached.get(w.id, 0), -w.load(), w.beat.free_kv_blocks))
    if cached.get(holder.id, 0) > 0:
        return holder, f"holds {cached[holder.id]} prefix tokens"
    return best, "least loaded"


def _not_ready(later: list[WorkerView], roles: tuple[str, ...], now: float) -> str:
    """``later``'s workers of ``roles`` as a clause for a message: their ids and why each is not usable
    now (a worker restarted comes back under a new id: the clause says "or a replacement")."""
    def why(w: WorkerView) -> str:
        if w.beat.draining and fresh(w.seen, w.beat.interval, now):
            return "stopping"
        return "found gone for this request" if w.alive(now) else f"last heartbeat {max(0.0, now - w.seen):.1f} s ago"
    named = [f"{w.id} ({why(w)})" for w in later if w.role in roles]
    return ", ".join(named) + (" or a replacement" if len(named) == 1 else " or replacements")


def place(req: RouteRequest, workers: list[WorkerView], now: float, policy: str = "sla", turn: int = 0,
          cached: dict[str, int] | None = None, session: SessionView | None = None,
          limits: Limits | None = None, chunk_tokens: int = 256, later: list[WorkerView] = ()) -> RoutePlan:
    """The plan for one request. ``cached``: prefix tokens of the prompt each holder (worker id,
    or POOL) has cached; ``turn``: the round-robin counter (the caller's state); ``later``:
    workers heard from lately that are not ready now (``decide``). Raises BusError("unavailable")
    with no decode worker ready — or none ready that holds the prompt while one of ``later``
    would: it may be back in seconds —, BusError("prompt_too_long") when no decode worker holds
    the prompt, BusError("overloaded") when the tier's queue is full or every candidate's is."""
    if policy not in POLICIES:
        raise ValueError(f"unknown router policy {policy!r} (one of {', '.join(POLICIES)})")
    cached = cached or {}
    limits = limits or Limits()
    decoders = _decoders(workers, now, req.num_prompt_tokens + 1)
    if not decoders:
        live = _decoders(workers, now)
        longest = max((w.beat.max_context for w in live), default=0)
        back = [w for w in later if w.role in subjects.DECODE_ROLES and w.beat.max_context > req.num_prompt_tokens]
        if back:  # the worker that holds it is restarting (or was lost a moment ago): wait for it
            raise BusError("unavailable", f"no ready decode worker holds a prompt of {req.num_prompt_tokens} tokens "
                                          f"(the longest context of a ready one is {longest} tokens); "
                                          f"{_not_ready(back, subjects.DECODE_ROLES, now)} would, once ready")
        if live:  # ready, but none has the room (a worker's KV budget can cap its context)
            raise BusError("prompt_too_long", f"a prompt of {req.num_prompt_tokens} tokens does not fit: the "
                                              f"longest context of a ready decode worker is {longest} tokens",
                           param="prompt")
        raise BusError("unavailable", "no decode worker is ready")
    tier = Tier.STANDARD if policy == "fifo" else effective_tier(req.tier, session)
    if policy == "round-robin":
        pool = sorted(decoders, key=lambda w: w.id)
        admit(req, tier, pool, limits.queue[tier])
        decode = pool[turn % len(pool)]
        why = f"round-robin -> {decode.id} (turn {turn} of {len(pool)})"
    elif policy == "fifo":
        admit(req, tier, decoders, limits.queue[tier])
        decode = min(decoders, key=WorkerView.key)
        why = f"fifo -> {decode.id} (least loaded)"
    else:
        home = next((w for w in decoders if session is not None and w.id == session.worker), None)
        pool, why = _choose_pool(tier, decoders, home)
        admit(req, tier, decoders, limits.queue[tier])
        decode, pick = _pick(pool, cached, session)
        why += f" {decode.id} ({pick})"
        if tier != req.tier:
            why += f"; session tier {tier}"

    have = cached.get(decode.id, 0)
    prefills = [w for w in workers if w.alive(now) and w.role == subjects.PREFILL
                and w.beat.max_context >= req.num_prompt_tokens + 1]
    prefill = None
    uncached = req.num_prompt_tokens - max(have, cached.get(POOL, 0))
    if req.num_prompt_tokens - have < chunk_tokens and have > 0:
        why += f"; decode worker holds {have} prefix tokens, no prefill"
    elif (policy == "sla" and tier == Tier.INTERACTIVE and decode.role == subjects.GPU_DECODE and prefills
          and 0 < uncached <= limits.local_prefill_tokens and all(w.holds_worse_than(tier) for w in prefills)):
        # its prompt would wait for a worse tier's prefill step in flight there (a batch-only step
        # runs at the batch priority); the interactive pool runs worse tiers only in short slices
        why += f"; prefill workers busy with worse tiers, decode worker prefills {uncached} tokens"
    elif prefills and decode.beat.data_port:
        prefill = min(prefills, key=lambda w: (not w.beat.device.startswith("cuda"), w.holds_worse_than(tier),
                                               -cached.get(w.id, 0), w.load(), w.id))
        have = cached.get(prefill.id, 0)
        why += f"; prefill on {prefill.id} ({prefill.beat.device})"
    else:
        why += "; decode worker prefills"
    at = (prefill or decode).id if have else ""
    if cached.get(POOL, 0) > have:
        have, at = cached[POOL], POOL
    return RoutePlan(request_id=req.request_id, prefill_worker=prefill.id if prefill else None,
                     decode_worker=decode.id, decode_role=decode.role, reason=why,
                     decode_data_host=decode.beat.data_host, decode_data_port=decode.beat.data_port,
                     tier=tier, session_id=req.session_id, cached_tokens=have, cached_at=at)


def _busy_ring(tier: str, context: int, decoders: list[WorkerView], pool: list[PoolWorker]) -> None:
    """Raise BusError("overloaded") when only a ring holds ``context`` and one would, were its
    workers' KV free (their requests end, a lost ring's shards are released): retry later, not
    "prompt too long"."""
    if not pool or max(w.beat.max_context for w in decoders) >= context:
        return
    try:
        strategy, _ = choose(tier, context, _empty(_strategists(decoders)))
    except NoCapacity:
        return
    if strategy.kind == RING:
        raise BusError("overloaded", f"a {strategy} holds {context} tokens, but its workers' KV is in use now "
                                     f"(free tokens: {', '.join(f'{p.id} {p.free_tokens}' for p in pool)}); retry later",
                       retry_after=1.0)


def strategy_of(plan: RoutePlan) -> str:
    """A single-worker plan's strategy: its decode pool's."""
    return GPU if plan.decode_role == subjects.GPU_DECODE else CPU


def _strategists(views: list[WorkerView]) -> list[WorkerView]:
    """The decode workers a strategy may use: gpu-decode, and cpu-decode workers hosting ring members."""
    return [w for w in views if w.role in subjects.DECODE_ROLES and w.beat.kv_block_tokens
            and (w.role == subjects.GPU_DECODE or w.beat.ring_port)]


def _empty(views: list[WorkerView]) -> list[PoolWorker]:
    """``views`` as the policy sees them with all their KV free."""
    return [PoolWorker(w.id, w.role, w.beat.total_kv_blocks * w.beat.kv_block_tokens, w.beat.max_context)
            for w in views]


def _prefills(views: list[WorkerView], req: RouteRequest) -> list[WorkerView]:
    """The prefill workers of ``views`` that hold ``req``'s prompt and take part in a ring (a data plane)."""
    return [w for w in views if w.role == subjects.PREFILL and w.beat.max_context > req.num_prompt_tokens
            and w.beat.data_port]


def _ring_later(req: RouteRequest, tier: str, context: int, ready: list[WorkerView], later: list[WorkerView],
                now: float) -> None:
    """Raise BusError("unavailable") when no worker ready now (``ready``), busy or not, holds
    ``context`` but those with some of ``later`` would — a ring member or the gpu-decode worker
    restarting, a member lost a moment ago whose replacement is starting: wait for them, not
    "prompt too long"."""
    back = _strategists(later)
    if not back:
        return
    try:   # the ready ones would hold it once their KV frees (busy, not missing): it queues as before
        choose(tier, context, _empty(_strategists(ready)))
        return
    except (NoCapacity, ValueError):
        pass
    try:
        strategy, _ = choose(tier, context, _empty(_strategists(ready) + back))
    except (NoCapacity, ValueError):
        return
    if strategy.kind == RING and not _prefills([*ready, *later], req):
        return  # nothing would compute its prompt either
    what = f"a {strategy}" if strategy.kind == RING else f"a {strategy.kind}-decode worker"
    raise BusError("unavailable", f"no ready decode worker, nor a ring of them, holds {context} tokens "
                                  f"({req.num_prompt_tokens} in the prompt, up to {req.max_tokens} more); {what} "
                                  f"would once {_not_ready(back, subjects.DECODE_ROLES, now)} is back")


def strategy_plan(req: RouteRequest, workers: list[WorkerView], now: float, policy: str = "sla",
                  session: SessionView | None = None, limits: Limits | None = None,
                  later: list[WorkerView] = ()) -> tuple[RoutePlan | None, str]:
    """(a ``cpu-ring(N)`` plan, why) when ``choose`` picks a ring for this request — no single
    worker holds its prospective context and a ring of cpu-decode workers that host ring members
    does, with a prefill worker to compute the prompt — else (None, why: ``place`` decides).
    Raises BusError("overloaded") when the tier's queue is full or only a ring of busy workers
    holds it, BusError("unavailable") when only workers of ``later`` (heard from lately, not
    ready now) would complete one."""
    if policy != "sla":
        return None, ""
    tier = effective_tier(req.tier, session)
    decoders = _decoders(workers, now)
    pool = [PoolWorker(w.id, w.role, w.beat.free_kv_blocks * w.beat.kv_block_tokens, w.beat.max_context)
            for w in _strategists(decoders)]
    context = req.num_prompt_tokens + req.max_tokens
    try:
        strategy, why = choose(tier, context, pool)
    except (NoCapacity, ValueError) as e:
        _busy_ring(tier, context, decoders, pool)
        _ring_later(req, tier, context, [w for w in workers if w.alive(now)], later, now)
        return None, str(e)
    if strategy.kind != RING:
        return None, why
    # a busy worker of a pool the tier prefers to a ring frees its KV as its requests end: it queues there
    singles = [w for w in decoders if tier == Tier.INTERACTIVE or w.role == subjects.CPU_DECODE]
    longest = max((w.beat.max_context for w in singles), default=0)
    if longest >= context:
        return None, f"{why}, but {longest} tokens fit one worker once its KV frees: no ring"
    prefills = _prefills([w for w in workers if w.alive(now)], req)
    if not prefills:
        back = _prefills(later, req)
        if back:   # the prefill worker is restarting (or was lost a moment ago): wait for it
            raise BusError("unavailable", f"{why}, but no prefill worker is ready to compute its "
                                          f"{req.num_prompt_tokens}-token prompt until "
                                          f"{_not_ready(back, (subjects.PREFILL,), now)} is")
        return None, f"{why}; no prefill worker holds the {req.num_prompt_tokens}-token prompt for a ring"
    limits = limits or Limits()
    admit(req, tier, decoders, limits.queue[tier])
    by_id = {w.id: w for w in decoders}
    members = [by_id[i] for i in strategy.workers]
    prefill = min(prefills, key=lambda w: (not w.beat.device.startswith("cuda"), w.load(), w.id))
    head = members[0]
    plan = RoutePlan(request_id=req.request_id, prefill_worker=prefill.id, decode_worker=head.id,
                     decode_role=head.role, reason=f"{why}; prefill on {prefill.id}; coordinator {head.id}",
                     decode_data_host=head.beat.data_host, decode_data_port=head.beat.data_port, tier=tier,
                     session_id=req.session_id, strategy=str(strategy),
                     ring=[RingPeer(w.id, w.beat.data_host, w.beat.ring_port) for w in members])
    return plan, why


def ring_room(views: list[WorkerView]) -> tuple[int, int]:
    """(members, tokens): the longest context a ring of the cpu-decode workers of ``views`` that
    host ring members would hold with all their KV free; (0, 0) when they make no ring."""
    cpus = [p for p in _empty(_strategists(views)) if p.role == subjects.CPU_DECODE]
    lo, hi = 0, sum(p.free_tokens for p in cpus)
    while lo < hi:   # the largest context a ring holds (a ring that holds n tokens holds fewer)
        mid = (lo + hi + 1) // 2
        if smallest_ring(cpus, mid, MAX_RING) is None:
            hi = mid - 1
        else:
            lo = mid
    ring = smallest_ring(cpus, lo, MAX_RING) if lo else None
    return (len(ring), lo) if ring else (0, 0)


def _too_long(req: RouteRequest, ready: list[WorkerView]) -> tuple[str, str]:
    """Why no ready decode worker, nor a ring of them, takes the request, with what would fit; and
    the field at fault: max_tokens where a ring would take the prompt with fewer, else the prompt."""
    longest = max((w.beat.max_context for w in ready if w.role in subjects.DECODE_ROLES), default=0)
    msg = (f"a prompt of {req.num_prompt_tokens} tokens does not fit: the longest context of a ready decode "
           f"worker is {longest} tokens")
    members, room = ring_room(ready) if _prefills(ready, req) else (0, 0)
    if room:
        msg += (f", and a ring of {members} cpu-decode workers holds {room} tokens, for the prompt and up to "
                f"max_tokens ({req.max_tokens}) more")
        if room > req.num_prompt_tokens:
            return msg + f": ask for at most {room - req.num_prompt_tokens} tokens (max_tokens)", "max_tokens"
    return msg, "prompt"


def _later(workers: list[WorkerView], exclude: set[str], now: float) -> list[WorkerView]:
    """The workers of ``workers`` not ready now or excluded for this request that may be back in
    seconds: each stands for itself restarting or for its replacement — unless a worker of its
    role came up after its last heartbeat (that one is its replacement, or new capacity: counted
    once, ready). A worker that said it is stopping (``draining``) counts too: a restart (a rolling
    update, the supervisor) brings it back as a new worker within seconds, a scale-down never — the
    router cannot tell them apart, and a wait then a 503 is the lesser harm than a 400 for a
    request its replacement would have served."""
    up = [w for w in workers if w.alive(now) and w.id not in exclude]
    out = []
    for gone in sorted((w for w in workers if not w.alive(now) or w.id in exclude), key=lambda w: w.seen):
        successor = next((w for w in sorted(up, key=lambda w: w.since) if w.role == gone.role and w.since > gone.seen),
                         None)
        if successor is None:
            out.append(gone)
        else:
            up.remove(successor)
    return out


def decide(req: RouteRequest, workers: list[WorkerView], now: float, policy: str = "sla", turn: int = 0,
           cached: dict[str, int] | None = None, session: SessionView | None = None,
           limits: Limits | None = None, chunk_tokens: int = 256) -> RoutePlan:
    """The router's one decision for a request: its strategy (gpu, cpu or cpu-ring(N)) and where
    it runs. A ring when ``strategy_plan`` finds one (no single worker holds the prospective
    context), else ``place`` picks the single decode worker (and a prefill worker), the plan's
    strategy its pool's; why no ring is in the reason. ``workers``: every worker the router
    heard from lately — those of ``req.exclude`` (found gone for this request) are not used, and
    they and those not ready now count as capacity that may be back in seconds (a restarting
    worker, the replacement of one just lost — whose heartbeats may not have lapsed yet:
    "unavailable", the gateway waits, rather than "prompt too long"). Pure: the caller keeps
    ``turn``. Raises what ``strategy_plan`` and ``place`` raise."""
    exclude = set(req.exclude)
    later = _later(workers, exclude, now)
    usable = [w for w in workers if w.id not in exclude]
    plan, why = strategy_plan(req, usable, now, policy, session, limits, later=later)
    if plan is not None:
        return plan
    try:
        plan = place(req, usable, now, policy, turn, cached=cached, session=session, limits=limits,
                     chunk_tokens=chunk_tokens, later=later)
    except BusError as e:
        if e.code != "prompt_too_long" or policy != "sla":
            raise
        msg, param = _too_long(req, [w for w in usable if w.alive(now)])
        raise BusError("prompt_too_long", msg, param=param) from None
    plan.strategy = strategy_of(plan)
    if why:
        plan.reason += f"; strategy {plan.strategy} ({why})"
    return plan


def kv_need(view: WorkerView) -> int:
    """Tokens of KV the running single-worker requests of a worker's heartbeat may still take
    before they end (block-rounded: each grows to prompt + max_tokens); a ring session's blocks
    were reserved for its whole range at admission."""
    bt = view.beat.kv_block_tokens
    if not bt:
        return 0
    return sum((-(-end // bt) - -(-now // bt)) * bt for now, end, members in view.beat.kv_tokens.values()
               if members == 1 and end > now)


def spread(workers: list[WorkerView], now: float, moving: set[str] = frozenset(),
           max_members: int = MAX_RING) -> list[Move]:
    """Spreading under KV pressure (docs/strategies.md): a cpu-decode worker whose free KV is
    below what its running requests may still need (``kv_need``: they would preempt each other,
    recomputing) spreads its longest running batch or standard request onto the smallest ring of
    other cpu-decode workers that holds the request's whole length in the KV they can spare (free
    less their own need) — a MigrateRequest naming the ring. Never an interactive request (a ring
    step is slower), one already on a ring, one in ``moving``, nor onto a worker that is short
    itself or already taken by another spread now. One request per short worker and call."""
    live = [w for w in _decoders(workers, now) if w.role == subjects.CPU_DECODE and w.beat.kv_block_tokens]
    spare = {w.id: w.beat.free_kv_blocks * w.beat.kv_block_tokens - kv_need(w) for w in live}
    moves: list[Move] = []
    taken: set[str] = set()
    for w in sorted(live, key=lambda v: (spare[v.id], v.id)):
        if spare[w.id] >= 0 or w.id in taken:
            continue
        tiers = {r.request_id: r.tier for r in w.held()}
        sessions = {r.request_id: r.session_id for r in w.held()}
        cands = [(now_, end, rid) for rid, (now_, end, members) in w.beat.kv_tokens.items()
                 if members == 1 and rid not in moving and tiers.get(rid) in (Tier.STANDARD, Tier.BATCH)]
        if not cands:
            continue
        tokens, end, rid = max(cands)
        pool = [PoolWorker(v.id, v.role, spare[v.id], v.beat.max_context) for v in live
                if v.id != w.id and v.id not in taken and v.beat.ring_port and spare[v.id] > 0]
        members = smallest_ring(pool, end, max_members)
        if members is None:
            continue
        by_id = {v.id: v for v in live}
        ring = [by_id[m.id] for m in members]
        taken.update(m.id for m in members)
        taken.add(w.id)
        moves.append(Move(rid, sessions.get(rid, ""), w.id, ring[0], tiers[rid],
                          f"spread: {w.id} has {w.beat.free_kv_blocks * w.beat.kv_block_tokens} tokens of KV free, "
                          f"its requests may need {kv_need(w)}; {rid} ({tokens} of up to {end} tokens) onto "
                          f"cpu-ring({len(ring)}) {[v.id for v in ring]}", ring))
    return moves


def evacuate(workers: list[WorkerView], now: float, moving: set[str] = frozenset()) -> list[Move]:
    """Moves out of the decode workers that are stopping (``Heartbeat.draining``): each request
    one holds, to the least loaded ready decode worker of its role that holds its whole context
    (prompt and max_tokens) and has the KV for what it has now — of the other decode role when
    none of its own does (a stream that goes on slower beats one cut and resumed). Requests in
    ``moving``, rings (their members hold shards too) and requests not running yet (queued in the
    engine: no KV to move; a later call moves them) are left alone: what is not moved finishes on
    the stopping worker, or is cut when its drain ends and resumed by its gateway."""
    live = _decoders(workers, now)
    taken: dict[str, int] = {}       # target id -> KV tokens planned onto it here
    moves: list[Move] = []

    def room(v: WorkerView) -> int:
        return v.beat.free_kv_blocks * v.beat.kv_block_tokens - taken.get(v.id, 0)

    def load(v: WorkerView) -> int:
        return v.load() + sum(m.target is v for m in moves)

    for w in workers:
        if not w.beat.draining or w.role not in subjects.DECODE_ROLES or not fresh(w.seen, w.beat.interval, now):
            continue
        for r in w.beat.requests:
            kv = w.beat.kv_tokens.get(r.request_id)
            if kv is None or r.request_id in moving or kv[2] > 1:
                continue   # not running yet (moved once it is: a later tick), moving, or a ring
            has, end = kv[0], kv[1]
            fits = [v for v in live if v.beat.max_context >= end and room(v) >= has]
            pool = [v for v in fits if v.role == w.role] or fits
            if not pool:
                continue
            t = min(pool, key=lambda v: (load(v), -room(v), v.id))
            taken[t.id] = taken.get(t.id, 0) + has
            moves.append(Move(r.request_id, r.session_id, w.id, t, r.tier, f"evacuate: {w.id} is stopping",
                              tokens=has))
    return moves


def with_moves(views: list[WorkerView], moves: list[Move], now: float) -> list[WorkerView]:
    """``views`` with each move under way (``moves``) counted on its target as a request routed
    there — a sequence slot, its KV — until the target's heartbeat lists it: a move takes 0.4–2 s,
    the router plans every interval, and the next plan saw the room the first was filling (a
    worker of 4 slots ran 5 for half a second)."""
    out = []
    for v in views:
        listed = {r.request_id for r in v.beat.requests}
        mine = [m for m in moves if m.target.id == v.id != m.source and m.request_id not in listed]
        if mine:
            bt = v.beat.kv_block_tokens
            blocks = sum(-(-m.tokens // bt) for m in mine) if bt else 0
            v = WorkerView(dataclasses.replace(v.beat, free_kv_blocks=max(0, v.beat.free_kv_blocks - blocks)),
                           v.seen, [*v.routed, *([m.request_id, m.session_id, m.tier, now, ""] for m in mine)],
                           v.since)
        out.append(v)
    return out


def homecoming(workers: list[WorkerView], now: float, moving: set[str] = frozenset(),
               sessions: dict[str, SessionView] | None = None) -> list[Move]:
    """Requests running outside their tier's pool go home once a worker there is ready with room:
    a free sequence slot, nothing of their tier waiting there, the request's whole context
    (prompt and max_tokens) and the KV it has now. That is an interactive request on cpu-decode
    (placed there while no gpu-decode worker had a slot or was ready, or moved there off a
    stopping one: ``evacuate``), and a request whose *session* was set to standard or batch that
    runs on gpu-decode (re-tiered in place there while no cpu-decode worker had room): not a
    standard or batch request that overflowed onto the GPU pool by itself — that is the GPU
    engine's to preempt (its scheduler does when interactive work comes). Its tier is its
    session's where the session has one (``sessions``). Only with at least ``HOME_MIN_TOKENS`` of
    its output left (a move costs a step boundary and the KV's transfer), most tokens left first;
    rings and requests in ``moving`` stay."""
    live = _decoders(workers, now)
    taken: dict[str, list[int]] = {}    # target id -> [sequences, KV tokens] planned onto it here

    def fits(v: WorkerView, tier: str, has: int, end: int) -> bool:
        b, (n, kv) = v.beat, taken.get(v.id, [0, 0])
        slots = b.max_running == 0 or b.running + b.queue_depth + len(v.routed) + n < b.max_running
        return (slots and not v.waiting(tier) and b.max_context >= end
                and b.free_kv_blocks * b.kv_block_tokens - kv >= has)

    cands = []
    for w in live:
        for r in w.beat.requests:
            kv = w.beat.kv_tokens.get(r.request_id)
            s = (sessions or {}).get(r.session_id) if r.session_id else None
            set_tier = s.tier if s is not None else None
            tier = set_tier or r.tier
            home = POOLS[tier][0]
            if w.role == home or w.role not in (subjects.CPU_DECODE, subjects.GPU_DECODE) or \
                    (tier != Tier.INTERACTIVE and set_tier is None):
                continue   # at home, or standard/batch work that overflowed by itself
            if kv is not None and kv[2] == 1 and r.request_id not in moving and kv[1] - kv[0] >= HOME_MIN_TOKENS:
                cands.append((kv[0] - kv[1], r.request_id, r, w, kv[0], kv[1], tier, home))
    moves: list[Move] = []
    for _, rid, r, w, has, end, tier, home in sorted(cands, key=lambda c: c[:2]):
        pool = [v for v in live if v.role == home and fits(v, tier, has, end)]
        if not pool:
            continue
        t = min(pool, key=lambda v: (v.load() + taken.get(v.id, [0])[0], -v.beat.free_kv_blocks, v.id))
        n, kv = taken.get(t.id, [0, 0])
        taken[t.id] = [n + 1, kv + has]
        kind = "promote" if home == subjects.GPU_DECODE else "demote"
        moves.append(Move(rid, r.session_id, w.id, t, tier,
                          f"{kind}: {rid} is {tier} and {t.id} has room again ({end - has} tokens left)",
                          tokens=has))
    return moves


def rebalance(workers: list[WorkerView], sessions: dict[str, SessionView], now: float,
              limits: Limits | None = None, moving: set[str] = frozenset(),
              pressure: bool = True, grace_s: float = 0.0) -> list[Move]:
    """Moves to make now: requests running at another tier than their session's, whose new tier
    wants the other pool (promotion to GPU decode, demotion to CPU decode), and — with ``pressure``
    (the router's tick) — the lowest-tier request of a GPU worker short of free KV blocks, to the
    CPU worker with the most free blocks, interactive requests on cpu-decode back to a gpu-decode
    worker with room (``homecoming``), and a cpu-decode worker's longest request spread onto a
    ring when it is short of KV (``spread``). Requests in
    ``moving`` are left alone, and so are sessions whose tier changed less than ``grace_s`` ago
    (the router copy that took the change moves them; the leader's tick only follows up). Also
    lapses idle sessions' tier overrides (mutates ``sessions``)."""
    limits = limits or Limits()
    for s in sessions.values():
        if s.tier is not None and now - s.last > limits.session_idle_s:
            s.tier = None
    live = _decoders(workers, now)
    moves: list[Move] = []
    taken: dict[str, int] = {}          # target id -> moves planned onto it here

    def target(role: str, tier: str) -> WorkerView | None:
        """The least loaded ready worker of ``role`` with a sequence slot free for a request moved
        in (an import runs at once: past the slots, nothing would preempt to make room — a probe
        saw 6 running on a worker of 4) and none of ``tier`` waiting; None when none has."""
        def room(w: WorkerView) -> bool:
            b = w.beat
            return not w.waiting(tier) and (not b.max_running or b.running + b.queue_depth + len(w.routed)
                                            + taken.get(w.id, 0) < b.max_running)
        pool = [w for w in live if w.role == role and room(w)]
        if not pool:
            return None
        return min(pool, key=lambda w: (w.load() + taken.get(w.id, 0), -w.beat.free_kv_blocks, w.id))

    for w in live:
        for r in w.held():
            rid, sid, tier = r.request_id, r.session_id, r.tier
            s = sessions.get(sid) if sid else None
            if rid in moving or s is None or s.tier is None or s.tier == tier or now - s.changed < grace_s:
                continue  # only a tier change moves a request (overflow placements stay put)
            want = POOLS[s.tier][0]
            if w.role == want:   # the pool fits: it runs at the new tier where it is
                moves.append(Move(rid, sid, w.id, w, s.tier, f"retier: session {sid} is {s.tier}"))
                continue
            t = target(want, s.tier)
            if t is None:        # no worker of that pool ready with room: at the new tier where it is
                # (an interactive one goes to the GPU pool once a worker there has room: homecoming)
                moves.append(Move(rid, sid, w.id, w, s.tier, f"retier: session {sid} is {s.tier}; no {want} "
                                                             "worker has room for it now"))
                continue
            taken[t.id] = taken.get(t.id, 0) + 1
            kind = "promote" if want == subjects.GPU_DECODE else "demote"
            moves.append(Move(rid, sid, w.id, t, s.tier, f"{kind}: session {sid} is {s.tier}"))
    if pressure:
        planned = {m.request_id for m in moves}
        for w in live:
            if w.role != subjects.GPU_DECODE or not w.beat.total_kv_blocks:
                continue
            free = w.beat.free_kv_blocks / w.beat.total_kv_blocks
            if free >= limits.pressure_free:
                continue
            cands = [(Tier(r.tier).priority, r.request_id, r.session_id, r.tier) for r in w.held()
                     if r.tier != Tier.INTERACTIVE and r.request_id not in moving and r.request_id not in planned]
            t = target(subjects.CPU_DECODE, Tier.BATCH) if cands else None
            if cands and t is not None:
                _, rid, sid, tier = max(cands)
                taken[t.id] = taken.get(t.id, 0) + 1
                moves.append(Move(rid, sid, w.id, t, tier, f"demote: {w.id} has {free:.0%} KV free"))
        planned = {m.request_id for m in moves}
        moves += homecoming([v for v in workers if v.id not in taken], now, set(moving) | planned, sessions)
        planned = {m.request_id for m in moves}
        busy = {m.source for m in moves} | set(taken) | {m.target.id for m in moves}
        moves += spread([v for v in workers if v.id not in busy], now, set(moving) | planned)
    return moves
