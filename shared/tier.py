"""SLA tiers: the one list of them, each with its scheduling priority.

A request's tier (``X-Tandem-SLA``, the body's ``sla``/``tier``, or its API key's default) picks
its decode pool, its place in every queue, who is preempted first and how long its KV is kept
(docs/routing.md). On the wire and in settings a tier is its lowercase name; ``Tier`` is a
``StrEnum``, so a member compares equal to that name.
"""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    INTERACTIVE = "interactive"   # a person waits: GPU decode, first in every queue
    STANDARD = "standard"         # the default
    BATCH = "batch"               # throughput-tolerant (agent heartbeats): CPU decode, preempted first

    @property
    def priority(self) -> int:
        """Scheduler priority: lower runs first and is preempted last."""
        return _PRIORITY[self]

    @classmethod
    def parse(cls, value: object) -> "Tier":
        """The tier named ``value`` (case and surrounding blanks ignored); ValueError naming the choices."""
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"invalid SLA tier {value!r}: expected one of {', '.join(TIERS)}") from None

    @classmethod
    def of_priority(cls, priority: int) -> "Tier | None":
        return next((t for t in cls if t.priority == priority), None)


_PRIORITY = {Tier.INTERACTIVE: 0, Tier.STANDARD: 1, Tier.BATCH: 2}
TIERS: tuple[Tier, ...] = tuple(Tier)   # best first


def fair_share(queued: int, limit: int, owner: str, held: dict[str, int]) -> bool:
    """May one more request of ``owner`` (an API key's tenant) join a queue of ``queued`` requests
    whose limit is ``limit`` (``held``: owner -> its requests in that queue)? Under the limit, yes;
    at it, only while ``owner`` holds less than its share of the limit — the limit over the
    owners with requests queued, itself counted — and the queue is under twice the limit. A full
    queue refuses the keys that fill it, not a key with a request or two (one key's burst of
    interactive work answered every other interactive key 429 ``overloaded``)."""
    if queued < limit:
        return True
    if queued >= 2 * limit:
        return False
    owners = {o for o, n in held.items() if n > 0} | {owner}
    return held.get(owner, 0) < limit / len(owners)
