"""Shared fixtures. ``nats_server``: one embedded nats-server (JetStream) for the test session."""

from __future__ import annotations

import os

import pytest

from shared.nats_server import EmbeddedNats
from shared.os_priority import BOUNDED_SPIN

# The default run is two test processes (pytest-xdist) on the machine's cores, each with OpenMP
# teams as wide as the cores (torch's, the CPU kernels'); libgomp's default spin at a barrier
# (~300,000 iterations) then burns the core the other process needs: the bundled model's load took
# 6.2 s alone, 21 s beside another, 11 s beside another with this. The bounded spin `tandem up`
# gives engines whose threads outnumber the cores (shared/os_priority.py). Set before any import
# loads libgomp, which reads it once; the stacks the tests start inherit it unless a test says
# otherwise (tests/e2e/test_os_priority.py checks `tandem up`'s own choice, test_memory.py measures
# an engine with libgomp's defaults).
os.environ.setdefault("GOMP_SPINCOUNT", str(BOUNDED_SPIN))


@pytest.fixture(scope="session")
def nats_server():
    """URL (nats://127.0.0.1:PORT) of a private nats-server with JetStream on a free port.

    Tests that need a server of their own (other flags, restarts) start an ``EmbeddedNats``.
    """
    server = EmbeddedNats()
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def bundled_model():
    """The bundled SmolLM2-135M, loaded (converted to Q4_0, ~6 s) once per test process."""
    from shared.engine.loader import load_model
    return load_model()
