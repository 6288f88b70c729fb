"""`tandem up --topology`: which processes each topology starts, on one budget."""

from __future__ import annotations

import argparse

import pytest

from services.up import add_arguments, engines, plan, pool_env, topology
from shared.settings import Settings


ENGINES = ("prefill", "gpu-decode", "cpu-decode")


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("name,workers,services,threads,policy", [
    ("single", 2, ["cpu-decode"], "4", "sla"),
    ("replicated", 2, ["cpu-decode", "cpu-decode"], "2", "round-robin"),
    ("replicated", 4, ["cpu-decode"] * 4, "1", "round-robin"),
    ("disaggregated", 2, ["cpu-decode", "prefill"], "2", "sla"),
    ("disaggregated", 3, ["cpu-decode", "cpu-decode", "prefill"], "1", "sla"),
    ("heterogeneous", 2, ["cpu-decode", "gpu-decode"], "2", "sla"),
])
def test_topologies_split_one_budget(name, workers, services, threads, policy):
    args = parse("--topology", name, "--workers", str(workers), "--cores", "4", "--prefill", "5")
    env = topology(args)
    children = plan(args)
    engines = [svc for _, svc in children if svc in ENGINES]
    assert engines == services  # the topology overrides --prefill 5
    assert [svc for _, svc in children][-2:] == ["router", "gateway"]
    assert env == {"TANDEM_THREADS": threads, "TANDEM_ROUTER_POLICY": policy}


def test_engines_per_role():
    assert engines("disaggregated", 2) == {"prefill": 1, "cpu-decode": 1}
    assert engines("heterogeneous", 3) == {"gpu-decode": 1, "cpu-decode": 2}
    assert engines("single", 4) == {"cpu-decode": 1}


def test_no_topology_keeps_the_counts():
    args = parse("--cpu-decode", "2", "--prefill", "0")
    assert topology(args) == {}
    assert [svc for _, svc in plan(args) if svc in ENGINES] == ["cpu-decode", "cpu-decode", "gpu-decode"]


@pytest.mark.parametrize("argv,msg", [
    (("--topology", "disaggregated", "--workers", "1"), "workers >= 2"),
    (("--topology", "replicated", "--workers", "0"), ">= 1"),
    (("--topology", "single", "--cores", "0"), ">= 1"),
])
def test_bad_budgets_are_value_errors(argv, msg):
    with pytest.raises(ValueError, match=msg):
        topology(parse(*argv))


def test_unknown_topology_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        parse("--topology", "mesh")


def test_restarts_back_off_from_half_a_second_doubling_to_ten():
    from services.up import backoff
    assert [backoff(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]


def test_no_pool_service_means_the_workers_use_no_pool():
    """``--kvpool 0``: the workers get TANDEM_POOL=0 (no lookups nobody answers, no KV copied out of a
    finished request for a write-back), unless the environment names it (a pool elsewhere)."""
    for argv, environ, enabled in [((), {}, True), (("--kvpool", "0"), {}, False), (("--kvpool", "2"), {}, True),
                                   (("--kvpool", "0"), {"TANDEM_POOL": "1"}, True)]:
        env = dict(environ, **pool_env(parse(*argv), environ))
        assert Settings.from_env(env).pool.enabled is enabled, (argv, environ)
