"""Energy counters where the hardware reports them — never estimated.

Sources:
- RAPL (Linux powercap): ``/sys/class/powercap/intel-rapl:N/energy_uj`` (top-level package
  domains; AMD Zen exposes the same interface), with wrap-around at ``max_energy_range_uj``.
  A package domain counts the whole socket, every process on it: per-service figures are
  only meaningful for a service that has the socket to itself.
- NVML (``pynvml`` from the nvidia-ml-py package, imported only when asked for):
  ``nvmlDeviceGetTotalEnergyConsumption`` per GPU (millijoules, Volta and later).

With neither readable (a VM, a container without /sys/class/powercap, no NVIDIA driver),
``EnergyMeter.available`` is False, readings are None and reports say "not available".

    meter = EnergyMeter()                 # finds the readable domains once
    before = meter.read()                 # {domain: joules} or None
    ...
    used = meter.joules_since(before)     # {domain: joules used} or None
    tokens_per_joule(tokens, used)        # None when not available
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

POWERCAP = "/sys/class/powercap"
NOT_AVAILABLE = "not available"


class _Rapl:
    def __init__(self, path: Path):
        self.path = path
        self.name = "rapl:" + ((path / "name").read_text().strip() if (path / "name").exists() else path.name)
        try:
            self.wrap = int((path / "max_energy_range_uj").read_text()) + 1
        except (OSError, ValueError):
            self.wrap = 0

    def read_uj(self) -> int:
        return int((self.path / "energy_uj").read_text())


class EnergyMeter:
    """Cumulative joules per readable domain (RAPL packages, NVML GPUs)."""

    def __init__(self, powercap: str = POWERCAP, nvml: bool = True, rapl: bool = True):
        self._rapl: list[_Rapl] = []
        root = Path(powercap)
        for d in sorted(root.glob("intel-rapl:*")) if rapl and root.is_dir() else ():
            if d.name.count(":") != 1:  # sub-domains (core, uncore, dram) are inside the package
                continue
            try:
                dom = _Rapl(d)
                dom.read_uj()
                self._rapl.append(dom)
            except (OSError, ValueError) as e:  # e.g. root-only since CVE-2020-8694
                log.debug("RAPL domain %s not readable: %s", d, e)
        self._nvml: list = []
        if nvml:
            self._nvml = _nvml_handles()
        self._last = self.read()

    @property
    def domains(self) -> list[str]:
        return [d.name for d in self._rapl] + [name for name, _ in self._nvml]

    @property
    def available(self) -> bool:
        return bool(self.domains)

    def describe(self) -> str:
        return ", ".join(self.domains) if self.available else (
            f"{NOT_AVAILABLE} (no readable RAPL domain under {POWERCAP}, no NVML GPU)")

    def read(self) -> dict[str, tuple[int, int]] | None:
        """Raw counters {domain: (value, wrap)} in microjoules; None when nothing is readable."""
        if not self.available:
            return None
        out = {d.name: (d.read_uj(), d.wrap) for d in self._rapl}
        for name, handle in self._nvml:
            import pynvml
            out[name] = (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) * 1000, 0)  # mJ -> uJ
        return out

    def joules_since(self, before: dict | None) -> dict[str, float] | None:
        """Joules used per domain since ``before`` (a ``read()``), wrap-around handled."""
        now = self.read()
        if before is None or now is None:
            return None
        return _used(before, now)

    def tick(self) -> dict[str, float] | None:
        """Joules used per domain since the previous tick (or since the meter was made)."""
        now = self.read()
        used = _used(self._last, now) if self._last is not None and now is not None else None
        self._last = now
        return used


def _used(before: dict, now: dict) -> dict[str, float]:
    return {k: joules(before[k][0], now[k][0], now[k][1]) for k in now if k in before}


def joules(before_uj: int, after_uj: int, wrap_uj: int = 0) -> float:
    """Energy between two readings of one counter (microjoules, wrapping at ``wrap_uj``)."""
    delta = after_uj - before_uj
    if delta < 0 and wrap_uj:
        delta += wrap_uj
    return max(0, delta) / 1e6


def tokens_per_joule(tokens: int, used: dict[str, float] | None) -> float | None:
    """Tokens per joule over every measured domain; None when energy is not available."""
    if not used:
        return None
    total = sum(used.values())
    return tokens / total if total > 0 else None


def _nvml_handles() -> list:
    if not os.path.exists("/proc/driver/nvidia"):
        return []
    try:
        import pynvml
        pynvml.nvmlInit()
        handles = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(h)  # raises where unsupported
            handles.append((f"nvml:gpu{i}", h))
        return handles
    except Exception as e:  # no pynvml, no driver, an old GPU: not available
        log.debug("NVML energy not available: %s", e)
        return []
