"""``tandem health``: exit 0 when the service on this host takes work, 1 otherwise (with why).

What a container health check runs (compose.yaml). It reads the service's Prometheus endpoint
(``TANDEM_METRICS_PORT``, default 9100 in the image) and wants every ``tandem_ready`` series at 1:
a worker is ready while connected to NATS and its engine is not stuck in a step
(``TANDEM_STEP_DEADLINE_S``); the router while connected; the KV pool once it serves. The gateway
has its own ``/health`` on its HTTP port.
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import urllib.request


def add_arguments(p: argparse.ArgumentParser) -> None:
    port = os.environ.get("TANDEM_METRICS_PORT") or "9100"
    p.add_argument("--url", default=f"http://127.0.0.1:{port}/metrics",
                   help="the service's /metrics (default: TANDEM_METRICS_PORT on 127.0.0.1, else 9100)")
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


def main(args) -> int:
    try:
        with urllib.request.urlopen(args.url, timeout=args.timeout) as r:
            ok, why = check(r.read().decode())
    except (OSError, ValueError, http.client.HTTPException) as e:   # down, a bad URL, a bad port
        ok, why = False, f"{args.url}: {e}"
    print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
