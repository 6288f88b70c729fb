"""``tandem serve gateway`` started as the container image starts it (docs/security.md)."""

from __future__ import annotations

import os
import subprocess
import sys

from shared.nats_server import free_port


def test_the_gateway_says_so_at_start():
    """`tandem serve gateway` as the container image runs it (TANDEM_HOST=0.0.0.0), no key: the
    warning is logged before anything else can fail (here: no NATS to connect to)."""
    env = dict(os.environ, TANDEM_HOST="0.0.0.0", TANDEM_PORT=str(free_port()),
               TANDEM_NATS_URL=f"nats://127.0.0.1:{free_port()}", TANDEM_API_KEY="", TANDEM_API_KEYS="")
    res = subprocess.run([sys.executable, "-m", "services.cli", "serve", "gateway"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0  # no NATS
    assert "listens on 0.0.0.0 WITHOUT AN API KEY" in res.stderr, res.stderr[-2000:]
