"""Sessions' KV kept resident between turns (docs/api.md, "A session's KV survives its tool pauses").

An agent's session (an ``X-Tandem-Session`` chat, a Responses conversation, a
``prompt_cache_key``) pauses between turns while its tool runs. When a turn finishes, the full
KV blocks of its sequence (prompt and reply) become **resident**: free for reuse, but not in the
block manager's free queue — a new request's blocks come from that queue first (other work's
cached blocks: batch work's first, ``BlockManager.release(evict_first)``), and only when it is
empty from the resident sessions, one session at a time, in ``eviction_order``: sessions idle
past the retention window first, then the worst tier (batch before standard before
interactive), then the longest idle. A session's next turn finds its blocks by their hashes as
any cached prefix (``match_prefix``) and takes them back.

An evicted session is **spilled**, not dropped: ``on_spill`` hears its tokens and blocks while
their KV is still in place (the engine reads them and the worker writes them to the KV pool's
tiers, RAM first: ``KVConnector``), then its blocks join the front of the free queue (still
hashed: found until reused). Its next turn loads the spilled prefix from the pool instead of
computing it.

Life cycle of a session here: Running (a turn in the engine) → Resident (between turns, its
blocks held) → Running again (its next turn took them) … → Spilled (evicted: its KV went to the
pool) or, past the window, still resident until evicted first.

Tags come from the worker (``tag``: request id → session, retention), set when it admits the
request and read on the engine thread when the request finishes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("tandem.engine")

RETENTIONS = ("in_memory", "24h")   # OpenAI's prompt_cache_retention values
TAGS_MAX = 4096   # tags live from admission to Engine.add (at most TANDEM_MAX_WAITING or so at once); a
                  # failed admission's stays until pushed out, oldest first


@dataclass
class Tag:
    """What the worker knows of a request's session when it admits it."""
    session: str                 # the session id
    retention: str = ""          # "" (the default, in_memory) | in_memory | 24h


@dataclass
class Resident:
    """One session's KV held between turns: the full blocks of its last finished turn."""
    tenant: str
    session: str
    priority: int                # the last turn's scheduler priority (its tier: lower is better)
    retention: str               # "" | in_memory | 24h
    blocks: list[int]            # its full blocks, in sequence order
    token_ids: list[int]         # the tokens their KV holds (len == blocks * block size)
    last_used: float             # clock() when its last turn finished

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.session)


def eviction_order(residents: list[Resident], now: float, window_s: float) -> list[Resident]:
    """Which resident sessions go first when blocks run out: idle past ``window_s`` first, then
    the worst tier (highest priority number), then the longest idle."""
    return sorted(residents, key=lambda r: (now - r.last_used <= window_s, -r.priority, r.last_used))


@dataclass
class Residency:
    """The resident sessions of one block manager (see the module doc)."""
    window_s: float                                   # retention window (seconds idle)
    clock: Callable[[], float] = time.monotonic
    sessions: dict[tuple[str, str], Resident] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)   # block -> residents holding it
    tags: dict[str, Tag] = field(default_factory=dict)   # request id -> its session (worker-set)
    on_spill: Callable[[Resident], None] | None = None   # an evicted session's KV, still in place
    evicted = 0                                        # sessions spilled to make room

    def tag(self, request_id: str, session: str, retention: str = "") -> None:
        """Called by the worker (any thread) when it admits a session's request."""
        if retention and retention not in RETENTIONS:
            raise ValueError(f"prompt_cache_retention must be one of {', '.join(RETENTIONS)}, got {retention!r}")
        if len(self.tags) >= TAGS_MAX:
            try:
                self.tags.pop(next(iter(self.tags)), None)
            except RuntimeError:   # the engine thread took one meanwhile: room enough
                pass
        self.tags[request_id] = Tag(session, retention)

    def untag(self, request_id: str) -> Tag | None:
        return self.tags.pop(request_id, None)


class ResidentBlocks:
    """The block manager's side: which free blocks are held, and eviction when the queue is empty.
    ``BlockManager`` calls ``hold_freed`` / ``take_back`` / ``evict`` / ``num_held_free``; the
    engine calls ``retain`` when a session's turn finishes."""

    def __init__(self, blocks, residency: Residency):
        self.bm = blocks                   # the BlockManager
        self.r = residency
        self.held_free = 0                 # held blocks with no reference (reusable on eviction)

    def is_held(self, b: int) -> bool:
        return b in self.r.held

    # -- the block manager's hooks ----------------------------------------------------------------
    def hold_freed(self, b: int) -> bool:
        """A block's last reference went: True when a resident session holds it (not queued)."""
        if b in self.r.held:
            self.held_free += 1
            return True
        return False

    def take_back(self, b: int) -> None:
        """A held free block gets a reference again (a session's next turn matched it)."""
        self.held_free -= 1

    def evict(self) -> bool:
        """Spill the first session in ``eviction_order`` holding a free block; False when none does.
        (A block two sessions hold — a shared prefix — is freed with the second.)"""
        r = self.r
        for victim in eviction_order(list(r.sessions.values()), r.clock(), r.window_s):
            if not any(self.bm.ref[b] == 0 for b in victim.blocks):
                continue   # every block in use (its next turn runs): evicting frees nothing
            if r.on_spill is not None:
                try:
                    r.on_spill(victim)
                except Exception:   # the pool is best effort: the blocks are reused regardless
                    log.exception("spilling session %s failed", victim.session)
            r.evicted += 1
            self._drop(victim, front=True)
            return True
        return False

    # -- the engine's side --------------------------------------------------------------------------
    def retain(self, tenant: str, session: str, priority: int, retention: str, blocks: list[int],
               token_ids: list[int]) -> None:
        """A session's turn finished with these full blocks (before they are released): hold them,
        instead of what the session held before."""
        r = self.r
        old = r.sessions.pop((tenant, session), None)
        res = Resident(tenant, session, priority, retention, list(blocks), list(token_ids), r.clock())
        for b in res.blocks:   # first the new hold, so blocks in both are never queued between
            n = r.held.get(b, 0)
            if n == 0 and self.bm.ref[b] == 0:   # a cached free block (in the queue): now held
                self.bm.free.remove(b)
                self.held_free += 1
            r.held[b] = n + 1
        if old is not None:
            self._drop(old, front=False)
        r.sessions[res.key] = res

    def _drop(self, res: Resident, front: bool) -> None:
        """Release a resident's hold; its blocks no one else holds go to the free queue (``front``:
        reused first — evicted; else last — replaced by a newer turn of the same session)."""
        self.r.sessions.pop(res.key, None)
        freed = []
        for b in res.blocks:
            n = self.r.held[b] - 1
            if n:
                self.r.held[b] = n
                continue
            del self.r.held[b]
            if self.bm.ref[b] == 0:
                self.held_free -= 1
                freed.append(b)
        if front:
            self.bm.free.extendleft(freed)     # the tail ends up first in line
        else:
            self.bm.free.extend(reversed(freed))


# ---- the engine's side (kept out of engine.py) -------------------------------------------------

def attach(engine, window_s: float) -> Residency | None:
    """Session retention for ``engine`` (``window_s`` > 0 and prefix caching on), else None. An
    evicted session's KV is read from its blocks and handed to ``engine.spill_hook`` (the worker's
    pool write-back) when one is set."""
    if window_s <= 0 or not engine.blocks.prefix_caching:
        return None
    residency = Residency(window_s)

    def spill(res: Resident) -> None:
        hook = engine.spill_hook
        if hook is not None and res.blocks:
            hook(res.token_ids, engine.read_blocks(res.blocks), res.tenant, res.retention, res.session)

    residency.on_spill = spill
    engine.blocks.resident = ResidentBlocks(engine.blocks, residency)
    return residency


def adopt(residency: Residency | None, seq) -> None:
    """``seq`` enters the engine: its session and retention from the worker's tag, when there is one."""
    tag = residency.untag(seq.request_id) if residency is not None else None
    if tag is not None:
        seq.session, seq.retention = tag.session, tag.retention or seq.retention


def finished(engine, seq) -> None:
    """A session's turn finished (before its blocks are released): its full blocks stay resident."""
    if engine.residency is None or not seq.session:
        return
    bs = engine.layout.block_size
    n = min(len(seq.block_hashes), seq.num_computed // bs)
    if n:
        engine.blocks.resident.retain(seq.tenant, seq.session, seq.priority, seq.retention,
                                      seq.block_table[:n], seq.token_ids[:n * bs])


def stats(residency: Residency | None) -> dict:
    """Heartbeat / metrics figures: sessions resident, their blocks, sessions spilled so far."""
    if residency is None:
        return {"sessions_resident": 0, "resident_blocks": 0, "sessions_evicted": 0}
    return {"sessions_resident": len(residency.sessions), "resident_blocks": len(residency.held),
            "sessions_evicted": residency.evicted}
