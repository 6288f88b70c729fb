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


def test_a_restarted_copy_keeps_its_metrics_port_unless_it_is_taken(caplog):
    """The port a copy's first /metrics bound (TANDEM_METRICS_PORT=0: a free one, read from its log
    line) is the next incarnation's TANDEM_METRICS_PORT, so a scraper's target outlives a restart;
    where another process took it meanwhile, a free one again (said); a fixed or -1 setting is
    left as the user set it."""
    import socket
    c = up.Child("cpu-decode", "cpu-decode", {"TANDEM_METRICS_PORT": "0"})
    assert c._env("w-1") == {"TANDEM_METRICS_PORT": "0", "TANDEM_WORKER_ID": "w-1"}   # nothing seen yet
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        c._saw(b"INFO tandem.worker: loading the model")
        c._saw(f"INFO tandem.metrics: metrics on http://127.0.0.1:{port}/metrics\n".encode())
        c._saw(b"INFO tandem.metrics: metrics on http://127.0.0.1:1/metrics\n")      # (the first one counts)
        assert c.metrics_port == port
        assert c._env("w-2")["TANDEM_METRICS_PORT"] == "0" and c.metrics_port is None   # taken: a free one
        assert "is taken now" in caplog.text
    c._saw(f"metrics on http://127.0.0.1:{port}/metrics".encode())
    assert c._env("w-3") == {"TANDEM_METRICS_PORT": str(port), "TANDEM_WORKER_ID": "w-3"}   # free again: kept
    for setting in ("-1", "9400"):
        fixed = up.Child("router", "router", {"TANDEM_METRICS_PORT": setting})
        fixed._saw(f"metrics on http://127.0.0.1:{port}/metrics".encode())
        assert fixed._env("r-1")["TANDEM_METRICS_PORT"] == setting
