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
