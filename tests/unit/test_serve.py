"""``tandem serve``: the start-up warning of a gateway that serves anyone (docs/security.md)."""

from __future__ import annotations

import pytest

from services.serve import exposure_warning


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "[::]", "gateway.example.com"])
def test_beyond_loopback_without_a_key_warns(host):
    warning = exposure_warning(host, has_keys=False)
    assert warning is not None and host in warning and "TANDEM_API_KEY" in warning


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_or_a_key_is_quiet(host):
    assert exposure_warning(host, has_keys=False) is None
    assert exposure_warning("0.0.0.0", has_keys=True) is None



def _serve(*argv: str, **env: str):
    import os
    import subprocess
    import sys
    from pathlib import Path
    base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return subprocess.run([sys.executable, "-m", "services.cli", "serve", *argv],
                          cwd=Path(__file__).resolve().parents[2], env={**base, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, env, rc, said", [
    (["router"], {}, 2, "no NATS server: set TANDEM_NATS_URL"),
    (["gateway", "--port", "0"], {"TANDEM_NATS_URL": "nats://127.0.0.1:1"}, 2, "TANDEM_PORT must be in 1..65535"),
    (["router"], {"TANDEM_NATS_URL": "nats://127.0.0.1:1", "TANDEM_NATS_CONNECT_TIMEOUT": "0.5"}, 1,
     "cannot connect to NATS at nats://127.0.0.1:1"),
    (["cpu-decode"], {"TANDEM_NATS_URL": "nats://127.0.0.1:1", "TANDEM_DATA_HOST": "0.0.0.0",
                      "TANDEM_DATA_ADVERTISE_HOST": "10.0.0.7", "TANDEM_DATA_KEY_FILE": "/nonexistent/data.key"}, 2,
     "TANDEM_DATA_HOST=0.0.0.0 takes KV from beyond this machine, but there is no data-plane key"),
    # a key file that is a directory: every copy crash-looped on it with a traceback
    (["cpu-decode"], {"TANDEM_NATS_URL": "nats://127.0.0.1:1", "TANDEM_DATA_KEY_FILE": "/"}, 2,
     "TANDEM_DATA_KEY_FILE=/ cannot be read (Is a directory)"),
    (["kvpool"], {"TANDEM_NATS_URL": "nats://127.0.0.1:1", "TANDEM_POOL_KEY_FILE": "/"}, 2,
     "TANDEM_POOL_KEY_FILE=/ cannot be read (Is a directory)"),
])
def test_a_service_that_cannot_start_says_why_in_one_line(argv, env, rc, said):
    """No NATS, a bad flag, NATS unreachable: one line and an exit code (they were tracebacks)."""
    out = _serve(*argv, **env)
    assert out.returncode == rc, out.stderr
    assert said in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_metrics_port_another_process_has_is_one_line():
    """A fixed TANDEM_METRICS_PORT already bound: it was an OSError traceback (and, under `tandem
    up`, a crash loop of every copy but the first)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _serve("router", TANDEM_NATS_URL="nats://127.0.0.1:1", TANDEM_METRICS_PORT=str(port))
    assert out.returncode == 2, out.stderr
    assert f"TANDEM_METRICS_PORT={port}: Address already in use" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_serve_gateway_takes_the_flags_docs_api_md_lists():
    """--default-tier was documented but not taken by `tandem serve gateway`; an API key has no
    flag on purpose (a command line is in every user's `ps`)."""
    from services.serve import add_arguments
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["gateway", "--default-tier", "batch", "--port", "9100"])
    from services.gateway.app import settings_from_args
    s = settings_from_args(args)
    assert (s.default_tier, s.port) == ("batch", 9100)
    with pytest.raises(SystemExit):
        p.parse_args(["gateway", "--api-key", "k"])


def test_an_otlp_endpoint_without_its_exporter_is_one_line():
    """docs/observability.md promises a clear error; it was a traceback from inside the service."""
    from shared import tracing
    try:
        tracing.check_exporter()
        pytest.skip("the OTLP exporter is installed here")
    except ValueError:
        pass
    out = _serve("router", TANDEM_NATS_URL="nats://127.0.0.1:1", TANDEM_OTLP_ENDPOINT="http://127.0.0.1:4318")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "TANDEM_OTLP_ENDPOINT is set but the OTLP exporter is not installed" in out.stderr


def test_sigterm_stops_a_service_still_waiting_for_nats(tmp_path):
    """A service not started yet (its NATS server silent: a cluster still forming) stops at
    SIGTERM, at once — it used to wait for the connect to give up (minutes, or for good)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()                                # takes connections, never says a word
    base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env = {**base, "HOME": str(tmp_path), "TANDEM_METRICS_PORT": "-1", "TANDEM_NATS_CONNECT_TIMEOUT": "120",
           "TANDEM_NATS_URL": f"nats://127.0.0.1:{silent.getsockname()[1]}"}
    p = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "router"], env=env, text=True,
                         cwd=Path(__file__).resolve().parents[2], stderr=subprocess.PIPE)
    try:
        for line in p.stderr:                      # the bus is being connected: its handlers are set
            if "connecting to NATS" in line:
                break
        time.sleep(0.5)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
        rest = p.stderr.read()
        assert rc == 0 and time.monotonic() - t0 < 10 and "router stopped before it was ready" in rest, rest
    finally:
        p.kill()
        silent.close()
