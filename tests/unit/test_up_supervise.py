"""`tandem up`'s supervisor (services/up.py ``Child``): a copy that keeps exiting is given up; the
stack stops (exit 1) when what was given up leaves it serving nothing — the gateway, or the
last decode copy. Copies here are a one-line Python process that exits at once."""

from __future__ import annotations

import asyncio
import sys

import services.up as up


def fast_failing(monkeypatch) -> None:
    monkeypatch.setattr(up, "RESTART_LIMIT", 1)
    monkeypatch.setattr(up, "BACKOFF_S", (0.01, 0.01))

    async def start(self) -> None:
        self.starts += 1
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
        self.pump = asyncio.create_task(asyncio.sleep(0))
    monkeypatch.setattr(up.Child, "start", start)


def test_the_stack_stops_once_every_decode_copy_is_given_up(monkeypatch):
    """A setting only the workers read, wrong (the probe: TANDEM_DATA_KEY_FILE naming a directory
    before it was checked up front): every decode copy crash-looped and was given up, and `tandem
    up` went on running a gateway that could serve nothing. One decode copy given up while
    another kind runs: the rest goes on; the last one given up: the stack stops, exit 1. The same
    for the last router."""
    fast_failing(monkeypatch)

    async def main():
        children = [up.Child("cpu-decode", "cpu-decode", {}), up.Child("gpu-decode", "gpu-decode", {}),
                    up.Child("prefill", "prefill", {})]
        for c in children:
            c.left = lambda services: any(d.service in services and not d.given_up for d in children)
        stop = asyncio.Event()
        cpu, gpu, prefill = children
        for c in (prefill, cpu):
            await c.start()
            await asyncio.wait_for(c.supervise(stop), 30)
            assert c.given_up and not c.fatal and not stop.is_set()   # a prefill copy, one decode kind: go on
        await gpu.start()
        await asyncio.wait_for(gpu.supervise(stop), 30)
        assert gpu.given_up and gpu.fatal and stop.is_set()

        routers = [up.Child("router", "router", {}), up.Child("router-2", "router", {})]
        for c in routers:
            c.left = lambda services: any(d.service in services and not d.given_up for d in routers)
        stop = asyncio.Event()
        for c, last in zip(routers, (False, True)):
            await c.start()
            await asyncio.wait_for(c.supervise(stop), 30)
            assert c.given_up and c.fatal == last and stop.is_set() == last

    asyncio.run(main())
