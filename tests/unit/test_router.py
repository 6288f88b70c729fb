"""The placement policy (services/placement.py) as pure functions over tables of cases."""

from __future__ import annotations

import dataclasses
import time

import pytest

from shared.bus import BusError
from shared.schemas import Heartbeat, InFlight, RouteRequest
from services.placement import (POOL, Limits, SessionView, WorkerView, decide, evacuate, kv_need, place, rebalance,
                                ring_room, spread, strategy_plan)

NOW = 1000.0


def w(wid, role, *, queue=0, running=0, free=100, total=100, device="cpu", ctx=8192, seen=NOW, port=9000,
      waiting=None, tpot=0.0, requests=(), pending=None):
    beat = Heartbeat(worker_id=wid, role=role, device=device, model="m", ready=True, queue_depth=queue,
                     running=running, free_kv_blocks=free, total_kv_blocks=total, max_context=ctx,
                     data_host="127.0.0.1", data_port=port, ts=0.0, interval=1.0,
                     waiting_by_tier=waiting or {}, tpot_ms=tpot, requests=[InFlight(*r) for r in requests])
    routed = [[f"p-{tier}-{i}", "", tier, seen] for tier, n in (pending or {}).items() for i in range(n)]
    return WorkerView(beat, seen, routed)


def req(tier="standard", n=100, session=None, max_tokens=16):
    return RouteRequest(request_id="r1", model="m", tier=tier, session_id=session, num_prompt_tokens=n,
                        max_tokens=max_tokens)


GPU, CPU, CPU2 = w("g1", "gpu-decode", device="cuda:0"), w("c1", "cpu-decode"), w("c2", "cpu-decode", running=3)
PRE_CPU, PRE_GPU = w("p1", "prefill"), w("p2", "prefill", device="cuda:0", running=1)
BUSY_CPU = w("c1", "cpu-decode", running=4)


@pytest.mark.parametrize("tier,workers,cached,session,decode,prefill", [
    # the tier picks the pool
    ("interactive", [GPU, CPU], {}, None, "g1", None),
    ("standard", [GPU, CPU], {}, None, "c1", None),
    ("batch", [GPU, CPU], {}, None, "c1", None),
    ("interactive", [CPU], {}, None, "c1", None),                 # no GPU pool: fall back to CPU
    ("batch", [GPU], {}, None, "g1", None),                       # no CPU pool: fall back to GPU
    # batch overflows to an idle GPU, never while interactive work waits there
    ("batch", [GPU, BUSY_CPU], {}, None, "g1", None),
    ("batch", [w("g1", "gpu-decode", waiting={"interactive": 1}, queue=1), BUSY_CPU], {}, None, "c1", None),
    ("batch", [w("g1", "gpu-decode", running=3), BUSY_CPU], {}, None, "c1", None),  # GPU busy too
    # ... but never onto a gpu-decode engine on the host's CPU (no CUDA): it has no cores of its own
    ("batch", [w("g1", "gpu-decode"), BUSY_CPU], {}, None, "c1", None),
    ("standard", [w("g1", "gpu-decode"), w("c1", "cpu-decode", running=40)], {}, None, "c1", None),
    ("standard", [w("g9", "gpu-decode"), GPU, BUSY_CPU], {}, None, "g1", None),   # the CUDA one takes it
    ("standard", [w("g9", "gpu-decode")], {}, None, "g9", None),                  # no CPU pool: still served
    ("batch", [w("g9", "gpu-decode"), w("c1", "cpu-decode", running=1)], {}, SessionView(worker="g9"), "g9",
     None),                                                     # a session already there stays with its KV
    # an overflowed session stays with its KV on the GPU while that is not busier by more than the
    # affinity slack (2) and has no interactive work waiting
    ("batch", [GPU, w("c1", "cpu-decode", running=1)], {}, SessionView(worker="g1"), "g1", None),
    ("batch", [w("g1", "gpu-decode", running=2), CPU], {}, SessionView(worker="g1"), "g1", None),
    ("batch", [w("g1", "gpu-decode", running=3), CPU], {}, SessionView(worker="g1"), "c1", None),
    # a session at home on the CPU overflows only past the slack too (the GPU idle: at 4, not 3)
    ("batch", [GPU, w("c1", "cpu-decode", running=3)], {}, SessionView(worker="c1"), "c1", None),
    ("batch", [GPU, w("c1", "cpu-decode", running=4)], {}, SessionView(worker="c1"), "g1", None),
    ("batch", [w("g1", "gpu-decode", waiting={"interactive": 1}, queue=1), BUSY_CPU], {}, SessionView(worker="g1"),
     "c1", None),
    # load inside the pool
    ("standard", [CPU, CPU2], {}, None, "c1", None),              # least loaded wins
    ("standard", [CPU2, w("c3", "cpu-decode", running=3, free=200)], {}, None, "c3", None),  # tie: more free KV
    ("standard", [CPU, w("c2", "cpu-decode", pending={"batch": 2})], {}, None, "c1", None),  # routed, not yet beaten
    # cache overlap and session affinity
    ("standard", [CPU, w("c2", "cpu-decode", running=1)], {"c2": 512}, None, "c2", None),
    ("standard", [CPU, w("c2", "cpu-decode", running=5)], {"c2": 512}, None, "c1", None),  # holder too busy
    ("standard", [CPU, w("c2", "cpu-decode", running=2)], {}, SessionView(worker="c2"), "c2", None),
    ("standard", [CPU, w("c2", "cpu-decode", running=2)], {"c1": 256}, SessionView(worker="c2"), "c2", None),
    ("standard", [CPU, w("c2", "cpu-decode", running=9)], {}, SessionView(worker="c2"), "c1", None),
    ("batch", [GPU, CPU], {}, SessionView(tier="interactive", worker="c1"), "g1", None),  # promoted session
    # prefill: where it is fastest, unless the decode worker holds the prefix
    ("standard", [CPU, PRE_CPU], {}, None, "c1", "p1"),
    ("interactive", [GPU, PRE_CPU, PRE_GPU], {}, None, "g1", "p2"),
    ("standard", [CPU, PRE_CPU], {"c1": 256}, None, "c1", None),   # 100-token prompt: all cached but the tail
    ("standard", [CPU, PRE_CPU, w("p3", "prefill")], {"p3": 256}, None, "c1", "p3"),  # prefill holder
    ("standard", [CPU, w("p9", "prefill", seen=NOW - 10)], {}, None, "c1", None),   # stale heartbeat: gone
    ("standard", [CPU, w("c8", "cpu-decode", ctx=50)], {}, None, "c1", None),        # context too small
])
def test_placement_table(tier, workers, cached, session, decode, prefill):
    plan = place(req(tier), workers, NOW, cached=cached, session=session)
    assert (plan.decode_worker, plan.prefill_worker) == (decode, prefill), plan.reason
    assert plan.reason and plan.tier in ("interactive", "standard", "batch")


def test_plan_reports_the_cache_it_uses():
    plan = place(req(n=600), [CPU, w("c2", "cpu-decode")], NOW, cached={"c2": 512, POOL: 256})
    assert (plan.decode_worker, plan.cached_tokens, plan.cached_at) == ("c2", 512, "c2")
    plan = place(req(n=600), [CPU], NOW, cached={POOL: 512})
    assert (plan.cached_tokens, plan.cached_at) == (512, POOL)
    plan = place(req(n=600), [CPU], NOW)
    assert (plan.cached_tokens, plan.cached_at) == (0, "")


def test_session_tier_raises_the_request_tier_not_lowers_it():
    assert place(req("batch"), [GPU, CPU], NOW, session=SessionView(tier="interactive")).tier == "interactive"
    assert place(req("interactive"), [GPU, CPU], NOW, session=SessionView(tier="batch")).tier == "interactive"


def test_no_decode_worker_is_unavailable():
    with pytest.raises(BusError) as e:
        place(req(), [PRE_CPU], NOW)
    assert e.value.code == "unavailable"


def test_a_prompt_no_ready_worker_can_hold_is_too_long_not_unavailable():
    small = w("c1", "cpu-decode", ctx=2048)
    with pytest.raises(BusError) as e:
        place(req(n=3000), [small, PRE_CPU], NOW)
    assert e.value.code == "prompt_too_long" and e.value.status == 400 and "2048 tokens" in e.value.message
    assert place(req(n=2000), [small], NOW).decode_worker == "c1"


def test_full_tier_queue_is_overloaded_with_retry_after_and_other_tiers_pass():
    limits = Limits(queue={"interactive": 2, "standard": 4, "batch": 4})
    flooded = [w("c1", "cpu-decode", running=8, queue=4, waiting={"batch": 4}, tpot=50.0), GPU]
    with pytest.raises(BusError) as e:
        place(req("batch", max_tokens=64), flooded, NOW, limits=limits)
    assert e.value.code == "overloaded" and e.value.retry_after >= 1
    assert place(req("interactive"), flooded, NOW, limits=limits).decode_worker == "g1"
    assert place(req("standard"), flooded, NOW, limits=limits).decode_worker == "g1"  # overflow


def test_fifo_ignores_tiers():
    workers = [GPU, w("c1", "cpu-decode", running=1)]
    plans = [place(req(t), workers, NOW, "fifo") for t in ("interactive", "batch")]
    assert [(p.decode_worker, p.tier) for p in plans] == [("g1", "standard"), ("g1", "standard")]


BATCH_PRE = w("p1", "prefill", running=1, requests=[("rb", "s1", "batch")])


@pytest.mark.parametrize("tier,n,workers,cached,limits,prefill", [
    # a short interactive prompt does not queue behind a prefill worker's batch step: gpu-decode prefills it
    ("interactive", 100, [GPU, BATCH_PRE], {}, None, None),
    ("interactive", 100, [GPU, w("p1", "prefill", pending={"batch": 1})], {}, None, None),  # routed, not yet beaten
    ("interactive", 100, [GPU, w("p1", "prefill", requests=[("ri", "", "interactive")])], {}, None, "p1"),
    ("interactive", 100, [GPU, PRE_CPU], {}, None, "p1"),                         # idle prefill worker
    ("interactive", 600, [GPU, BATCH_PRE], {}, None, "p1"),                       # long prompt: prefill worker
    ("interactive", 600, [GPU, BATCH_PRE], {"pool": 512}, None, None),             # 88 uncached tokens
    ("interactive", 100, [GPU, BATCH_PRE], {}, Limits(local_prefill_tokens=0), "p1"),  # rule off
    ("interactive", 100, [GPU, BATCH_PRE, w("p3", "prefill", running=2)], {}, None, "p3"),  # a free one is left
    ("standard", 100, [CPU, BATCH_PRE], {}, None, "p1"),                          # only interactive skips
    ("interactive", 100, [CPU, BATCH_PRE], {}, None, "p1"),                       # no interactive pool
])
def test_interactive_prompt_skips_prefill_workers_busy_with_worse_tiers(tier, n, workers, cached, limits, prefill):
    plan = place(req(tier, n=n), workers, NOW, cached=cached, limits=limits)
    assert plan.prefill_worker == prefill, plan.reason
    if prefill is None:
        assert "prefill workers busy with worse tiers" in plan.reason


def test_round_robin_ignores_busy_prefill_workers():
    assert place(req("interactive"), [GPU, BATCH_PRE], NOW, "round-robin").prefill_worker == "p1"


def test_decode_without_data_plane_gets_no_prefill_worker():
    plan = place(req(), [w("c1", "cpu-decode", port=0), PRE_CPU], NOW)
    assert plan.prefill_worker is None


def test_round_robin_takes_every_decode_worker_in_turn():
    workers = [w("c2", "cpu-decode", running=9), w("c1", "cpu-decode"), GPU, PRE_CPU]
    picked = [place(req("standard"), workers, NOW, "round-robin", turn=t).decode_worker for t in range(6)]
    assert picked == ["c1", "c2", "g1", "c1", "c2", "g1"]  # by id, load and tier ignored


def test_round_robin_skips_dead_workers():
    workers = [w("c1", "cpu-decode"), w("c3", "cpu-decode", seen=NOW - 10)]
    assert {place(req(), workers, NOW, "round-robin", turn=t).decode_worker for t in range(4)} == {"c1"}


def test_round_robin_still_uses_a_prefill_worker():
    plan = place(req(), [CPU, PRE_CPU], NOW, "round-robin")
    assert (plan.decode_worker, plan.prefill_worker) == ("c1", "p1")


def test_unknown_policy_is_a_value_error():
    with pytest.raises(ValueError, match="policy"):
        place(req(), [CPU], NOW, "random")


# ---- rebalance: promotion, demotion, pressure -------------------------------------------------

def test_promotion_and_demotion_follow_the_session_tier():
    workers = [w("g1", "gpu-decode", requests=[("r-gpu", "s2", "interactive")]),
               w("c1", "cpu-decode", requests=[("r-cpu", "s1", "batch"), ("r-free", "", "batch")]),
               w("c2", "cpu-decode", running=3)]
    sessions = {"s1": SessionView(tier="interactive", last=NOW), "s2": SessionView(tier="batch", last=NOW)}
    moves = {m.request_id: (m.source, m.target.id, m.tier) for m in rebalance(workers, sessions, NOW)}
    assert moves == {"r-cpu": ("c1", "g1", "interactive"), "r-gpu": ("g1", "c1", "batch")}


def test_requests_routed_since_the_last_heartbeat_move_too():
    cpu = w("c1", "cpu-decode")
    cpu.routed.append(["r-new", "s1", "batch", NOW])   # routed a moment ago, not in a heartbeat yet
    moves = rebalance([GPU, cpu], {"s1": SessionView(tier="interactive", last=NOW)}, NOW)
    assert [(m.request_id, m.source, m.target.id) for m in moves] == [("r-new", "c1", "g1")]


def test_a_routed_request_outlives_a_heartbeat_built_before_it_arrived():
    cpu = w("c1", "cpu-decode")
    cpu.routed.append(["r-new", "s1", "batch", NOW])
    early = cpu.renewed(w("c1", "cpu-decode").beat, NOW + 0.1)       # the beat does not list it yet
    assert early.held() == [InFlight("r-new", "s1", "batch")] and early.load() == 1 and early.pending == {"batch": 1}
    listed = early.renewed(w("c1", "cpu-decode", running=1, requests=[("r-new", "s1", "batch")]).beat, NOW + 1.1)
    assert listed.routed == [] and listed.held() == [InFlight("r-new", "s1", "batch")] and listed.load() == 1
    gone = early.renewed(w("c1", "cpu-decode").beat, NOW + 1.1)       # finished before any beat listed it
    assert gone.held() == [] and gone.load() == 0
    ended = w("c1", "cpu-decode").beat
    ended.ended = ["r-new"]                                           # ... and a beat says so: gone at once
    assert cpu.renewed(ended, NOW + 0.1).routed == [] and cpu.renewed(ended, NOW + 0.1).load() == 0


def test_routed_requests_wait_only_past_the_worker_s_free_slots():
    cpu = w("c1", "cpu-decode", running=2, queue=0, pending={"batch": 3, "interactive": 1, "standard": 1})
    assert cpu.queued == {"batch": 3, "interactive": 1, "standard": 1}   # slots not said: all wait
    cpu.beat.max_running = 5                                  # 3 free: interactive, standard, one batch
    assert cpu.queued == {"batch": 2} and cpu.waiting("batch") == 2 and cpu.waiting("interactive") == 0
    cpu.beat.queue_depth, cpu.beat.waiting_by_tier = 1, {"standard": 1}   # one waits there already
    assert cpu.queued == {"batch": 3} and cpu.waiting("standard") == 1
    cpu.beat.max_running = 64
    assert cpu.queued == {} and cpu.load() == 2 + 1 + 5      # not a queue, but load all the same


def test_no_move_without_a_tier_change_or_while_moving():
    workers = [w("g1", "gpu-decode", requests=[("r1", "s1", "batch")]), CPU]   # batch overflowed to GPU
    assert rebalance(workers, {"s1": SessionView(tier="batch", last=NOW)}, NOW) == []
    workers = [GPU, w("c1", "cpu-decode", requests=[("r1", "s1", "batch")])]
    assert rebalance(workers, {"s1": SessionView(tier="interactive", last=NOW)}, NOW, moving={"r1"}) == []
    # no GPU worker to go to (or none with a slot): it runs at its session's tier where it is
    # (it kept the old one: a probe saw promoted sessions run as batch on cpu-decode while the GPU
    # worker restarted, and 6 promoted onto a 4-slot worker)
    alone = [w("c1", "cpu-decode", requests=[("r1", "s1", "batch")])]
    for gpus in ([], [w("g1", "gpu-decode", running=4, requests=[(f"i{i}", "", "interactive") for i in range(4)])]):
        for g in gpus:
            g.beat.max_running = 4
        moves = rebalance(alone + gpus, {"s1": SessionView(tier="interactive", last=NOW)}, NOW, pressure=False)
        assert [(m.request_id, m.kind, m.target.id, m.tier) for m in moves] == [("r1", "retier", "c1", "interactive")]
        assert "no gpu-decode worker has room" in moves[0].reason


def test_gpu_memory_pressure_demotes_the_lowest_tier_first():
    hot = w("g1", "gpu-decode", free=5, total=100,
            requests=[("ri", "", "interactive"), ("rs", "", "standard"), ("rb", "", "batch")])
    moves = rebalance([hot, CPU], {}, NOW)
    assert [(m.request_id, m.target.id) for m in moves] == [("rb", "c1")]
    assert rebalance([hot, CPU], {}, NOW, pressure=False) == []
    assert rebalance([w("g1", "gpu-decode", free=50, requests=[("rb", "", "batch")]), CPU], {}, NOW) == []


def test_idle_session_override_lapses():
    sessions = {"s1": SessionView(tier="interactive", last=NOW - 301)}
    workers = [GPU, w("c1", "cpu-decode", requests=[("r1", "s1", "batch")])]
    assert rebalance(workers, sessions, NOW, Limits(session_idle_s=300)) == []
    assert sessions["s1"].tier is None


def rw(wid, role="cpu-decode", *, free=80, ctx=1280, ring=7000, **kw):
    """A decode worker with KV blocks of 16 tokens, hosting ring members on ``ring`` (0: not)."""
    view = w(wid, role, free=free, total=80, ctx=ctx, **kw)
    view.beat.kv_block_tokens, view.beat.ring_port = 16, ring
    return view


RING3 = [rw("c1", free=80), rw("c2", free=79), rw("c3", free=78), w("p1", "prefill")]


@pytest.mark.parametrize("tier,n,max_tokens,workers,strategy,members", [
    # a context no worker holds (1,280 tokens each): the fewest members, the freest first
    ("batch", 3000, 64, RING3, "cpu-ring(3)", ["c1", "c2", "c3"]),
    ("batch", 2000, 64, RING3, "cpu-ring(2)", ["c1", "c2"]),
    ("standard", 2000, 64, RING3, "cpu-ring(2)", ["c1", "c2"]),
    ("interactive", 2000, 64, RING3, "cpu-ring(2)", ["c1", "c2"]),         # slow beats refused
    ("interactive", 2000, 64, [*RING3, rw("g1", "gpu-decode", free=400, ctx=6400, ring=0)], None, None),  # the GPU holds it
    ("batch", 2000, 64, [*RING3, rw("g1", "gpu-decode", free=400, ctx=6400, ring=0)], "cpu-ring(2)", ["c1", "c2"]),
    ("batch", 2000, 64, [*RING3, rw("g1", "gpu-decode", free=10, ctx=6400, ring=0)], "cpu-ring(2)", ["c1", "c2"]),
    # one worker holds it: no ring (place decides); also when it is only busy now
    ("batch", 1000, 64, RING3, None, None),
    ("batch", 1000, 64, [rw("c1", free=10), rw("c2", free=10), w("p1", "prefill")], None, None),
    # no ring possible: too few members with room, none hosting members, no prefill worker
    ("batch", 3000, 64, RING3[:2] + RING3[3:], None, None),
    ("batch", 2000, 64, [rw("c1", ring=0), rw("c2", ring=0), w("p1", "prefill")], None, None),
    ("batch", 2000, 64, RING3[:3], None, None),
    ("batch", 3000, 64, [rw("c1"), rw("c2"), rw("c3"), w("p1", "prefill", ctx=2048)], None, None),  # prompt too long there
])
def test_strategy_table(tier, n, max_tokens, workers, strategy, members):
    plan, why = strategy_plan(req(tier, n=n, max_tokens=max_tokens), workers, NOW)
    if strategy is None:
        assert plan is None, plan
        return
    assert plan.strategy == strategy and [m.worker for m in plan.ring] == members, why
    assert plan.decode_worker == members[0] and plan.prefill_worker == "p1"
    assert all([m.host, m.port] == ["127.0.0.1", 7000] for m in plan.ring)
    assert "no single worker holds" in plan.reason


def test_one_decision_gives_the_strategy_and_the_worker():
    """``decide``: the ring when no single worker holds the context, else ``place``'s worker with its
    pool's strategy and why no ring in the reason (the router calls nothing else)."""
    ring = decide(req("batch", n=3000), RING3, NOW)
    assert ring.strategy.startswith("cpu-ring(") and ring.ring and ring == strategy_plan(req("batch", n=3000),
                                                                                          RING3, NOW)[0]
    single = decide(req("batch", n=1000, max_tokens=64), RING3, NOW)
    assert single.strategy == "cpu" and not single.ring and single.decode_worker in ("c1", "c2", "c3")
    assert "; strategy cpu (" in single.reason
    gpu = decide(req("interactive"), [GPU, CPU], NOW)
    assert gpu.strategy == "gpu" and gpu.decode_worker == "g1"


def test_other_policies_never_plan_a_ring():
    assert strategy_plan(req("batch", n=3000), RING3, NOW, policy="round-robin")[0] is None


def test_a_ring_whose_workers_are_busy_now_is_overloaded_not_refused():
    busy = [rw("c1", free=10), rw("c2", free=10), rw("c3", free=80), w("p1", "prefill")]
    with pytest.raises(BusError) as e:
        strategy_plan(req("batch", n=3000), busy, NOW)
    assert e.value.code == "overloaded" and e.value.retry_after > 0
    # a context no ring of these workers could ever hold: place decides (and refuses it)
    assert strategy_plan(req("batch", n=5000), busy, NOW)[0] is None


GONE = NOW - 30.0   # a last heartbeat this long ago: the worker is not ready (dead, restarting)


def excluding(r, *ids):
    r.exclude = list(ids)
    return r


def refused(r, workers):
    with pytest.raises(BusError) as e:
        decide(r, workers, NOW)
    return e.value


def test_a_worker_not_ready_that_would_hold_the_request_is_waited_for_not_refused():
    """A restarting worker (or the replacement of one just lost) is capacity seconds away: the
    router answers "unavailable" — the gateway waits and routes again — where "prompt too long"
    would end the request for good. Workers excluded for this request (found gone by the gateway,
    their heartbeats lapsed or not yet) count for their replacement."""
    small, big = w("c1", "cpu-decode", ctx=2048), w("c2", "cpu-decode", ctx=8192, seen=GONE)
    e = refused(req(n=3000), [small, big])
    assert e.code == "unavailable" and "c2 (last heartbeat 30.0 s ago)" in e.message, e.message
    assert refused(excluding(req(n=3000), "c2"), [small, big]).code == "unavailable"
    assert refused(req(n=3000), [small]).code == "prompt_too_long"
    assert refused(excluding(req(n=3000), "c2"), [small, w("c2", "cpu-decode", ctx=8192)]).code == "unavailable"

    # a ring of 3 (1,280 tokens each) with a member restarting: no ring of the two ready ones holds 2,700
    c1, c2, c3, p1 = RING3
    dead3 = rw("c3", free=78, seen=GONE)
    e = refused(req("batch", n=2500, max_tokens=200), [c1, c2, dead3, p1])
    assert e.code == "unavailable" and "cpu-ring(3)" in e.message and "c3 (last heartbeat" in e.message, e.message
    for c3_now in (dead3, c3):   # its resume: c3 found gone, its heartbeat lapsed or not yet
        e = refused(excluding(req("batch", n=2500, max_tokens=200), "c3"), [c1, c2, c3_now, p1])
        assert e.code == "unavailable", e.message
    plan = decide(excluding(req("batch", n=2500, max_tokens=200), "c3"), [c1, c2, dead3, rw("c4", free=80), p1], NOW)
    assert {m.worker for m in plan.ring} == {"c1", "c2", "c4"}   # with the replacement
    # the replacement (up after c3's last heartbeat) is c3 again, not one more: a ring of 4 of
    # these would not hold 3,900 tokens either (3 x 1,280 make 3,840): refused, not waited for
    c4 = dataclasses.replace(rw("c4", free=80), since=GONE + 5.0)
    assert refused(req("batch", n=3800, max_tokens=100), [c1, c2, dead3, c4, p1]).code == "prompt_too_long"
    assert refused(req("batch", n=3800, max_tokens=100), [c1, c2, dead3, rw("c4", free=80), p1]).code == "unavailable"
    # a worker ready but busy (its KV in use) that holds the context once it frees: it queues there as
    # before, whatever worker died lately
    busy = rw("c1", free=10)
    plan = decide(req("batch", n=1000, max_tokens=64), [busy, dead3, p1], NOW)
    assert plan.decode_worker == "c1" and not plan.ring
    # a context no ring of all of them would hold: refused at once
    assert refused(req("batch", n=4000, max_tokens=16), [c1, c2, dead3, p1]).code == "prompt_too_long"
    # the prefill worker a ring needs is restarting
    e = refused(req("batch", n=2500, max_tokens=200), [c1, c2, c3, w("p1", "prefill", seen=GONE)])
    assert e.code == "unavailable" and "no prefill worker is ready" in e.message and "p1 (last" in e.message
    assert refused(req("batch", n=2500, max_tokens=200), [c1, c2, c3]).code == "prompt_too_long"


def test_prompt_too_long_says_what_a_ring_would_hold_and_the_max_tokens_that_fit():
    """Three workers of 1,280 tokens make a ring of 3,840: the refusal names it, and how many
    tokens to ask for where the prompt alone fits (a chat without max_tokens asks for the rest of
    the model's context)."""
    e = refused(req("batch", n=2042, max_tokens=6150), RING3)
    assert e.code == "prompt_too_long" and "longest context of a ready decode worker is 1280 tokens" in e.message
    assert "a ring of 3 cpu-decode workers holds 3840 tokens" in e.message
    assert "ask for at most 1798 tokens (max_tokens)" in e.message, e.message
    assert e.param == "max_tokens"                 # fewer tokens out would fit: the field at fault
    e = refused(req("batch", n=3900, max_tokens=16), RING3)
    assert "holds 3840 tokens" in e.message and "ask for" not in e.message
    assert e.param == "prompt"                     # the prompt alone does not fit
    assert "ring" not in refused(req("batch", n=2042, max_tokens=6150), RING3[:3]).message   # no prefill: no ring
    assert ring_room(RING3) == (3, 3840) and ring_room(RING3[:1]) == (0, 0)


# ---- spreading under KV pressure: a cpu-decode worker short of KV spreads onto a ring ----------

def sw(wid, free=80, kv=None, held=(), ring=7000, role="cpu-decode", **kw):
    """A cpu-decode worker (80 blocks of 16 tokens) whose heartbeat lists ``held`` requests
    ([id, session, tier]) with ``kv`` tokens ({id: [now, end, members]})."""
    view = rw(wid, role, free=free, ring=ring, requests=held, **kw)
    view.beat.kv_tokens = {k: list(v) for k, v in (kv or {}).items()}
    return view


# c1: 10 blocks (160 tokens) free; r1 grows 300 -> 1000 tokens (44 more blocks), r2 100 -> 200
SHORT = sw("c1", free=10, kv={"r1": [300, 1000, 1], "r2": [100, 200, 1]},
           held=[["r1", "s1", "batch"], ["r2", "", "standard"]])


def test_kv_need_counts_the_blocks_running_requests_may_still_take():
    assert kv_need(SHORT) == (63 - 19) * 16 + (13 - 7) * 16
    assert kv_need(sw("c2", kv={"r": [300, 1000, 3]})) == 0   # a ring session reserved its range at admission
    assert kv_need(sw("c2", kv={"r": [300, 300, 1]})) == 0


@pytest.mark.parametrize("workers,moving,want", [
    # short: the longest background request onto the smallest ring of the others, the freest first
    ([SHORT, sw("c2", free=40), sw("c3", free=50)], set(), ("r1", "s1", "batch", ["c3", "c2"])),
    # 1,000 tokens would fit c2 alone, but a spread is a ring (a move to one worker would be
    # short there again as the others grow): the two freest
    ([SHORT, sw("c2", free=80), sw("c3", free=50)], set(), ("r1", "s1", "batch", ["c2", "c3"])),
    # not short: the free KV covers what the requests may still take
    ([sw("c1", free=60, kv={"r1": [300, 1000, 1]}, held=[["r1", "", "batch"]]), sw("c2"), sw("c3")], set(), None),
    # interactive requests stay (a ring step is slower); the next longest background one goes
    ([sw("c1", free=10, kv={"r1": [300, 1000, 1], "r2": [100, 900, 1]},
         held=[["r1", "", "interactive"], ["r2", "", "standard"]]), sw("c2"), sw("c3")], set(),
     ("r2", None, "standard", None)),
    ([sw("c1", free=10, kv={"r1": [300, 1000, 1]}, held=[["r1", "", "interactive"]]), sw("c2"), sw("c3")], set(), None),
    # already a ring (its coordinator's heartbeat says 3 members), or moving now
    ([sw("c1", free=10, kv={"r1": [300, 1000, 3]}, held=[["r1", "", "batch"]]), sw("c2"), sw("c3")], set(), None),
    ([SHORT, sw("c2"), sw("c3")], {"r1"}, None),   # r2 (200 tokens: one segment) cannot be a ring
    # no room on a ring: the others are full, short themselves, or host no ring members
    ([SHORT, sw("c2", free=5), sw("c3", free=5)], set(), None),
    ([SHORT, sw("c2", free=40, kv={"x": [100, 1000, 1]}, held=[["x", "", "batch"]]),
      sw("c3", free=40, kv={"y": [100, 1000, 1]}, held=[["y", "", "batch"]])], set(), None),
    ([SHORT, sw("c2", ring=0), sw("c3", ring=0)], set(), None),
    # gpu-decode workers are never members (the GPU pool's pressure demotes instead)
    ([SHORT, sw("g1", role="gpu-decode", free=400)], set(), None),
])
def test_spread_table(workers, moving, want):
    moves = spread(workers, NOW, moving)
    if want is None:
        assert moves == []
        return
    (m,) = moves
    rid, sid, tier, members = want
    assert (m.request_id, m.source, m.tier) == (rid, "c1", tier)
    assert sid is None or m.session_id == sid
    assert members is None or [v.id for v in m.ring] == members
    assert m.target is m.ring[0] and m.kind == "spread" and m.strategy == f"cpu-ring({len(m.ring)})"
    assert "c1" not in [v.id for v in m.ring]


def test_two_short_workers_never_share_a_member_and_rebalance_spreads_under_pressure_only():
    short2 = sw("c4", free=10, kv={"q": [300, 1000, 1]}, held=[["q", "", "batch"]])
    workers = [SHORT, short2, sw("c2"), sw("c3"), sw("c5"), sw("c6")]
    moves = spread(workers, NOW)
    assert len(moves) == 2 and not {v.id for v in moves[0].ring} & {v.id for v in moves[1].ring}
    assert not any(v.id in ("c1", "c4") for m in moves for v in m.ring)
    assert [m.request_id for m in rebalance(workers, {}, NOW)] == ["r1", "q"] or \
        [m.request_id for m in rebalance(workers, {}, NOW)] == ["q", "r1"]
    assert rebalance(workers, {}, NOW, pressure=False) == []
    stale = [SHORT, sw("c2", seen=NOW - 10), sw("c3", seen=NOW - 10)]   # dead workers are no members
    assert spread(stale, NOW) == []


def test_a_sessions_next_turn_finds_its_last_prompt_and_reply_on_its_worker():
    """session_held: the last turn's prompt (same tenant, same tokens) at block granularity, while
    the prefix index still lists its whole chunks on the session's worker; then place() lets that
    decode worker prefill the rest itself (its prefix cache holds the reply too)."""
    from services.placement import context_digest, session_held
    last = list(range(300))
    s = SessionView(worker="c1")
    s.turn("c1", len(last), context_digest("t", last))
    now = last + list(range(1000, 1150))                              # the reply and a new message
    assert session_held(s, "t", now, {"c1": 256}, 256, 16) == ("c1", 288)   # 300 rounded down to the block
    assert session_held(s, "t", now, {}, 256, 16) == ("", 0)                 # its first chunk left the worker
    assert session_held(s, "u", now, {"c1": 256}, 256, 16) == ("", 0)        # another tenant (cache_salt)
    assert session_held(s, "t", [7] + now[1:], {"c1": 256}, 256, 16) == ("", 0)   # not a continuation
    assert session_held(s, "t", last, {"c1": 256}, 256, 16) == ("", 0)      # no longer than the last turn
    short = SessionView(worker="c1")
    short.turn("c1", 40, context_digest("t", now[:40]))
    assert session_held(short, "t", now, {}, 256, 16) == ("c1", 32)          # under a chunk: no index evidence needed
    prefill = w("p1", "prefill")
    r = dataclasses.replace(req(n=len(now), session="s1"), prompt_token_ids=now)
    plan = place(r, [CPU, prefill], NOW, session=s, cached={"c1": 288})
    assert plan.prefill_worker is None and plan.decode_worker == "c1" and plan.cached_tokens == 288
    assert place(r, [CPU, prefill], NOW, session=s, cached={}).prefill_worker == "p1"


def test_a_fork_of_an_earlier_turn_finds_that_turn_on_its_worker():
    """Two replies tried from one turn (two requests with one previous_response_id): the second
    fork continues the trunk's prompt, not the first fork's — the router keeps the session's
    last few turns, each with its worker (a move takes the running turn's along)."""
    from services.placement import CONTEXTS, context_digest, session_held
    trunk = list(range(300))
    fork_a, fork_b = trunk + list(range(1000, 1100)), trunk + list(range(2000, 2100))
    s = SessionView()
    s.turn("c1", len(trunk), context_digest("t", trunk))
    s.turn("c1", len(fork_a), context_digest("t", fork_a))
    assert session_held(s, "t", fork_b + [5], {"c1": 256}, 256, 16) == ("c1", 288)       # the trunk's
    assert session_held(s, "t", fork_a + [5], {"c1": 256}, 256, 16) == ("c1", 400)       # the longest match
    s.moved("c1", "c2")                       # fork a's turn moved to c2 with its KV; the trunk's stays on c1
    assert session_held(s, "t", fork_a + [5], {"c1": 256, "c2": 256}, 256, 16) == ("c2", 400)
    assert session_held(s, "t", fork_b + [5], {"c1": 256, "c2": 256}, 256, 16) == ("c1", 288)
    for i in range(1, CONTEXTS + 1):          # the oldest turns are forgotten
        s.turn("c3", 16 * i, context_digest("t", trunk[:16 * i]))
    assert len(s.contexts) == CONTEXTS
    assert session_held(s, "t", fork_b + [5], {"c1": 256}, 256, 16) == ("c3", 16 * CONTEXTS)


def test_retry_after_is_about_one_request_not_the_whole_queue():
    """A burst on a pool idle at its last heartbeat (running 0): 64 interactive requests of 4
    tokens waiting said Retry-After 60 for a queue that drained in under 10 s. Now one request's
    time (at least 1 s, at most 60), spread by up to half of it so refused clients do not return
    together."""
    limits = Limits(queue={"interactive": 64, "standard": 4, "batch": 4})
    idle = [w("g1", "gpu-decode", running=0, queue=64, waiting={"interactive": 64}, tpot=50.0)]
    seen = set()
    for _ in range(50):
        with pytest.raises(BusError) as e:
            place(req("interactive", max_tokens=4), idle, NOW, limits=limits)
        seen.add(e.value.retry_after)
    assert seen == {1.0}
    for _ in range(50):
        with pytest.raises(BusError) as e:
            place(req("interactive", max_tokens=1000), idle, NOW, limits=limits)   # 256 counted x 50 ms
        seen.add(e.value.retry_after)
    assert seen - {1.0} and all(13 <= s <= 20 for s in seen - {1.0}) and len(seen - {1.0}) > 1


def draining(view: WorkerView) -> WorkerView:
    """``view`` after the heartbeat a stopping worker sends: not ready, draining."""
    view.beat.ready, view.beat.draining = False, True
    return view


def test_a_stopping_worker_is_moved_out_of_and_waited_for():
    """A decode worker that said it is stopping: each request it runs goes to the least loaded
    ready worker of its role that holds its context and has the KV for it — of the other decode
    role when none of its own does —; rings, requests already moving and requests not running
    yet (queued: a later tick moves them) stay; and a prompt only it
    could hold waits for it (its restart, a rolling update's replacement) as for a worker that
    died: the router cannot tell a restart from a scale-down, and a 400 is for good."""
    src = draining(sw("c1", kv={"r1": [300, 1000, 1], "r2": [100, 200, 1], "r3": [500, 900, 3]},
                      held=[["r1", "s1", "batch"], ["r2", "", "standard"], ["r3", "", "batch"], ["r4", "", "batch"]]))
    idle, busy = sw("c2"), sw("c3", running=3)
    moves = evacuate([src, idle, busy], NOW)
    assert {m.request_id: m.target.id for m in moves} == {"r1": "c2", "r2": "c2"}   # r3: a ring; r4 not running
    assert all(m.source == "c1" and m.kind == "evacuate" for m in moves) and moves[0].session_id == "s1"
    assert moves[0].tier == "batch" and moves[1].tier == "standard"
    assert {m.request_id for m in evacuate([src, idle, busy], NOW, moving={"r1"})} == {"r2"}
    # the KV planned onto a target counts: r1 takes 300 of c2's 320 free tokens, r2 (100) goes to c3
    tight = sw("c2", free=20)
    assert {m.request_id: m.target.id for m in evacuate([src, tight, busy], NOW)} == {"r1": "c2", "r2": "c3"}
    # a context no ready worker of its role holds (r1 ends at 1,000 tokens) ...
    short_ctx = sw("c2", ctx=512)
    assert {m.request_id for m in evacuate([src, short_ctx], NOW)} == {"r2"}
    # ... goes to the other decode role when none of its own takes it
    gpu = w("g1", "gpu-decode", device="cuda:0", free=100)
    gpu.beat.kv_block_tokens = 16
    assert {m.request_id: m.target.id for m in evacuate([src, short_ctx, gpu], NOW)} == {"r1": "g1", "r2": "c2"}
    assert evacuate([src], NOW) == []                                # nowhere to go: it finishes there
    one = {"held": [["r1", "", "batch"]], "kv": {"r1": [100, 200, 1]}}
    assert len(evacuate([draining(sw("c1", **one)), idle], NOW)) == 1
    assert evacuate([draining(sw("c1", seen=GONE, **one)), idle], NOW) == []   # gone already
    assert evacuate([sw("c1", **one), idle], NOW) == []                         # not stopping

    # the router's wait for a worker that may be back: one that is stopping too (a restart or a
    # scale-down, it cannot tell) — unless its replacement is up already
    big = w("c2", "cpu-decode", ctx=8192)
    small = w("c1", "cpu-decode", ctx=2048)
    assert refused(req(n=3000), [small, draining(big)]).code == "unavailable"
    successor = dataclasses.replace(w("c3", "cpu-decode", ctx=8192), since=NOW + 1)
    assert decide(req(n=3000), [small, draining(big), successor], NOW).decode_worker == "c3"


def test_interactive_requests_on_cpu_decode_go_back_to_a_gpu_worker_with_room():
    """An interactive request running on cpu-decode (placed there while no gpu-decode worker was
    ready, or moved there off a stopping one) returns to a gpu-decode worker once one is ready
    with a free slot, no interactive work waiting, its context and its KV — most tokens left
    first, not with fewer than HOME_MIN_TOKENS left, never a ring, nor anything else."""
    from services.placement import HOME_MIN_TOKENS, homecoming
    cpu = sw("c1", kv={"ri": [300, 1000, 1], "rs": [100, 900, 1], "rr": [500, 900, 3], "rl": [100, 130, 1],
                       "ra": [50, 400, 1]},
             held=[["ri", "s1", "interactive"], ["rs", "", "standard"], ["rr", "", "interactive"],
                   ["rl", "", "interactive"], ["ra", "", "interactive"]])
    gpu = sw("g1", role="gpu-decode", free=100, ring=0)
    gpu.beat.max_running = 8
    moves = homecoming([cpu, gpu], NOW)
    assert [(m.request_id, m.source, m.target.id, m.tier, m.kind) for m in moves] == [
        ("ri", "c1", "g1", "interactive", "promote"), ("ra", "c1", "g1", "interactive", "promote")]
    assert moves[0].session_id == "s1" and "700 tokens left" in moves[0].reason
    assert 130 - 100 < HOME_MIN_TOKENS                          # rl: too little left to be worth a move
    assert [m.request_id for m in homecoming([cpu, gpu], NOW, moving={"ri"})] == ["ra"]
    # the KV planned onto the target counts: 300 of 320 free tokens, then rj's 50 does not fit
    assert [m.request_id for m in homecoming([cpu, sw("g1", role="gpu-decode", free=20)], NOW)] == ["ri"]
    # no room: no free slot, interactive work waiting there, a context too short, not ready
    for full in (dict(running=8), dict(waiting={"interactive": 1}), dict(ctx=512)):
        g = sw("g1", role="gpu-decode", free=100, **full)
        g.beat.max_running = 8
        assert [m.request_id for m in homecoming([cpu, g], NOW)] == (["ra"] if "ctx" in full else []), full
    assert homecoming([cpu, draining(sw("g1", role="gpu-decode"))], NOW) == []
    assert homecoming([cpu, sw("c2")], NOW) == []                      # no gpu-decode worker at all
    # the router's tick (rebalance with pressure) makes them; a session tier change does not
    assert [m.request_id for m in rebalance([cpu, gpu], {}, NOW)] == ["ri", "ra"]
    assert rebalance([cpu, gpu], {}, NOW, pressure=False) == []
    # a session set to a worse tier since its request was placed: the override is its tier now
    assert [m.request_id for m in homecoming([cpu, gpu], NOW, sessions={"s1": SessionView(tier="standard")})] == ["ra"]
    moves = rebalance([cpu, gpu], {"s1": SessionView(tier="standard", last=NOW)}, NOW)
    assert [(m.request_id, m.kind, m.target.id, m.tier) for m in moves] == [
        ("ri", "retier", "c1", "standard"), ("ra", "promote", "g1", "interactive")]   # ri: at its new tier, there
    assert [m.request_id for m in homecoming([cpu, gpu], NOW, sessions={"s1": SessionView(tier="interactive")})] == [
        "ri", "ra"]


async def test_a_move_counts_on_its_target_until_the_target_s_next_heartbeat():
    """After a move the router's view of the target runs one more sequence in the KV the move
    filled (and the source one fewer), so the next tick — before the target's next heartbeat —
    does not plan another move into the slot this one took (a probe saw 7 streams promoted onto
    a worker of 4 slots)."""
    from services.placement import homecoming
    from services.router import Router
    from shared.schemas import MigrateReply

    class Bus:
        async def request(self, subject, msg, timeout=None, expected=None):
            return MigrateReply(msg.request_id, "c1", msg.target_worker, 9, 300, 1 << 20, 0.01, "shm")

        async def publish(self, subject, msg):
            pass

    cpu = sw("c1", kv={"r1": [300, 1000, 1], "r2": [300, 1000, 1]},
             held=[["r1", "", "interactive"], ["r2", "", "interactive"]], running=2)
    gpu = sw("g1", role="gpu-decode", free=100, running=1, ring=0)
    gpu.beat.max_running = 2
    now = time.monotonic()
    for v in (cpu, gpu):
        v.seen = now
    assert [m.request_id for m in homecoming([cpu, gpu], now)] == ["r1"]        # one slot free
    router = Router.__new__(Router)
    router.under_way = {}
    router.bus, router.moving, router.sessions, router.store = Bus(), {"r1"}, {}, None
    router.worker_id, router.workers = "router-1", {"c1": cpu, "g1": gpu}
    router._apply = lambda plan, now: None
    done = await router._move(homecoming([cpu, gpu], now)[0])
    assert done["request_id"] == "r1" and router.moving == set()
    assert gpu.beat.running == 2 and gpu.beat.free_kv_blocks == 100 - 19 and "r1" in gpu.beat.kv_tokens
    assert cpu.beat.running == 1 and "r1" not in cpu.beat.kv_tokens
    assert homecoming([cpu, gpu], now) == []                                     # the slot is taken


async def test_a_move_whose_target_stopped_since_the_plan_is_not_tried():
    """Moves are planned from the router's view and run a moment later: a target whose heartbeat
    said since that it is stopping (two workers drained together, each planned as the other's
    target) is not asked — the move is dropped and planned again at the next tick."""
    from services.placement import Move
    from services.router import Router

    class Bus:
        def __init__(self):
            self.asked = []

        async def request(self, subject, msg, timeout=None, expected=None):
            self.asked.append(subject)
            raise AssertionError("no move should be sent")

    router = Router.__new__(Router)
    router.under_way = {}
    router.bus, router.moving = Bus(), {"r1"}
    target = sw("c2")
    router.workers = {"c2": draining(sw("c2"))}
    router.workers["c2"].seen = time.monotonic()      # heard just now: stopping
    assert await router._move(Move("r1", "", "c1", target, "batch", "evacuate: c1 is stopping")) is None
    assert router.bus.asked == [] and router.moving == set()


def test_interactive_work_starts_on_cpu_decode_when_every_gpu_worker_has_a_queue():
    """Every gpu-decode worker has interactive work waiting: a new interactive request starts on
    a cpu-decode worker with a free slot (homecoming brings it back), not at the end of that
    queue — but not onto a worker that does not say its slots or has none free, not past a
    session whose KV is on the GPU, and not while any GPU worker has no queue."""
    def cpu(**kw):
        v = w("c1", "cpu-decode", **kw)
        v.beat.max_running = 4
        return v
    queued = w("g1", "gpu-decode", device="cuda:0", queue=2, waiting={"interactive": 2})
    plan = place(req("interactive"), [queued, cpu()], NOW)
    assert plan.decode_worker == "c1" and "back when one has room" in plan.reason
    assert place(req("interactive"), [queued, cpu(running=4)], NOW).decode_worker == "g1"      # no free slot
    assert place(req("interactive"), [queued, w("c1", "cpu-decode")], NOW).decode_worker == "g1"  # slots unsaid
    assert place(req("interactive"), [queued, w("g2", "gpu-decode", device="cuda:0"), cpu()],
                 NOW).decode_worker == "g2"                                                   # g2 has no queue
    home = SessionView(worker="g1", last=NOW)
    assert place(req("interactive", session="s1"), [queued, cpu()], NOW, session=home).decode_worker == "g1"


def test_a_full_tier_queue_refuses_the_keys_that_fill_it_not_a_light_one():
    """The interactive queue (limit 4) full of key A's requests: A's next is refused, key B's —
    under its share (4 / 2 owners) — is admitted, up to twice the limit; requests routed since
    the last heartbeat count for their key; waiting requests no heartbeat names an owner for
    count as the asking key's."""
    from shared.tier import fair_share
    limits = Limits(queue={"interactive": 4, "standard": 256, "batch": 1024})
    full = w("g1", "gpu-decode", queue=4, waiting={"interactive": 4})
    full.beat.waiting_by_owner = {"A": {"interactive": 4}}
    with pytest.raises(BusError) as e:
        place(dataclasses.replace(req("interactive"), owner="A"), [full], NOW, limits=limits)
    assert e.value.code == "overloaded" and "4 of them this API key's" in str(e.value)
    assert place(dataclasses.replace(req("interactive"), owner="B"), [full], NOW, limits=limits).decode_worker == "g1"
    full.routed.append(["rb", "", "interactive", NOW, "B"])               # B's, routed a moment ago
    full.routed.append(["rb2", "", "interactive", NOW, "B"])
    with pytest.raises(BusError):                                         # B holds its share now: 2 of 4 / 2
        place(dataclasses.replace(req("interactive"), owner="B"), [full], NOW, limits=limits)
    unnamed = w("g1", "gpu-decode", queue=4, waiting={"interactive": 4})   # owners not said
    with pytest.raises(BusError):
        place(dataclasses.replace(req("interactive"), owner="B"), [unnamed], NOW, limits=limits)
    assert fair_share(3, 4, "A", {"A": 3}) and not fair_share(4, 4, "A", {"A": 4})
    assert fair_share(7, 4, "B", {"A": 6, "B": 1}) and not fair_share(8, 4, "B", {"A": 8})


async def test_a_target_a_move_failed_onto_gets_none_for_a_while():
    """A move onto a worker fails (unreachable, refusing): no move is planned onto it for
    MOVE_BACKOFF_S — it was tried again every tick, a warning a second, until its heartbeat
    went stale — and afterwards it is a target again."""
    from services.placement import homecoming
    from services.router import MOVE_BACKOFF_S, Router

    from shared.bus import RemoteError
    from shared.schemas import MigrateReply

    class Bus:
        code = "overloaded"       # the target refused it

        async def request(self, subject, msg, timeout=None, expected=None):
            self.asked = getattr(self, "asked", []) + [msg]
            if msg.target_worker == "c1":     # in place: done
                return MigrateReply(msg.request_id, "c1", "c1", 0, 0, 0, 0.0, "in place")
            raise RemoteError(self.code, "moving r1 to g1 failed")

    cpu = sw("c1", kv={"r1": [300, 1000, 1]}, held=[["r1", "", "interactive"]], running=1)
    gpu = sw("g1", role="gpu-decode", free=100, ring=0)
    now = time.monotonic()
    cpu.seen = gpu.seen = now
    router = Router.__new__(Router)
    router.under_way = {}
    router.bus, router.moving, router.move_failed = Bus(), {"r1"}, {}
    router.workers = {"c1": cpu, "g1": gpu}
    assert await router._move(homecoming([cpu, gpu], now)[0]) is None
    assert router._not_failing(homecoming([cpu, gpu], now), now) == []
    later = now + MOVE_BACKOFF_S + 0.1
    assert [m.target.id for m in router._not_failing(homecoming([cpu, gpu], now), later)] == ["g1"]
    # the request's own state (not decoding yet: "unavailable") is no fault of the target: it
    # stays open, and the request runs at its new tier where it is meanwhile (re-tiered in place)
    # (a homecoming, at the tier it runs at, is not re-tiered: nothing changes)
    router.move_failed, router.bus.code, router._moves = {}, "unavailable", set()
    router.bus.asked = []
    from services.placement import Move
    cpu.beat.requests = [InFlight("r1", "", "standard")]     # its session was set to interactive
    done = await router._move(Move("r1", "", "c1", gpu, "interactive", "promote: session s1 is interactive"))
    assert router.move_failed == {}
    assert [(q.target_worker, q.tier) for q in router.bus.asked] == [("g1", "interactive"), ("c1", "interactive")]
    assert done["source"] == done["target"] == "c1"       # what a session update answers it did
    # a target with every sequence slot taken (another router copy filled it): kept off for a
    # while, and the request re-tiered in place meanwhile
    router.bus.code, router.bus.asked = "overloaded", []
    cpu.beat.requests = [InFlight("r1", "", "standard")]
    done = await router._move(Move("r1", "", "c1", gpu, "interactive", "promote: session s1 is interactive"))
    assert set(router.move_failed) == {"g1"} and done["target"] == "c1"
    assert [(q.target_worker, q.tier) for q in router.bus.asked] == [("g1", "interactive"), ("c1", "interactive")]


def test_moves_under_way_count_on_their_targets_until_listed():
    """A move takes 0.4–2 s and the router plans every interval: a move under way counts on its
    target as a request routed there (a slot, its KV) until the target's heartbeat lists it —
    the next plan saw the room the first was filling (a 4-slot worker ran 5)."""
    from services.placement import Move, homecoming, with_moves
    cpu = sw("c1", kv={"r1": [300, 1000, 1], "r2": [300, 1000, 1]},
             held=[["r1", "", "interactive"], ["r2", "", "interactive"]], running=2)
    gpu = sw("g1", role="gpu-decode", free=100, running=1, ring=0)
    gpu.beat.max_running = 2
    first = homecoming([cpu, gpu], NOW)
    assert [m.request_id for m in first] == ["r1"] and first[0].tokens == 300
    views = with_moves([cpu, gpu], first, NOW)
    g = next(v for v in views if v.id == "g1")
    assert len(g.routed) == 1 and g.beat.free_kv_blocks == 100 - 19 and gpu.beat.free_kv_blocks == 100
    assert homecoming(views, NOW, moving={"r1"}) == []                 # the slot is the move's
    gpu.beat.requests = [InFlight("r1", "", "interactive")]             # listed: counted by the beat
    assert len(next(v for v in with_moves([cpu, gpu], first, NOW) if v.id == "g1").routed) == 0
    assert isinstance(first[0], Move)


def test_an_interactive_request_starts_on_cpu_decode_when_the_gpu_slots_are_all_taken():
    """Every GPU slot taken by interactive work (no queue yet): the next interactive request
    starts on a free cpu-decode slot — the first one past the slots waited a whole stream there —
    but not while the GPU holds worse-tier work (its scheduler preempts that for it)."""
    cpu = w("c1", "cpu-decode")
    cpu.beat.max_running = 4
    full = w("g1", "gpu-decode", device="cuda:0", running=2, requests=[("a", "", "interactive"), ("b", "", "interactive")])
    full.beat.max_running = 2
    assert place(req("interactive"), [full, cpu], NOW).decode_worker == "c1"
    guests = w("g1", "gpu-decode", device="cuda:0", running=2, requests=[("a", "", "interactive"), ("b", "", "batch")])
    guests.beat.max_running = 2
    assert place(req("interactive"), [guests, cpu], NOW).decode_worker == "g1"


def test_the_router_plans_no_second_move_into_a_slot_a_move_under_way_fills():
    from services.router import Router
    cpu = sw("c1", kv={"r1": [300, 1000, 1], "r2": [300, 1000, 1]},
             held=[["r1", "", "interactive"], ["r2", "", "interactive"]], running=2)
    gpu = sw("g1", role="gpu-decode", free=100, running=1, ring=0)
    gpu.beat.max_running = 2
    router = Router.__new__(Router)
    router.under_way, router.moving, router.move_failed, router.sessions = {}, set(), {}, {}
    router.workers, router.limits = {"c1": cpu, "g1": gpu}, Limits()
    router.started, router._swept = time.monotonic(), False
    for v in (cpu, gpu):
        v.seen = time.monotonic()
    assert [m.request_id for m in router._plan_moves(None, pressure=True)] == ["r1"]
    assert router._plan_moves(None, pressure=True) == [] and set(router.under_way) == {"r1"}


def test_a_tier_change_whose_pool_fits_retiers_the_request_where_it_runs():
    """A session set to batch whose standard request runs on cpu-decode — the pool batch wants —
    was not touched: it kept its old tier in that engine (its priority, its preemption) and in
    the heartbeat. Now a move onto its own worker re-tiers it in place."""
    workers = [w("c1", "cpu-decode", requests=[("r1", "s1", "standard")]), GPU]
    moves = rebalance(workers, {"s1": SessionView(tier="batch", last=NOW)}, NOW)
    assert [(m.request_id, m.source, m.target.id, m.tier, m.kind) for m in moves] == [
        ("r1", "c1", "c1", "batch", "retier")]
    assert rebalance(workers, {"s1": SessionView(tier="standard", last=NOW)}, NOW) == []


async def test_a_retier_in_place_updates_the_router_s_view_only_in_its_tier():
    from services.placement import Move
    from services.router import Router
    from shared.schemas import MigrateReply

    class Bus:
        async def request(self, subject, msg, timeout=None, expected=None):
            assert msg.target_worker == "c1"
            return MigrateReply(msg.request_id, "c1", "c1", 0, 0, 0, 0.0, "in place")

    cpu = w("c1", "cpu-decode", running=1, requests=[("r1", "s1", "standard")])
    cpu.seen = time.monotonic()
    router = Router.__new__(Router)
    router.bus, router.moving, router.under_way, router.move_failed = Bus(), {"r1"}, {}, {}
    router.workers = {"c1": cpu}
    done = await router._move(Move("r1", "s1", "c1", cpu, "batch", "retier: session s1 is batch"))
    assert done["target"] == "c1" and cpu.beat.running == 1 and cpu.beat.requests == [InFlight("r1", "s1", "batch")]


def test_a_move_that_lands_after_a_later_tier_change_does_not_undo_it():
    """"interactive", then "batch" 50 ms later: the promotion planned for the first landed after
    the second and raised the session back to interactive (its next batch turn ran interactive).
    A move follows the session's tier; only a placement's better tier raises it."""
    from services.router import Router
    from shared.schemas import RoutePlan
    router = Router.__new__(Router)
    router.sessions, router.workers, router.store, router.worker_id = {"s1": SessionView(tier="batch")}, {}, None, "r"
    router._apply(RoutePlan("q1", None, "g1", "gpu-decode", "promote: session s1 is interactive", tier="interactive",
                            session_id="s1", moved_from="c1", owner=""), NOW)
    assert router.sessions["s1"].tier == "batch" and router.sessions["s1"].worker == "g1"
    router._apply(RoutePlan("q2", None, "g1", "gpu-decode", "placed", tier="interactive", session_id="s1",
                            owner=""), NOW)
    assert router.sessions["s1"].tier == "interactive"


def test_the_tick_leaves_a_fresh_tier_change_to_the_router_copy_that_took_it():
    """A POST /v1/sessions/{id} handled by one router copy moves the session's requests there;
    the leading copy's tick planned the same moves (two copies moving one request: "already
    moving", not_found, 32 of 71 updates answered `moved: []`). The tick follows up only once
    the change is SESSION_GRACE_S old."""
    from services.router import SESSION_GRACE_S
    workers = [GPU, w("c1", "cpu-decode", requests=[("r1", "s1", "batch")])]
    fresh = {"s1": SessionView(tier="interactive", last=NOW, changed=NOW - 1)}
    assert rebalance(workers, fresh, NOW, grace_s=SESSION_GRACE_S) == []
    assert [m.request_id for m in rebalance(workers, fresh, NOW)] == ["r1"]             # the copy that took it
    assert [m.request_id for m in rebalance(workers, fresh, NOW + SESSION_GRACE_S, grace_s=SESSION_GRACE_S)] == ["r1"]


def test_a_session_set_to_batch_left_on_the_gpu_goes_to_cpu_decode_once_it_has_room():
    """Set to batch while cpu-decode had no slot, a session's request was re-tiered in place on
    gpu-decode, and nothing moved it later: it held a GPU slot to the end of its stream. It goes
    to cpu-decode once a worker there has room — but batch work that overflowed onto the GPU by
    itself (no session tier) stays, the GPU engine's to preempt."""
    from services.placement import homecoming
    gpu = sw("g1", role="gpu-decode", ring=0, kv={"rb": [200, 900, 1], "ro": [200, 900, 1]},
             held=[["rb", "s1", "batch"], ["ro", "", "batch"]])
    cpu = sw("c1", free=100)
    cpu.beat.max_running = 4
    moves = homecoming([gpu, cpu], NOW, sessions={"s1": SessionView(tier="batch")})
    assert [(m.request_id, m.kind, m.target.id, m.tier) for m in moves] == [("rb", "demote", "c1", "batch")]
    full = sw("c1", free=100, running=4)
    full.beat.max_running = 4
    assert homecoming([gpu, full], NOW, sessions={"s1": SessionView(tier="batch")}) == []
