"""OS priorities: the kernel's scheduler enforces the tiers too (docs/routing.md, OS priorities).

The engines' queues, preemption and step budgets order the work *inside* one engine; on shared
cores the engines' threads still compete as equals with each other and with the gateway, router
and NATS. Three knobs, each off-able (``PrioritySettings``), none needing a privilege:

- **the batch lane**: an engine step whose sequences are all batch-tier runs on a thread of its
  own (``BatchLane``) that lowered its own priority once, at start (``TANDEM_BATCH_NICE``,
  ``TANDEM_BATCH_SCHED``); the kernels' OpenMP team that thread starts inherits it (Linux
  priorities are per thread and inherited at clone). A step with any better-tier sequence runs
  on the engine thread, at normal priority. Lowering a priority needs no privilege, raising it
  back does (RLIMIT_NICE), so no thread ever switches back and forth;
- **bounded OpenMP spin** (``omp_env``): libgomp's threads spin ~300,000 iterations at a barrier
  before sleeping; where engine threads outnumber the cores they get ``GOMP_SPINCOUNT`` 10,000
  (tens of microseconds), so a waiting thread gives its core back instead of burning it;
- **engine threads per role** (``engine_threads``): ``tandem up`` gives engines that serve
  interactive work ``cores - 1`` threads (a core stays free for the gateway, router and NATS on
  that path) and the batch pool half the cores: a kernel team whose threads outnumber the cores
  left to it stalls at every barrier (measured, 2 cores: cpu-decode on 2 threads streamed 69 %
  of the batch tokens of the same stack without the lane, its team ping-ponging on the one core
  the interactive engine left).

A knob the OS refuses is logged once and skipped (``apply_to_this_thread``).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("tandem.priority")

SCHED_POLICIES = {"other": getattr(os, "SCHED_OTHER", 0), "batch": getattr(os, "SCHED_BATCH", 3),
                  "idle": getattr(os, "SCHED_IDLE", 5)}
BOUNDED_SPIN = 10_000       # GOMP_SPINCOUNT where the engines' threads outnumber the cores
LANE_NAME = "tandem-batch"  # the OS name (comm) of the batch lane and of its kernel team's threads
INTERACTIVE_ROLES = ("gpu-decode", "prefill")   # engines that serve interactive work (docs/routing.md)

T = TypeVar("T")


def engine_threads(role: str, cores: int) -> int:
    """Engine threads of ``role`` on ``cores`` shared cores (``tandem up`` without TANDEM_THREADS):
    an engine on the interactive path leaves a core to the gateway, router and NATS; the batch
    pool (cpu-decode) takes half the cores, so its team fits beside the interactive engine."""
    cores = max(1, cores)
    return max(1, cores - 1) if role in INTERACTIVE_ROLES else max(1, cores // 2)


def omp_env(spin: str, total_threads: int, cores: int, env: dict[str, str]) -> tuple[dict[str, str], str]:
    """The OpenMP wait variables engines get, and why: ``spin`` is ``auto`` (a bounded spin where
    ``total_threads`` engine threads outnumber ``cores``), ``off`` (libgomp's own default) or a
    spin count. A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` already in ``env`` is kept."""
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return {}, "as set in the environment"
    if spin == "off":
        return {}, "libgomp's default (TANDEM_OMP_SPIN off)"
    if spin == "auto" and total_threads <= cores:
        return {}, f"libgomp's default ({total_threads} engine threads fit {cores} cores)"
    count = BOUNDED_SPIN if spin == "auto" else int(spin)
    return {"GOMP_SPINCOUNT": str(count)}, f"GOMP_SPINCOUNT={count}"


def describe(nice: int, sched: str) -> str:
    """``nice 19 + SCHED_BATCH``: the batch priority, in words."""
    return f"nice {nice}" + (f" + SCHED_{sched.upper()}" if sched != "other" else "")


_refused: set[str] = set()   # knobs the OS refused here (each logged once per process)


def _refuse(knob: str, err: OSError) -> str:
    if knob not in _refused:
        _refused.add(knob)
        log.warning("the OS refused %s (%s): going on without it", knob, os.strerror(err.errno or 0) or err)
    return knob


def apply_to_this_thread(nice: int, sched: str, name: str | None = None,
                         setpriority: Callable = None, setscheduler: Callable = None) -> list[str]:
    """Lower the calling thread's priority (Linux): ``sched`` (``other``, ``batch`` or ``idle``),
    then nice ``nice`` (a thread already nicer keeps its own: never raised). Returns the knobs
    refused (each logged once). ``name``: the thread's OS name, inherited by threads it starts (the kernels'
    team), so ``/proc/<pid>/task/*/comm`` shows them."""
    setpriority = setpriority or os.setpriority
    setscheduler = setscheduler or os.sched_setscheduler
    tid = threading.get_native_id()
    refused = []
    if name:
        _set_thread_name(name)
    policy = SCHED_POLICIES[sched]
    if policy != SCHED_POLICIES["other"]:
        try:
            setscheduler(tid, policy, os.sched_param(0))
        except OSError as e:
            refused.append(_refuse(f"scheduling policy SCHED_{sched.upper()}", e))
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if nice > current:
        try:
            setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as e:
            refused.append(_refuse(f"nice {nice}", e))
    return refused


def _set_thread_name(name: str) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)   # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name is cosmetic
        pass


def thread_priorities(pid: int | str = "self") -> dict[int, tuple[str, int, int]]:
    """tid -> (OS name, nice, scheduling policy) of every thread of process ``pid``, from
    /proc/<pid>/task/<tid>/stat (Linux; threads that end meanwhile are left out)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except FileNotFoundError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()   # fields[0] is stat field 3 (state)
        out[int(tid)] = (raw[raw.index("(") + 1:raw.rindex(")")], int(fields[19 - 3]), int(fields[41 - 3]))
    return out


class BatchLane:
    """One thread that runs callables (batch-only engine steps) at the batch priority. The
    caller blocks until the call is done; its result or exception comes back to it."""

    def __init__(self, nice: int, sched: str):
        self.nice, self.sched = nice, sched
        self.refused: list[str] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=LANE_NAME,
                                                           initializer=self._lower)
        self.native_id = self._pool.submit(threading.get_native_id).result()

    def _lower(self) -> None:
        self.refused = apply_to_this_thread(self.nice, self.sched, LANE_NAME)

    def run(self, fn: Callable[[], T]) -> T:
        return self._pool.submit(fn).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def describe(self) -> str:
        out = (f"batch-only engine steps run on thread {self.native_id} ({LANE_NAME}) and its kernel team "
               f"at {describe(self.nice, self.sched)}")
        return out + (f" (the OS refused: {', '.join(self.refused)})" if self.refused else "")
