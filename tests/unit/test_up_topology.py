"""`tandem up --topology`: which processes each topology starts, on one budget."""

from __future__ import annotations

import argparse

import pytest

from services.up import add_arguments, engines, plan, pool_env, stack_env, topology
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


def test_preflight_names_a_bad_model_and_a_taken_port(tmp_path):
    """What would make every copy of a service fail alike is a clear error before anything starts
    (it was five tracebacks a copy, then a stack serving nothing)."""
    import socket

    from services.up import preflight
    from shared.nats_server import free_port
    free = str(free_port())
    text = tmp_path / "x.gguf"
    text.write_text("not a model")
    trunc = tmp_path / "t.gguf"
    from shared.engine.model_files import bundled_model_path
    trunc.write_bytes(open(bundled_model_path(), "rb").read(4096))
    for model in (str(tmp_path / "missing.gguf"), str(text), str(trunc)):
        with pytest.raises(ValueError, match="cannot load model"):
            preflight(Settings.from_env({"TANDEM_MODEL": model, "TANDEM_PORT": free}))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port 127.0.0.1:{port} cannot be used"):
            preflight(Settings.from_env({"TANDEM_PORT": str(port)}))
    preflight(Settings.from_env({"TANDEM_PORT": free}))   # the bundled model, a free port: nothing to say
    # a pool directory that cannot be made (under a file, in /proc): one line, not a kvpool crash
    # loop of tracebacks under a /health that says ready; nothing to say where no pool runs
    for bad in (str(text / "kvpool"), "/proc/tandem-kvpool"):
        for name in ("TANDEM_POOL_DIR", "TANDEM_POOL_SHARED_DIR"):
            env = {"TANDEM_PORT": free, name: bad}
            with pytest.raises(ValueError, match=f"{name}={bad} cannot be used"):
                preflight(Settings.from_env(env))
            preflight(Settings.from_env(env), pool=False)
    made = tmp_path / "pool" / "disk"
    preflight(Settings.from_env({"TANDEM_PORT": free, "TANDEM_POOL_DIR": str(made)}))
    # TANDEM_NATS_URL naming no server: every copy crash-looped on it for half a minute
    with pytest.raises(ValueError, match="no NATS server answers at TANDEM_NATS_URL=nats://127.0.0.1:1"):
        preflight(Settings.from_env({"TANDEM_PORT": free, "TANDEM_NATS_URL": "nats://127.0.0.1:1"}), pool=False)
    # fixed data / ring ports for several processes, hosts no server can bind, a store that is a file
    for var, kw in (("TANDEM_DATA_PORT", {"data_servers": 3}), ("TANDEM_RING_PORT", {"ring_servers": 2})):
        with pytest.raises(ValueError, match=f"{var}=7123 is one port, but"):
            preflight(Settings.from_env({"TANDEM_PORT": free, var: "7123"}), pool=False, **kw)
    for var in ("TANDEM_METRICS_HOST", "TANDEM_DATA_HOST"):
        with pytest.raises(ValueError, match=f"{var}=nan cannot be bound"):
            preflight(Settings.from_env({"TANDEM_PORT": free, var: "nan", "TANDEM_DATA_KEY": "k"}), pool=False)
    with pytest.raises(ValueError, match="TANDEM_NATS_STORE_DIR=.* is not a directory"):
        preflight(Settings.from_env({"TANDEM_PORT": free, "TANDEM_NATS_STORE_DIR": str(text)}), pool=False)
    # a fixed metrics port for several processes: all but the first crash-looped on EADDRINUSE
    with pytest.raises(ValueError, match="TANDEM_METRICS_PORT=9100 is one port, but 4 processes"):
        preflight(Settings.from_env({"TANDEM_PORT": free, "TANDEM_METRICS_PORT": "9100"}), metrics_servers=4)
    preflight(Settings.from_env({"TANDEM_PORT": free, "TANDEM_METRICS_PORT": "9100"}), pool=False)
    # a key file that cannot be read (a directory): every worker crash-looped on it, a traceback each
    for name in ("TANDEM_DATA_KEY_FILE", "TANDEM_POOL_KEY_FILE"):
        with pytest.raises(ValueError, match=f"{name}={tmp_path} cannot be read"):
            preflight(Settings.from_env({"TANDEM_PORT": free, name: str(tmp_path)}), pool=False)
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700


def test_a_supervised_nats_is_in_its_own_group_and_dies_with_its_supervisor(tmp_path):
    """`tandem up`'s NATS: out of the terminal's process group (a Ctrl-C reaches the supervisor,
    which stops the services first and NATS last: NATS died at once and cut every stream), and
    gone when the supervisor is killed -9 (it lived on, holding its port and its store)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from shared.nats_server import EmbeddedNats\n"
        "n = EmbeddedNats(supervised=True)\n"
        "n.start()\n"
        "print(n.proc.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        nats_pid = int(child.stdout.readline())
        assert os.getpgid(nats_pid) == nats_pid != os.getpgid(child.pid)
        child.kill()
        child.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(nats_pid, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{nats_pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] == "Z":
                    break
            time.sleep(0.1)
        else:
            os.kill(nats_pid, signal.SIGKILL)
            raise AssertionError("the supervised nats-server outlived its supervisor")
    finally:
        child.kill()


def test_copies_get_the_command_line_settings_but_not_unknown_variables():
    """A typo'd TANDEM_ variable is said once by the command (services/cli.py); `tandem up` does
    not hand it to every copy to say again. Known ones pass through."""
    env = stack_env(parse("--port", "18123"), {"TANDEM_THREDS": "4", "TANDEM_THREADS": "2",
                                               "TANDEM_GPU_AHEAD": "1", "PATH": "/bin"})
    assert env["TANDEM_PORT"] == "18123" and env["TANDEM_THREADS"] == "2" and env["TANDEM_GPU_AHEAD"] == "1"
    assert "TANDEM_THREDS" not in env and env["PATH"] == "/bin"


def test_port_0_is_refused_not_taken_for_unset():
    """`tandem up --port 0` served on 8000."""
    env = stack_env(parse("--port", "0"), {})
    with pytest.raises(ValueError, match="TANDEM_PORT must be in 1..65535, got 0"):
        Settings.from_env(env)
