"""OS priorities (shared/os_priority.py): the policy — which role gets how many engine threads,
which OpenMP wait, which thread runs at which priority — and the path where the OS refuses a knob."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import threading

import pytest

from services.up import add_arguments, os_priorities
from shared import os_priority
from shared.os_priority import (BOUNDED_SPIN, BatchLane, apply_to_this_thread, engine_threads, omp_env,
                                thread_priorities)
from shared.settings import Settings


def task_stat(tid: int) -> tuple[str, int, int]:
    return thread_priorities()[tid]


@pytest.mark.parametrize("cores,interactive,batch", [(1, 1, 1), (2, 1, 1), (3, 2, 1), (4, 3, 2), (16, 15, 8)])
def test_engine_threads_leave_a_core_to_the_interactive_path(cores, interactive, batch):
    assert engine_threads("gpu-decode", cores) == engine_threads("prefill", cores) == interactive
    assert engine_threads("cpu-decode", cores) == batch


def test_omp_spin_is_bounded_only_where_threads_outnumber_cores():
    assert omp_env("auto", 4, 2, {}) == ({"GOMP_SPINCOUNT": str(BOUNDED_SPIN)}, f"GOMP_SPINCOUNT={BOUNDED_SPIN}")
    assert omp_env("auto", 2, 2, {})[0] == {}
    assert omp_env("off", 8, 2, {})[0] == {}
    assert omp_env("500", 1, 2, {})[0] == {"GOMP_SPINCOUNT": "500"}
    assert omp_env("auto", 8, 2, {"OMP_WAIT_POLICY": "passive"}) == ({}, "as set in the environment")


def up_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_up_gives_each_role_its_threads_and_says_so(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})   # 3 engine threads > 2 cores: bounded spin
    extra, line = os_priorities(up_args(), {})
    assert extra["gpu-decode"] == extra["prefill"] == {"TANDEM_THREADS": "1", "GOMP_SPINCOUNT": str(BOUNDED_SPIN)}
    assert extra["cpu-decode"] == {"TANDEM_THREADS": "1", "GOMP_SPINCOUNT": str(BOUNDED_SPIN)}
    assert line.startswith("OS priorities on 2 core(s): engine threads (per role) prefill 1, gpu-decode 1, "
                           "cpu-decode 1 (3 in all)")
    assert "batch-only steps at nice 19 + SCHED_BATCH" in line


def test_up_settings_turn_each_knob_off(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    env = {"TANDEM_ROLE_THREADS": "0", "TANDEM_OMP_SPIN": "off", "TANDEM_OS_PRIORITY": "off"}
    extra, line = os_priorities(up_args(), env)
    assert extra == {"prefill": {}, "gpu-decode": {}, "cpu-decode": {}}
    assert "(torch's default) prefill 2, gpu-decode 2, cpu-decode 2" in line
    assert "TANDEM_OMP_SPIN off" in line and "every step at normal priority (TANDEM_OS_PRIORITY off)" in line
    extra, line = os_priorities(up_args("--gpu-decode", "0"), {"TANDEM_THREADS": "1"})   # the user's count wins
    assert extra["cpu-decode"] == {} and "(TANDEM_THREADS) prefill 1, cpu-decode 1 (2 in all)" in line


@pytest.mark.parametrize("var,value", [("TANDEM_BATCH_NICE", "20"), ("TANDEM_BATCH_NICE", "-1"),
                                       ("TANDEM_BATCH_SCHED", "fifo"), ("TANDEM_OMP_SPIN", "fast")])
def test_bad_settings_are_named(var, value):
    with pytest.raises(ValueError, match=var):
        Settings.from_env({var: value})


def in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn(), tid=threading.get_native_id()))
    t.start()
    t.join()
    return out


def test_a_thread_lowers_only_itself():
    """Real syscalls, no privilege: the thread's nice and policy change, the caller's do not."""
    def lower():
        refused = apply_to_this_thread(7, "batch", "tq-test")
        return refused, task_stat(threading.get_native_id())
    out = in_thread(lower)
    refused, (comm, nice, policy) = out["result"]
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert refused == [] and comm == "tq-test" and nice == max(7, base) and policy == os.SCHED_BATCH
    assert task_stat(threading.get_native_id())[1:] == (base, os.SCHED_OTHER)


def test_a_refused_knob_is_logged_once_and_skipped(caplog, monkeypatch):
    monkeypatch.setattr(os_priority, "_refused", set())

    def refuse(*a):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    def lower():
        return apply_to_this_thread(19, "idle", setpriority=refuse, setscheduler=refuse)
    with caplog.at_level(logging.WARNING, "tandem.priority"):
        first, second = in_thread(lower)["result"], in_thread(lower)["result"]
    assert first == second == ["scheduling policy SCHED_IDLE", "nice 19"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("the OS refused" in w and "going on without it" in w for w in warnings)


def test_the_batch_lane_runs_calls_on_its_low_thread():
    lane = BatchLane(11, "idle")
    try:
        tid = lane.run(threading.get_native_id)
        assert tid == lane.native_id != threading.get_native_id()
        comm, nice, policy = task_stat(tid)
        assert comm == os_priority.LANE_NAME and nice == max(11, os.getpriority(os.PRIO_PROCESS, 0))
        assert policy == os.SCHED_IDLE
        with pytest.raises(ZeroDivisionError):   # the caller gets the exception
            lane.run(lambda: 1 / 0)
        assert "nice 11 + SCHED_IDLE" in lane.describe()
    finally:
        lane.close()
