"""The Kubernetes manifests (deploy/kubernetes/, services/kube.py), offline: rendered (kustomize's
subset built in; kubectl's where it exists), validated against the Kubernetes API's schemas (the
``kubernetes`` client's models) with their references, the Secrets `tandem kube secrets` makes,
and the podman form scripts/kube-check plays. Running them is scripts/kube-check (by hand)."""

from __future__ import annotations

import base64
import copy
import json
import shutil
import subprocess

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("kubernetes", reason="the kubernetes client (test extra) validates the manifests")

from services import kube  # noqa: E402
from shared import bus_auth  # noqa: E402
from shared.nats_server import find_nats_server  # noqa: E402
from shared.settings import Settings, env_vars  # noqa: E402

ROLES = ("gateway", "router", "prefill", "gpu-decode", "cpu-decode", "kvpool")
PRODUCTION = kube.ROOT / "deploy" / "kubernetes" / "overlays" / "production"


@pytest.fixture(scope="module")
def creds():
    return bus_auth.new_creds()


@pytest.fixture(scope="module")
def secret_docs(creds):
    return kube.secrets(creds)


@pytest.fixture(scope="module")
def base():
    return kube.render_builtin(kube.BASE)


def by_name(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(doc):
    return doc["spec"]["template"]["spec"]["containers"][0]


def decoded(secret, key):
    return base64.b64decode(secret["data"][key]).decode()


def test_the_base_is_valid_against_the_api_schemas_and_its_secrets(base, secret_docs):
    assert kube.validate(base, secret_docs) == []
    assert {d["kind"] for d in base} == {"ConfigMap", "Service", "StatefulSet", "Deployment", "PersistentVolumeClaim"}


def test_the_validator_finds_what_kubernetes_would_refuse(base, secret_docs):
    bad = copy.deepcopy(base)
    deps = by_name(bad, "Deployment")
    container(deps["tandem-router"])["readinessProbe"]["periodSecond"] = 10         # a typo
    container(deps["tandem-prefill"])["resources"]["requests"]["cpu"] = {"n": 4}     # a wrong type
    del container(deps["tandem-kvpool"])["name"]                                     # a required field
    deps["tandem-gateway"]["spec"]["template"]["metadata"]["labels"] = {"x": "y"}   # selector miss
    pool_key = [e for e in container(deps["tandem-cpu-decode"])["env"] if e["name"] == "TANDEM_POOL_KEY"][0]
    pool_key["valueFrom"]["secretKeyRef"]["key"] = "NOPE"
    problems = "\n".join(kube.validate(bad, secret_docs))
    for what in ("tandem-router: spec.template.spec.containers.0.readinessProbe.periodSecond: Extra inputs",
                 "tandem-prefill: spec.template.spec.containers.0.resources.requests.cpu",
                 "tandem-kvpool: spec.template.spec.containers.0.name",
                 "tandem-gateway: selector", "tandem-cpu-decode: env TANDEM_POOL_KEY names key 'NOPE'"):
        assert what in problems, problems
    assert "Secret 'tandem-keys'" in "\n".join(kube.validate(base, []))  # no secrets: references dangle


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")
def test_kubectl_kustomize_renders_the_base_as_the_builtin_does(base):
    def canon(docs):
        return sorted(json.dumps(d, sort_keys=True) for d in docs)
    assert canon(kube.render(kube.BASE)) == canon(base)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) renders the overlay's patches")
def test_the_production_overlay_is_valid_and_places_the_decoders(secret_docs):
    docs = kube.render(PRODUCTION)
    assert kube.validate(docs, secret_docs) == []
    deps = by_name(docs, "Deployment")
    assert all(d["metadata"]["namespace"] == "tandem" for d in docs if d["kind"] != "Namespace")
    assert deps["tandem-cpu-decode"]["spec"]["replicas"] == 4
    assert deps["tandem-cpu-decode"]["spec"]["template"]["spec"]["nodeSelector"] == {"tandem.dev/pool": "cpu"}
    assert "nvidia.com/gpu.present" in deps["tandem-gpu-decode"]["spec"]["template"]["spec"]["nodeSelector"]


def test_nats_is_a_three_server_statefulset_with_jetstream_on_pvcs(base):
    sts = by_name(base, "StatefulSet")["tandem-nats"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "tandem-nats"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    c = container(sts)
    assert c["command"][:2] == ["nats-server", "-c"] and "-sd" in c["command"] and "$(POD_NAME)" in c["command"]
    assert "js-enabled-only" in c["readinessProbe"]["httpGet"]["path"]
    svc = by_name(base, "Service")["tandem-nats"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    url = by_name(base, "ConfigMap")["tandem-env"]["data"]["TANDEM_NATS_URL"]
    assert url.split(",") == [f"nats://tandem-nats-{i}.tandem-nats:4222" for i in range(3)]


def test_one_deployment_per_role_probed_by_tandem_health_with_only_its_credential(base):
    deps = by_name(base, "Deployment")
    assert set(deps) == {f"tandem-{r}" for r in ROLES}
    for role in ROLES:
        d = deps[f"tandem-{role}"]
        c = container(d)
        assert c["command"] == ["tandem", "serve", role]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        for probe in ("readinessProbe", "livenessProbe"):
            p = c[probe]
            assert p.get("exec", {}).get("command") == ["tandem", "health"] or role == "gateway", (role, probe)
        bus = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "bus"][0]
        assert bus["secret"]["secretName"] == f"tandem-bus-{bus_auth.role_of(role)}"
    assert container(deps["tandem-gateway"])["readinessProbe"]["httpGet"]["path"] == "/health"
    assert by_name(base, "Service")["tandem-gateway"]["spec"]["ports"][0]["port"] == 8000
    gpu = [r for r in ROLES if "nvidia.com/gpu" in (container(deps[f"tandem-{r}"])["resources"].get("limits") or {})]
    assert gpu == ["gpu-decode"]
    shared = by_name(base, "PersistentVolumeClaim")["tandem-kvpool-shared"]
    assert shared["spec"]["accessModes"] == ["ReadWriteMany"]
    # the pool secret: the engine workers MAC entries with it, the pool must not hold it (it could
    # forge an entry); the data-plane key: every pod that binds the data plane beyond loopback
    for role in ROLES:
        env = {e["name"] for e in container(deps[f"tandem-{role}"]).get("env", [])}
        assert ("TANDEM_POOL_KEY" in env) == (role in ("prefill", "gpu-decode", "cpu-decode")), role
        assert ("TANDEM_DATA_KEY" in env) == (role not in ("gateway", "router")), role


def test_environment_only_known_tandem_variables_and_valid_settings(base):
    known = {var for var, _d, _h in env_vars()}
    common = by_name(base, "ConfigMap")["tandem-env"]["data"]
    for name, d in by_name(base, "Deployment").items():
        env = dict(common)
        env.update({e["name"]: e.get("value", "x" * 64) for e in container(d).get("env", [])})
        unknown = sorted(set(env) - known)
        assert not unknown, f"{name}: unknown variables {unknown}"
        Settings.from_env(env)


def test_secrets_nats_config_routes_and_one_role_per_secret(secret_docs, creds, tmp_path):
    secrets = by_name(secret_docs, "Secret")
    assert set(secrets) == {"tandem-nats-config", "tandem-keys"} | {f"tandem-bus-{r}" for r in kube.BUS_ROLES}
    for role in kube.BUS_ROLES:
        own = json.loads(decoded(secrets[f"tandem-bus-{role}"], "nats.creds"))
        assert own["users"] == {role: creds["users"][role]}
    conf = decoded(secrets["tandem-nats-config"], "nats-server.conf")
    password = creds["route"]["password"]
    for i in range(3):
        assert f"tandem-route:{password}@tandem-nats-{i}.tandem-nats:6222" in conf
    path = tmp_path / "nats-server.conf"
    path.write_text(conf)
    check = subprocess.run([str(find_nats_server()), "-c", str(path), "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert set(secrets["tandem-keys"]["data"]) == set(kube.KEYS)


def test_the_podman_form_has_pods_configmaps_and_volumes_only(base, secret_docs):
    form = kube.podman_form(base, secret_docs, image="localhost/x", gateway_port=18000, prefix="t-")
    assert {d["kind"] for d in form} == {"Pod", "ConfigMap", "PersistentVolumeClaim"}
    assert kube.validate(form, []) == []          # every reference inside the form
    pods = by_name(form, "Pod")
    assert {"t-tandem-nats-0", "t-tandem-nats-1", "t-tandem-nats-2"} <= set(pods)
    assert not any("gpu-decode" in p for p in pods)
    nats0 = pods["t-tandem-nats-0"]["spec"]
    assert nats0["containers"][0]["command"][4] == "t-tandem-nats-0"      # -n: the pod's name
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "t-data-tandem-nats-0"}} in nats0["volumes"]
    env = by_name(form, "ConfigMap")["t-tandem-env"]["data"]
    assert env["TANDEM_NATS_URL"] == ",".join(f"nats://t-tandem-nats-{i}:4222" for i in range(3))
    conf = by_name(form, "ConfigMap")["t-tandem-nats-config"]["data"]["nats-server.conf"]
    assert "@t-tandem-nats-2:6222" in conf and ".tandem-nats" not in conf
    gw = pods["t-tandem-gateway-0"]["spec"]["containers"][0]
    assert gw["ports"][0] == {"name": "http", "containerPort": 8000, "hostPort": 18000, "hostIP": "127.0.0.1"}
    assert all(c["image"] == "localhost/x" and "resources" not in c for p in pods.values() for c in p["spec"]["containers"])


def test_tandem_kube_cli_renders_and_validates(capsys):
    from services.cli import main
    assert main(["kube", "validate", "--builtin"]) == 0
    assert "valid" in capsys.readouterr().out


def test_kube_check_offline_renders_and_validates():
    """scripts/kube-check's first step, as it runs by hand (its play step needs podman and root)."""
    import os
    import sys
    from pathlib import Path
    assert subprocess.run(["bash", "-n", str(kube.ROOT / "scripts" / "kube-check")]).returncode == 0
    env = dict(os.environ, TANDEM_VENV=str(Path(sys.executable).parent.parent))
    res = subprocess.run(["bash", str(kube.ROOT / "scripts" / "kube-check"), "--offline"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "objects (ConfigMap, Deployment, PersistentVolumeClaim, Service, StatefulSet): valid" in res.stdout
    assert "validated against the Kubernetes API schemas" in res.stdout
