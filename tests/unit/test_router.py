"""The placement policy as a pure function over a table of cases."""

from __future__ import annotations

import pytest

from shared.bus import BusError
from shared.schemas import Heartbeat, RouteRequest
from services.router import MAX_QUEUE, WorkerView, place

NOW = 1000.0


def w(wid, role, *, queue=0, running=0, free=100, device="cpu", ctx=8192, seen=NOW, port=9000):
    beat = Heartbeat(worker_id=wid, role=role, device=device, model="m", ready=True, queue_depth=queue,
                     running=running, free_kv_blocks=free, total_kv_blocks=100, max_context=ctx,
                     data_host="127.0.0.1", data_port=port, ts=0.0, interval=1.0)
    return WorkerView(beat, seen)


def req(tier="standard", n=100):
    return RouteRequest(request_id="r1", model="m", tier=tier, session_id=None, num_prompt_tokens=n, max_tokens=16)


GPU, CPU, CPU2 = w("g1", "gpu-decode", device="cuda:0"), w("c1", "cpu-decode"), w("c2", "cpu-decode", running=3)
PRE_CPU, PRE_GPU = w("p1", "prefill"), w("p2", "prefill", device="cuda:0", running=1)


@pytest.mark.parametrize("tier,workers,decode,prefill", [
    ("interactive", [GPU, CPU], "g1", None),
    ("standard", [GPU, CPU], "c1", None),
    ("batch", [GPU, CPU], "c1", None),
    ("interactive", [CPU], "c1", None),                 # no GPU pool: fall back to CPU
    ("batch", [GPU], "g1", None),                       # no CPU pool: fall back to GPU
    ("standard", [CPU, CPU2], "c1", None),              # least loaded wins
    ("standard", [CPU2, w("c3", "cpu-decode", running=3, free=200)], "c3", None),  # tie: more free KV
    ("standard", [CPU, PRE_CPU], "c1", "p1"),           # two-phase when a prefill worker lives
    ("interactive", [GPU, PRE_CPU, PRE_GPU], "g1", "p2"),  # prefill where it is fastest (GPU)
    ("standard", [CPU, w("p9", "prefill", seen=NOW - 10)], "c1", None),  # stale heartbeat: gone
    ("standard", [CPU, w("c8", "cpu-decode", ctx=50)], "c1", None),       # context too small
])
def test_placement_table(tier, workers, decode, prefill):
    plan = place(req(tier), workers, NOW)
    assert plan.decode_worker == decode
    assert plan.prefill_worker == prefill
    assert plan.reason


def test_no_decode_worker_is_unavailable():
    with pytest.raises(BusError) as e:
        place(req(), [PRE_CPU], NOW)
    assert e.value.code == "unavailable"


def test_full_queues_are_overloaded():
    with pytest.raises(BusError) as e:
        place(req(), [w("c1", "cpu-decode", queue=MAX_QUEUE)], NOW)
    assert e.value.code == "overloaded"


def test_decode_without_data_plane_gets_no_prefill_worker():
    plan = place(req(), [w("c1", "cpu-decode", port=0), PRE_CPU], NOW)
    assert plan.prefill_worker is None


def test_round_robin_takes_every_decode_worker_in_turn():
    workers = [w("c2", "cpu-decode", running=9), w("c1", "cpu-decode"), GPU, PRE_CPU]
    picked = [place(req("standard"), workers, NOW, "round-robin", turn=t).decode_worker for t in range(6)]
    assert picked == ["c1", "c2", "g1", "c1", "c2", "g1"]  # by id, load and tier ignored


def test_round_robin_skips_dead_and_full_workers():
    workers = [w("c1", "cpu-decode"), w("c2", "cpu-decode", queue=MAX_QUEUE), w("c3", "cpu-decode", seen=NOW - 10)]
    assert {place(req(), workers, NOW, "round-robin", turn=t).decode_worker for t in range(4)} == {"c1"}
    with pytest.raises(BusError) as e:
        place(req(), [w("c2", "cpu-decode", queue=MAX_QUEUE)], NOW, "round-robin")
    assert e.value.code == "overloaded"


def test_round_robin_still_uses_a_prefill_worker():
    plan = place(req(), [CPU, PRE_CPU], NOW, "round-robin")
    assert (plan.decode_worker, plan.prefill_worker) == ("c1", "p1")


def test_unknown_policy_is_a_value_error():
    with pytest.raises(ValueError, match="policy"):
        place(req(), [CPU], NOW, "random")
