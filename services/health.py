"""``tandem health``: exit 0 when the service on this host takes work, 1 otherwise (with why).

What a container health check runs (compose.yaml). It reads the service's Prometheus endpoint
(``TANDEM_METRICS_PORT``, default 9100 in the image) and wants every ``tandem_ready`` series at 1:
a worker is ready while connected to NATS and its engine is not stuck in a step
(``TANDEM_STEP_DEADLINE_S``); the router while connected; the KV pool once it serves. The gateway
has its own ``/health`` on its HTTP port: a ``--url`` of ``/health``, or of the bare gateway address
(``http://host:8000``), checks that (ready: 200; its roles' details otherwise).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request


def add_arguments(p: argparse.ArgumentParser) -> None:
    port = os.environ.get("TANDEM_METRICS_PORT") or "9100"
    p.add_argument("--url", default=f"http://127.0.0.1:{port}/metrics",
                   help="the service's /metrics (default: TANDEM_METRICS_PORT on 127.0.0.1, else 9100), or the "
                        "gateway's address or /health")
    p.add_argument("--timeout", type=_seconds, default=3.0, help="seconds to wait for the answer (default 3)")


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return v


def check(text: str) -> tuple[bool, str]:
    """(healthy, why) from a Prometheus text exposition."""
    ready = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("tandem_ready{")}
    if not ready:
        return False, ("no tandem_ready series: the service is still starting, or exports none (the gateway's "
                       "check is its /health on the HTTP port)")
    down = [k for k, v in ready.items() if v != 1.0]
    return (False, "not ready: " + ", ".join(down)) if down else (True, "ready: " + ", ".join(ready))


def check_gateway(status: int, body: bytes) -> tuple[bool, str]:
    """(healthy, why) from the gateway's ``/health`` answer (200 ready, 503 not, its roles' details)."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = {}
    details = doc.get("details") if isinstance(doc, dict) else None
    down = [role for role, d in (details or {}).items() if isinstance(d, dict) and not d.get("ready")]
    if status == 200:   # ready (a router and a decode worker); the roles with none said apart
        up = sorted(role for role, d in (details or {}).items() if isinstance(d, dict) and d.get("ready"))
        return True, "ready: gateway" + (f" ({', '.join(up)})" if up else "") + (
            f"; none of {', '.join(sorted(down))}" if down else "")
    return False, f"not ready: gateway (HTTP {status}" + (f"; no ready {', '.join(down)}" if down else "") + ")"


def main(args) -> int:
    url = args.url
    parts = urllib.parse.urlsplit(url)
    gateway = parts.path in ("", "/", "/health")
    if gateway:
        url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as r:
            ok, why = check_gateway(r.status, r.read()) if gateway else check(r.read().decode())
    except urllib.error.HTTPError as e:    # the gateway's 503 (not ready) comes here
        ok, why = check_gateway(e.code, e.read()) if gateway and e.code == 503 else (False, f"{url}: {e}")
    except (OSError, ValueError, http.client.HTTPException) as e:   # down, a bad URL, a bad port
        ok, why = False, f"{url}: {e}"
        if not gateway and isinstance(e, (ConnectionError, urllib.error.URLError)):
            why += ("; nothing serves metrics there: a service exports them on TANDEM_METRICS_PORT (a container "
                    "sets it), `tandem up`'s on ports of their own (its log); the gateway's check is --url "
                    "http://HOST:8000")
    print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
