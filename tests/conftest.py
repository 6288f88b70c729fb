"""Shared fixtures. ``nats_server``: one embedded nats-server (JetStream) for the test session."""

from __future__ import annotations

import pytest

from shared.nats_server import EmbeddedNats


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
