"""A worker's bookkeeping of its requests: Abort handling when a resume's new attempt arrives while
an older attempt's stream is still being cancelled (the engine knows only the request id, so
aborting there would end the new attempt too); what its heartbeats say ended. Fakes: no engine,
no bus; the real EngineWorker._on_abort, admit, hold, spawn and ended."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.worker import EngineWorker, Request, State
from shared.bus import BusError
from shared.schemas import Abort
from shared.settings import Settings


class FakeEngine:
    def __init__(self):
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def bare_worker() -> EngineWorker:
    w = EngineWorker.__new__(EngineWorker)  # the abort bookkeeping only: no model, no bus
    w.engine, w.requests, w.admitting, w.arriving, w.kv = FakeEngine(), {}, {}, {}, None
    w.settings = Settings()
    w._beat_held, w._taken, w._ended, w._beat_wake = set(), set(), {}, asyncio.Event()
    return w


def hold(w: EngineWorker, attempt: int, subject: str) -> None:
    """Attempt ``attempt`` of request "r" as admit leaves it (its stream not spawned yet)."""
    w.hold(Request("r", attempt=attempt, stream_subject=subject))


async def streaming_attempt_1(w: EngineWorker) -> asyncio.Event:
    """Attempt 1 held, its stream running (slow to cancel): set once it was cancelled."""
    hold(w, 1, "s1")
    cancelled = asyncio.Event()
    w.spawn("r", slow_to_cancel_stream(w, cancelled))
    await asyncio.sleep(0)
    return cancelled


async def slow_to_cancel_stream(w: EngineWorker, cancelled: asyncio.Event) -> None:
    """A stream task: cancelled, it takes a moment to close; its output stream, closed early,
    aborts the request in the engine (as AsyncEngine's stream does)."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        cancelled.set()
        await w.engine.abort("r")
        await asyncio.sleep(0.05)
        raise


def test_a_fencing_abort_spares_the_attempt_admitted_while_it_waited():
    async def go():
        w = bare_worker()
        cancelled = await streaming_attempt_1(w)
        fence = asyncio.create_task(w._on_abort(Abort(request_id="r", reason="resume", below_attempt=2)))
        await cancelled.wait()
        # meanwhile the resume's admission: held, then its stream task (as admit + spawn do)
        hold(w, 2, "s2")
        w.spawn("r", asyncio.sleep(3600))
        await fence
        assert w.engine.aborted == ["r"]  # once, by the old stream; not again for the new attempt
        assert w.held["r"].attempt == 2 and not w.tasks["r"].done()
        assert not w.is_aborted("r", 2) and w.is_aborted("r", 1)
        w.tasks["r"].cancel()
    asyncio.run(go())


def test_an_abort_of_every_attempt_ends_the_request_and_refuses_a_late_admission():
    async def go():
        w = bare_worker()
        cancelled = await streaming_attempt_1(w)
        await w._on_abort(Abort(request_id="r", reason="client gone"))
        # dropped in the engine by the worker itself too, whether or not the stream got to do it
        # (a stream task cancelled before it ran never does): a second abort is a no-op there
        assert set(w.engine.aborted) == {"r"} and "r" not in w.held and cancelled.is_set()

        async def engine_add():
            return "admitted"
        coro = engine_add()
        with pytest.raises(BusError) as e:
            await w.admit(type("Req", (), {"request_id": "r"})(), coro, attempt=2)
        assert e.value.code == "not_found"
    asyncio.run(go())


def test_a_fence_for_a_request_not_held_here_leaves_the_engine_alone():
    """The resume's new attempt is being admitted here while the fence for the old one (which
    ran elsewhere) arrives: the engine, which knows only the id, must not abort it."""
    async def go():
        w = bare_worker()
        await w._on_abort(Abort(request_id="r", reason="resume", below_attempt=1))
        assert w.engine.aborted == [] and w.is_aborted("r", 0) and not w.is_aborted("r", 1)

        async def engine_add():
            return "admitted"
        req = type("Req", (), {"request_id": "r", "tier": "batch", "stream_subject": "s", "session_id": "",
                               "origin": ""})()
        assert await w.admit(req, engine_add(), attempt=1) == "admitted"
        assert w.engine.aborted == [] and w.held["r"].attempt == 1
        # an older attempt admitted late finds itself fenced: refused before the engine takes it
        with pytest.raises(BusError):
            coro = engine_add()
            await w.admit(req, coro, attempt=0)
    asyncio.run(go())


def test_a_superseded_attempt_whose_stream_never_ran_is_dropped_in_the_engine():
    """A resume supersedes an attempt whose stream task was spawned but had not run yet: cancelled,
    it never closes its engine stream, so nothing but the worker drops it in the engine (it once
    stayed there, its stream still registered: the resume could not open one)."""
    async def go():
        w = bare_worker()
        hold(w, 1, "s1")
        ran = []

        async def stream() -> None:
            ran.append(True)
            await asyncio.sleep(3600)
        w.spawn("r", stream())                      # not run yet: no await since
        await w._on_abort(Abort(request_id="r", reason="superseded by a resume", below_attempt=2))
        assert not ran and w.engine.aborted == ["r"] and "r" not in w.held and "r" not in w.tasks
    asyncio.run(go())


def test_a_hand_off_its_receiver_dropped_ends_as_an_abort_not_an_error():
    """A client that left during the prefill → decode hand-off: the decode worker discards the KV
    (or answers the DecodeRequest not_found). The prefill logged that as a failure with a
    traceback, retried the bytes on another path, counted it an error and sent an ErrorReply."""
    from services.prefill import dropped_in_hand_off
    from shared import metrics
    from shared.bus import RemoteError
    from shared.engine.sampling import RequestOutput
    from shared.transfer import Discarded, TransferError
    from services.worker import Aborted

    assert dropped_in_hand_off(Discarded("receiver refused: transfer r-0 was discarded", "r-0"))
    assert dropped_in_hand_off(RemoteError("not_found", "request r was aborted"))
    assert not dropped_in_hand_off(TransferError("connection lost"))
    assert not dropped_in_hand_off(RemoteError("overloaded", "full"))
    assert not dropped_in_hand_off(BusError("unavailable", "no responders"))

    class Bus:
        def __init__(self):
            self.sent = []

        async def publish(self, subject, msg):
            self.sent.append(msg)

    async def go():
        w = bare_worker()
        w.role, w.worker_id, w.bus, w.tpot = "prefill", "prefill-t", Bus(), 0.0
        w.settings = Settings.from_env({})
        w.hold(Request("r", state=State.RUNNING, tier="batch", stream_subject="s", received=1.0))

        async def outputs():
            yield RequestOutput("r", [5], "x", finished=True, finish_reason="prefilled", num_output_tokens=1)

        async def on_parked(out):
            raise Aborted("r aborted during its hand-off to d (receiver refused: discarded)")

        count = lambda outcome: metrics.REQUESTS.labels("prefill", "batch", outcome)._value.get()  # noqa: E731
        before = {o: count(o) for o in ("aborted", "error", "parked")}
        await w.stream_outputs("r", "s", outputs(), 0, on_parked)
        assert {o: count(o) - before[o] for o in before} == {"aborted": 1, "error": 0, "parked": 0}
        assert len(w.bus.sent) == 1 and w.bus.sent[0].finish_reason is None   # the first token, no ErrorReply
        assert w.engine.aborted == ["r"] and w.requests["r"].state is State.ABORTED
    asyncio.run(go())


def test_heartbeats_list_what_ended_since_and_for_a_while(monkeypatch):
    """A request that ended between two beats (never in one), one a beat listed that ended since,
    one still running; ended ones stay listed for ``ENDED_S`` (a lost beat does not lose them),
    the newest ``ENDED_MAX``; an end wakes the beat; a new attempt of an ended id is held again."""
    import services.worker as worker_mod

    def age(w, s):  # the time since each end was first seen grows by s
        w._ended = {rid: t - s for rid, t in w._ended.items()}

    async def go():
        w = bare_worker()
        for rid in ("long", "listed"):
            w.hold(Request(rid))
            w.spawn(rid, asyncio.sleep(3600))
        assert w.ended(w.held) == [] and w._beat_held == {"long", "listed"}
        w.hold(Request("short"))                         # taken and done between two beats
        w.spawn("short", asyncio.sleep(0))
        w.requests["listed"].task.cancel()
        await asyncio.sleep(0.01)
        assert w._beat_wake.is_set()                     # an end brings the next beat forward
        assert sorted(w.ended(w.held)) == ["listed", "short"] and set(w.held) == {"long"}
        age(w, worker_mod.ENDED_S - 0.1)                 # a later beat still lists them ...
        assert sorted(w.ended(w.held)) == ["listed", "short"]
        w.hold(Request("short", attempt=1))              # ... but not one held again (a resume here)
        assert w.ended(w.held) == ["listed"]
        age(w, 0.2)
        assert w.ended(w.held) == []                     # ... until ENDED_S have passed
        monkeypatch.setattr(worker_mod, "ENDED_MAX", 2)
        w._ended = {f"e{i}": time.monotonic() for i in range(5)}
        assert w.ended(w.held) == ["e3", "e4"]
        w.requests["long"].task.cancel()
        w.requests["short"].task = None
        await asyncio.sleep(0.01)
    asyncio.run(go())
