"""``tandem kube``: Tandem's Kubernetes manifests (deploy/kubernetes/, kustomize) and their checks.

    tandem kube secrets > secrets.yaml     # the Secrets the manifests mount (bus, keys); made once
    tandem kube render [DIR]               # kustomize build: kubectl's, else the built-in subset
    tandem kube validate [DIR]             # every object against the Kubernetes API schemas
    tandem kube podman [DIR] --secrets F   # the form `podman kube play` runs (scripts/kube-check)

``secrets``: a cluster configuration for the NATS StatefulSet (shared/nats_cluster.py: routes to
``tandem-nats-<i>.tandem-nats``, the route credential, the role users), one Secret per bus role
holding only that role's entry of the credentials file (a cpu-decode pod cannot log in as the
gateway), and the keys (API bearer token, pool MAC key, data-plane key). The credentials come
from TANDEM_NATS_CREDS_FILE (made when missing; kept, so running it again gives the same).

``validate``: offline, with the ``kubernetes`` Python client's models (pydantic, generated from
the Kubernetes OpenAPI schema): unknown fields, wrong types and missing required fields fail, as
well as what the schema cannot say: a selector that misses its pod labels, a mount of a volume
not declared, a probe on a port not named, a ConfigMap or Secret (key) referenced that neither
the render nor ``tandem kube secrets`` makes.

``podman``: what Kubernetes does that podman 4.3's ``kube play`` cannot, done beforehand: each
StatefulSet and Deployment becomes its pods (``name-0``...; a StatefulSet's claim templates become
PVCs, podman volumes), Secrets become ConfigMaps, Services go (pods reach each other by name on
one podman network), DNS names ``pod.service`` become ``pod``, ``status.podIP`` becomes the
pod's name (podman's DNS resolves it), probes other than exec liveness, resource requests, node selectors, affinities,
tolerations and GPU workers go, and container ports too but the gateway's, published on loopback
(podman publishes each one on the host).
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import logging
import re
import secrets as _secrets
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from shared import bus_auth, nats_cluster
from shared.settings import Settings

log = logging.getLogger("tandem.kube")

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "deploy" / "kubernetes" / "base"
NATS = "tandem-nats"                      # the StatefulSet and its headless Service
NATS_SERVERS = 3
KEYS = ("TANDEM_API_KEY", "TANDEM_POOL_KEY", "TANDEM_DATA_KEY")
BUS_ROLES = (bus_auth.GATEWAY, bus_auth.ROUTER, bus_auth.WORKER, bus_auth.KVPOOL, bus_auth.TAP)
API_GROUPS = {"Namespace": "v1", "ConfigMap": "v1", "Secret": "v1", "Service": "v1", "PersistentVolumeClaim": "v1",
              "Pod": "v1", "Deployment": "apps/v1", "StatefulSet": "apps/v1"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="kube_command", metavar="ACTION", required=True)
    s = sub.add_parser("secrets", help="the Secrets the manifests mount, as YAML")
    s.add_argument("--nats-servers", type=int, default=NATS_SERVERS, help="servers of the NATS StatefulSet")
    s.add_argument("--cluster-domain", default="", help="suffix of the route names, e.g. .tandem.svc.cluster.local")
    s.add_argument("--route-names", default=None, help="the servers' route addresses, comma-separated "
                   "(default tandem-nats-<i>.tandem-nats<domain>:6222)")
    for flag in ("--tls-cert", "--tls-key", "--tls-ca"):
        s.add_argument(flag, default=None, help="for the NATS servers (paths inside their pods)")
    s.add_argument("--out", default="-", help="file (mode 0600) or '-' (stdout)")
    for name, help_text in (("render", "kustomize build of DIR"), ("validate", "check DIR's render offline"),
                            ("podman", "DIR's render as podman kube play runs it")):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("dir", nargs="?", default=str(BASE), help=f"a kustomization (default {BASE})")
        q.add_argument("--builtin", action="store_true", help="render with the built-in subset even with kubectl")
        if name == "validate":
            q.add_argument("--secrets", default=None, help="a `tandem kube secrets` file the render's references must match")
        if name == "podman":
            q.add_argument("--secrets", required=True, help="a `tandem kube secrets` file (its Secrets become ConfigMaps)")
            q.add_argument("--image", default=None, help="the image every pod runs (a local one)")
            q.add_argument("--gateway-port", type=int, default=8000, help="the gateway's port on 127.0.0.1")
            q.add_argument("--prefix", default="", help="put before every name (pods, volumes)")


# -- secrets ----------------------------------------------------------------------------------

def secrets(creds: dict, *, servers: int = NATS_SERVERS, domain: str = "", routes: list[str] | None = None,
            tls: tuple[str | None, str | None, str | None] = (None, None, None),
            keys: dict | None = None) -> list[dict]:
    """The Secret objects: ``tandem-nats-config``, ``tandem-bus-<role>``, ``tandem-keys``."""
    routes = routes or [f"{NATS}-{i}.{NATS}{domain}:{nats_cluster.DEFAULT_ROUTE_PORT}" for i in range(servers)]
    conf = nats_cluster.cluster_config(creds, routes, tls_cert=tls[0], tls_key=tls[1], tls_ca=tls[2])
    text = "".join(f"{k}: {json.dumps(v, indent=1)}\n" for k, v in conf.items())
    out = [_secret("tandem-nats-config", {"nats-server.conf": text})]
    for role in BUS_ROLES:
        own = {"version": creds.get("version", 1), "users": {role: creds["users"][role]}}
        out.append(_secret(f"tandem-bus-{role}", {"nats.creds": json.dumps(own, indent=1)}))
    keys = keys or {k: _secrets.token_hex(32 if k != "TANDEM_API_KEY" else 24) for k in KEYS}
    out.append(_secret("tandem-keys", keys))
    return out


def _secret(name: str, data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "tandem"}},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def dump(docs: list[dict]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


# -- render -----------------------------------------------------------------------------------

def render(path: str | Path = BASE, builtin: bool = False) -> list[dict]:
    """The objects of the kustomization at ``path``: ``kubectl kustomize`` when kubectl is here
    (and not ``builtin``), else the built-in subset (below)."""
    kubectl = shutil.which("kubectl")
    if kubectl and not builtin:
        out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise ValueError(f"kubectl kustomize {path}: {out.stderr.strip()}")
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    return render_builtin(path)


def render_builtin(path: str | Path) -> list[dict]:
    """kustomize's ``resources`` (files and directories), ``namespace``, ``labels`` (pairs, on
    metadata), ``replicas`` and ``images``: what deploy/kubernetes/base uses, so it renders
    without kubectl. Anything else (patches, generators) asks for kubectl."""
    root = Path(path)
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "namespace", "labels", "replicas", "images"}
    if unknown:
        raise ValueError(f"{root}/kustomization.yaml uses {sorted(unknown)}: render it with kubectl kustomize")
    docs: list[dict] = []
    for r in k.get("resources", []):
        p = root / r
        docs += render_builtin(p) if p.is_dir() else [d for d in yaml.safe_load_all(p.read_text()) if d]
    for d in docs:
        meta = d.setdefault("metadata", {})
        if k.get("namespace"):
            meta["namespace"] = k["namespace"]
        for lab in k.get("labels", []):
            meta.setdefault("labels", {}).update(lab.get("pairs", {}))
        for rep in k.get("replicas", []):
            if meta.get("name") == rep["name"] and d["kind"] in ("Deployment", "StatefulSet"):
                d["spec"]["replicas"] = rep["count"]
        for c in _containers(d):
            for img in k.get("images", []):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag or 'latest')}"
    return docs


def _pod_spec(d: dict) -> dict | None:
    if d.get("kind") == "Pod":
        return d.get("spec")
    if d.get("kind") in ("Deployment", "StatefulSet"):
        return d.get("spec", {}).get("template", {}).get("spec")
    return None


def _containers(d: dict) -> list[dict]:
    spec = _pod_spec(d) or {}
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


# -- validate ---------------------------------------------------------------------------------

def validate(docs: list[dict], secret_docs: list[dict] | None = None) -> list[str]:
    """Every problem found (empty: valid). ``secret_docs``: the Secrets applied beside the
    render (``tandem kube secrets``); references to others are problems."""
    from kubernetes import client  # the test extra: the Kubernetes API's models (pydantic)
    from pydantic import ValidationError
    problems: list[str] = []
    names: dict[str, dict[str, set[str]]] = {"ConfigMap": {}, "Secret": {}}
    seen: set[tuple[str, str]] = set()
    for d in list(docs) + list(secret_docs or []):
        kind, name = d.get("kind", "?"), d.get("metadata", {}).get("name", "?")
        where = f"{kind}/{name}"
        if (kind, name) in seen:
            problems.append(f"{where}: defined twice")
        seen.add((kind, name))
        if API_GROUPS.get(kind) != d.get("apiVersion"):
            problems.append(f"{where}: apiVersion {d.get('apiVersion')!r}, expected {API_GROUPS.get(kind, 'a known kind')!r}")
            continue
        model = getattr(client, "V1" + kind)
        try:
            model.model_validate(d)
        except ValidationError as e:
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"])
                problems.append(f"{where}: {loc}: {err['msg']}")
        if kind in names:
            names[kind][name] = set(d.get("data", {}) or {}) | set(d.get("stringData", {}) or {})
    for d in docs:
        problems += _references(d, names)
    return problems


def _references(d: dict, names: dict[str, dict[str, set[str]]]) -> list[str]:
    where = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
    spec = _pod_spec(d)
    if spec is None:
        return []
    out: list[str] = []
    if d["kind"] in ("Deployment", "StatefulSet"):
        want = d["spec"].get("selector", {}).get("matchLabels", {})
        have = d["spec"].get("template", {}).get("metadata", {}).get("labels", {})
        if not want or any(have.get(k) != v for k, v in want.items()):
            out.append(f"{where}: selector {want} does not match the pod labels {have}")

    def ref(kind: str, name: str, key: str | None, what: str) -> None:
        if name not in names[kind]:
            out.append(f"{where}: {what} names {kind} {name!r}, which neither the render nor the secrets make")
        elif key is not None and key not in names[kind][name]:
            out.append(f"{where}: {what} names key {key!r} of {kind} {name!r}, which has {sorted(names[kind][name])}")

    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    claims = {t["metadata"]["name"] for t in d.get("spec", {}).get("volumeClaimTemplates", [])}
    for v in volumes.values():
        if "secret" in v:
            ref("Secret", v["secret"]["secretName"], None, f"volume {v['name']}")
        if "configMap" in v:
            ref("ConfigMap", v["configMap"]["name"], None, f"volume {v['name']}")
    for c in _containers(d):
        c = dict(c, name=c.get("name", "?"))   # a missing name is the schema's finding
        ports = {p.get("name") for p in c.get("ports", [])}
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes and m["name"] not in claims:
                out.append(f"{where}: container {c['name']} mounts {m['name']!r}, not a volume of the pod")
        for e in c.get("envFrom", []):
            if "configMapRef" in e:
                ref("ConfigMap", e["configMapRef"]["name"], None, f"container {c['name']} envFrom")
            if "secretRef" in e:
                ref("Secret", e["secretRef"]["name"], None, f"container {c['name']} envFrom")
        for e in c.get("env", []):
            src = e.get("valueFrom", {})
            if "secretKeyRef" in src:
                ref("Secret", src["secretKeyRef"]["name"], src["secretKeyRef"]["key"], f"env {e['name']}")
            if "configMapKeyRef" in src:
                ref("ConfigMap", src["configMapKeyRef"]["name"], src["configMapKeyRef"]["key"], f"env {e['name']}")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe) or {}
            port = (p.get("httpGet") or p.get("tcpSocket") or {}).get("port")
            if isinstance(port, str) and port not in ports:
                out.append(f"{where}: {probe} of {c['name']} uses port {port!r}, not one it names")
    return out


# -- podman -----------------------------------------------------------------------------------

def podman_form(docs: list[dict], secret_docs: list[dict], *, image: str | None = None,
                gateway_port: int = 8000, prefix: str = "") -> list[dict]:
    """The render (and its Secrets) as podman 4.3's ``kube play`` runs it (the module doc)."""
    out: list[dict] = []
    rename = (lambda n: f"{prefix}{n}") if prefix else (lambda n: n)
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    for s in secret_docs:            # Secrets -> ConfigMaps (the decoded text)
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": rename(s["metadata"]["name"])},
                    "data": {k: _undns(base64.b64decode(v).decode(), services, rename)
                             for k, v in s.get("data", {}).items()}})
    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind == "Service":
            continue
        if kind in ("ConfigMap", "PersistentVolumeClaim"):
            d = copy.deepcopy(d)
            d["metadata"] = {"name": rename(name)}
            if kind == "ConfigMap":
                d["data"] = {k: _undns(v, services, rename) for k, v in d.get("data", {}).items()}
            out.append(d)
            continue
        if kind not in ("Deployment", "StatefulSet"):
            raise ValueError(f"{kind}/{name}: no podman form")
        if any("nvidia.com/gpu" in (c.get("resources", {}).get("limits") or {}) for c in _containers(d)):
            log.info("%s/%s left out: it needs a GPU", kind, name)
            continue
        templates = d["spec"].get("volumeClaimTemplates", [])
        for i in range(d["spec"].get("replicas", 1)):
            pod_name = rename(f"{name}-{i}")
            for t in templates:
                out.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                            "metadata": {"name": f"{rename(t['metadata']['name'])}-{name}-{i}"},
                            "spec": copy.deepcopy(t["spec"])})
            spec = copy.deepcopy(d["spec"]["template"]["spec"])
            for key in ("affinity", "nodeSelector", "tolerations", "terminationGracePeriodSeconds"):
                spec.pop(key, None)
            spec["hostname"] = pod_name
            for v in spec.get("volumes", []):
                if "secret" in v:
                    v["configMap"] = {"name": rename(v.pop("secret")["secretName"])}
                elif "configMap" in v:
                    v["configMap"] = {"name": rename(v["configMap"]["name"])}
                if "persistentVolumeClaim" in v:
                    v["persistentVolumeClaim"]["claimName"] = rename(v["persistentVolumeClaim"]["claimName"])
                if "emptyDir" in v:
                    v["emptyDir"] = {}
            for t in templates:
                spec.setdefault("volumes", []).append({"name": t["metadata"]["name"], "persistentVolumeClaim": {
                    "claimName": f"{rename(t['metadata']['name'])}-{name}-{i}"}})
            for c in spec["containers"]:
                c.pop("resources", None)
                if image:
                    c["image"] = image
                for e in c.get("envFrom", []):
                    for r in ("configMapRef", "secretRef"):
                        if r in e:
                            e["configMapRef"] = {"name": rename(e.pop(r)["name"])}
                env = []
                for e in c.get("env", []):
                    src = e.get("valueFrom", {})
                    if src.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                        e = {"name": e["name"], "value": pod_name}   # its name on the podman network
                        env.append(e)
                        continue
                    if "secretKeyRef" in src:
                        e = {"name": e["name"], "valueFrom": {"configMapKeyRef": {
                            "name": rename(src["secretKeyRef"]["name"]), "key": src["secretKeyRef"]["key"]}}}
                    if "fieldRef" in src:   # podman 4.3 has no downward API for env: the value it means
                        e = {"name": e["name"], "value": pod_name}
                    if "value" in e:
                        e["value"] = _undns(e["value"], services, rename)
                    env.append(e)
                c["env"] = env
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if probe != "livenessProbe" or "exec" not in c.get(probe, {"exec": 0}):
                        c.pop(probe, None)     # podman 4.3 runs liveness only, httpGet with curl (not in the image)
                # podman publishes every containerPort on the host: only the gateway's, on loopback
                c["ports"] = [dict(p, hostPort=gateway_port, hostIP="127.0.0.1") for p in c.get("ports", [])
                              if name == "tandem-gateway" and p["containerPort"] == 8000]
                if not c["ports"]:
                    del c["ports"]
                values = {e["name"]: e["value"] for e in env if "value" in e}
                c["command"] = [re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)),
                                       _undns(a, services, rename)) for a in c.get("command", [])]
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": pod_name, "labels": dict(d["spec"]["template"]["metadata"].get("labels", {}))},
                        "spec": spec})
    return out


def _undns(text: str, services: set[str], rename) -> str:
    """``pod.service[.ns.svc...]`` -> ``pod`` (renamed): podman resolves pod names, not Services."""
    for svc in services:
        text = re.sub(rf"\b([a-z0-9-]+)\.{re.escape(svc)}(?:\.[a-z0-9.-]+)?(?=[:/,\s]|$)",
                      lambda m: rename(m.group(1)), text)
    return text


# -- main -------------------------------------------------------------------------------------

def _load(path: str | None) -> list[dict]:
    if not path:
        return []
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def main(args: argparse.Namespace) -> int:
    try:
        if args.kube_command == "secrets":
            path = Settings.from_env().nats.creds_file
            if not path:
                raise ValueError("TANDEM_NATS_CREDS_FILE is empty: nothing to keep the credentials in")
            routes = [r.strip() for r in args.route_names.split(",")] if args.route_names else None
            text = dump(secrets(bus_auth.ensure_creds(path), servers=args.nats_servers, domain=args.cluster_domain,
                                routes=routes, tls=(args.tls_cert, args.tls_key, args.tls_ca)))
            if args.out == "-":
                sys.stdout.write(text)
            else:
                bus_auth.write_private(args.out, text, replace=True)
            return 0
        docs = render(args.dir, args.builtin)
        if args.kube_command == "render":
            sys.stdout.write(dump(docs))
        elif args.kube_command == "validate":
            problems = validate(docs, _load(args.secrets) or secrets(bus_auth.new_creds()))
            for p in problems:
                print(f"INVALID {p}")
            kinds = sorted({d["kind"] for d in docs})
            print(f"{len(docs)} objects ({', '.join(kinds)}): {'valid' if not problems else f'{len(problems)} problem(s)'}")
            return 1 if problems else 0
        else:
            sys.stdout.write(dump(podman_form(docs, _load(args.secrets), image=args.image,
                                              gateway_port=args.gateway_port, prefix=args.prefix)))
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2
    return 0
