"""CPU time of a stack's processes by service, read from Linux's ``/proc`` (``tandem bench agents``).

``by_service(session)`` sums user + system time of every process in the session ``session`` — a
stack started in a session of its own (``bench.serve.Server``: the ``tandem up`` process's pid) —
keyed by the service each runs (``services.cli serve <service>``, ``nats`` for the embedded
NATS server, ``up`` for the supervisor; ``processes()`` lists them all, parent and session
included). ``cores(before, after, seconds)`` turns two readings into
cores in use. A process that ends between two readings drops out of the later one, so compare
readings of a stack none of whose processes restarted. Empty where there is no ``/proc``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _service(cmdline: list[str]) -> str:
    if "serve" in cmdline and cmdline.index("serve") + 1 < len(cmdline):
        return cmdline[cmdline.index("serve") + 1]
    if any(os.path.basename(a).startswith("nats-server") for a in cmdline[:1]):
        return "nats"
    return "up" if "up" in cmdline else os.path.basename(cmdline[0]) if cmdline else "?"


@dataclass
class Proc:
    """One process as ``/proc`` shows it."""
    pid: int
    ppid: int
    session: int
    service: str          # as ``_service`` names it
    cpu_s: float          # user + system time so far


def processes() -> list[Proc]:
    """Every process readable now (none where there is no ``/proc``)."""
    out = []
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace").split("\0")[:-1]
            out.append(Proc(int(pid), int(fields[1]), int(fields[3]), _service(cmdline),
                            (int(fields[11]) + int(fields[12])) / _TICKS))
        except (OSError, IndexError, ValueError):  # it ended meanwhile
            continue
    return out


def by_service(session: int) -> dict[str, float]:
    """Service -> CPU seconds (user + system) of the session's processes now."""
    out: dict[str, float] = {}
    for p in processes():
        if p.session == session:
            out[p.service] = out.get(p.service, 0.0) + p.cpu_s
    return out


def cores(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Service -> cores in use between two readings ``seconds`` apart."""
    if seconds <= 0:
        return {}
    return {k: max(0.0, after[k] - before.get(k, 0.0)) / seconds for k in sorted(after)}
