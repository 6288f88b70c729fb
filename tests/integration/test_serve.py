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


def test_the_gateway_exits_0_after_its_drain(nats_server, tmp_path):
    """SIGTERM to `tandem serve gateway` (a rolling update): it drains and exits 0, as the other
    services do — uvicorn raised the signal again after its shutdown, and the process died of it
    (-15: 143 in a container, a failed pod for every clean restart)."""
    import signal
    import time
    base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env = dict(base, HOME=str(tmp_path), TANDEM_PORT=str(free_port()), TANDEM_NATS_URL=nats_server,
               TANDEM_NATS_CREDS_FILE="", TANDEM_METRICS_PORT="-1")
    p = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "gateway"], env=env, text=True,
                         stderr=subprocess.PIPE)
    try:
        seen = []
        for line in p.stderr:
            seen.append(line)
            if "Uvicorn running on" in line:
                break
        assert p.poll() is None, "".join(seen)
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=60)
        assert rc == 0, "".join(seen) + p.stderr.read()
    finally:
        p.kill()
