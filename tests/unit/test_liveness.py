"""One liveness (shared/liveness.py): alive = a fresh heartbeat that says ready; gone = no fresh one."""

from __future__ import annotations

from shared import subjects
from shared.liveness import LIVENESS_FACTOR, Heartbeats, fresh
from shared.schemas import Heartbeat


def beat(worker: str, ready: bool = True, interval: float = 2.0) -> Heartbeat:
    return Heartbeat(worker, subjects.CPU_DECODE, "cpu", "m", ready, 0, 0, 10, 10, 4096, "127.0.0.1", 4000, 0.0,
                     interval=interval)


def test_a_heartbeat_vouches_for_factor_intervals_on_the_receivers_clock():
    assert fresh(100.0, 2.0, 100.0 + LIVENESS_FACTOR * 2.0)
    assert not fresh(100.0, 2.0, 100.0 + LIVENESS_FACTOR * 2.0 + 0.01)


def test_alive_gone_and_live():
    seen: list[str] = []
    hb = Heartbeats(bus=None, on_beat=lambda b, now: seen.append(b.worker_id))
    hb.seen(beat("a"), now=10.0)
    hb.seen(beat("b", ready=False), now=10.0)
    hb.seen(beat("c", interval=0.5), now=10.0)
    assert seen == ["a", "b", "c"]
    assert hb.alive("a", 12.0) and not hb.gone("a", 12.0)
    assert not hb.alive("b", 12.0) and not hb.gone("b", 12.0)   # not ready is not gone
    assert hb.gone("c", 12.0) and not hb.alive("c", 12.0)       # three missed intervals
    assert hb.gone("nobody", 12.0)
    assert [b.worker_id for b in hb.live(12.0)] == ["a"]
    assert hb.gone("a", 10.0 + LIVENESS_FACTOR * 2.0 + 1)
