"""Energy counters: RAPL read from a powercap tree (a fake one here), wrap-around, and
"not available" where nothing is readable — never an invented figure."""

from __future__ import annotations

import pytest

from shared.energy import EnergyMeter, joules, tokens_per_joule


def domain(root, name, label, uj, wrap=1_000_000):
    d = root / name
    d.mkdir(parents=True)
    (d / "name").write_text(label + "\n")
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{wrap - 1}\n")
    return d


def test_rapl_packages_are_read_and_subdomains_skipped(tmp_path):
    pkg = domain(tmp_path, "intel-rapl:0", "package-0", 100_000)
    domain(tmp_path, "intel-rapl:0:0", "core", 5)
    m = EnergyMeter(str(tmp_path), nvml=False)
    assert m.available and m.domains == ["rapl:package-0"] and m.describe() == "rapl:package-0"
    before = m.read()
    (pkg / "energy_uj").write_text("2600000\n")        # +2.5 J
    used = m.joules_since(before)
    assert used == {"rapl:package-0": pytest.approx(2.5)}
    assert tokens_per_joule(50, used) == pytest.approx(20.0)
    assert m.tick() == {"rapl:package-0": pytest.approx(2.5)}  # since the meter was made
    (pkg / "energy_uj").write_text("2700000\n")
    assert m.tick() == {"rapl:package-0": pytest.approx(0.1)}


def test_wrap_around():
    assert joules(900_000, 100_000, wrap_uj=1_000_000) == pytest.approx(0.2)
    assert joules(100, 50) == 0.0                       # no wrap known: never negative


def test_not_available_is_said_not_invented(tmp_path):
    m = EnergyMeter(str(tmp_path / "missing"), nvml=False)
    assert not m.available and m.read() is None and m.joules_since(None) is None
    assert m.describe().startswith("not available")
    assert tokens_per_joule(100, None) is None
    unreadable = domain(tmp_path, "intel-rapl:1", "package-1", 1)
    (unreadable / "energy_uj").unlink()
    assert not EnergyMeter(str(tmp_path), nvml=False).available
