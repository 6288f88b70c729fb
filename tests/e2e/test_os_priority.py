"""OS priorities on a real stack (`tandem up`, real NATS, the bundled model): after a batch
request, the cpu-decode worker's batch lane and its kernel team run at the batch priority
(read from /proc/<pid>/task/<tid>/stat), every other thread of every worker at normal priority;
the start-up lines say what was applied; with TANDEM_OS_PRIORITY off no thread is lowered."""

from __future__ import annotations

import os

import httpx
import pytest

from bench import cpu_time
from shared.os_priority import BOUNDED_SPIN, LANE_NAME, thread_priorities
from tests.e2e.test_stack import running_stack

ARGS = ["--prefill", "0", "--gpu-decode", "1", "--cpu-decode", "1", "--kvpool", "0"]


def children(pid: int) -> dict[str, int]:
    """service -> pid of the `tandem up` children (named as bench/cpu_time.py names them)."""
    return {p.service: p.pid for p in cpu_time.processes() if p.ppid == pid}


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.decode().partition("=")[::2] for kv in f.read().split(b"\0") if kv)


def chat(url: str, tier: str) -> None:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(url + "/v1/chat/completions", timeout=120, headers={"X-Tandem-SLA": tier},
                   json={"model": model, "messages": [{"role": "user", "content": "Tell me about lighthouses."}],
                         "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text


# (off: the opt-out setting, a stack of its own — the slow lane; tests/unit/test_os_priority.py
# checks that `tandem up` then applies no priority)
@pytest.mark.parametrize("enabled", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["on", "off"])
def test_batch_steps_run_low_on_a_real_worker(nats_server, enabled):
    # the test processes' own GOMP_SPINCOUNT (tests/conftest.py) unset: `tandem up` chooses
    env = {"TANDEM_THREADS": "2", "TANDEM_OS_PRIORITY": "1" if enabled else "0", "GOMP_SPINCOUNT": None}
    with running_stack(nats_server, ARGS, env=env, workers={"gpu-decode": 1, "cpu-decode": 1}) as s:
        chat(s.url, "batch")          # cpu-decode: its steps hold batch work only
        chat(s.url, "interactive")    # gpu-decode: normal priority
        pids = children(s.proc.pid)
        threads = {svc: thread_priorities(pid) for svc, pid in pids.items()}
        spin = {svc: environ(pids[svc]).get("GOMP_SPINCOUNT") for svc in ("cpu-decode", "gpu-decode")}
        log = s.tail(400)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert set(threads) >= {"cpu-decode", "gpu-decode", "router", "gateway"}, pids
    lane = {tid: st for tid, st in threads["cpu-decode"].items() if st[0] == LANE_NAME}
    normal = {svc: {st[1:] for st in ts.values() if st[0] != LANE_NAME} for svc, ts in threads.items()}
    assert all(v == {(base, os.SCHED_OTHER)} for v in normal.values()), normal
    assert "OS priorities on" in log and "gateway, router, NATS at normal priority" in log
    cores = len(os.sched_getaffinity(0))     # 2 engines x 2 threads: a bounded spin where that outnumbers the cores
    assert spin == dict.fromkeys(spin, str(BOUNDED_SPIN) if 4 > cores else None), spin
    if enabled:
        assert len(lane) >= 2, threads["cpu-decode"]   # the lane and its kernel team (2 threads)
        assert set(lane.values()) == {(LANE_NAME, max(19, base), os.SCHED_BATCH)}
        assert "batch-only engine steps run on thread" in log
    else:
        assert lane == {} and not any(st[0] == LANE_NAME for ts in threads.values() for st in ts.values())
        assert "every engine step at normal priority (TANDEM_OS_PRIORITY off)" in log
