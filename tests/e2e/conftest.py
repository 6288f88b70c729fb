from __future__ import annotations

import contextlib
import secrets

import pytest

from shared import bus_auth
from shared.nats_server import EmbeddedNats


@contextlib.contextmanager
def secured_nats(creds_file: str):
    """A nats-server as `tandem up` runs it (shared/bus_auth.py): only the role users of
    ``creds_file``, each with its role's permissions, so a permission a feature needs and lacks
    fails the e2e test that uses the feature (and shows as "Permissions Violation" in its stack's
    log). Yields a URL carrying the login of one more user allowed everything, for the tests' own
    bus clients; the services log in as their roles (explicit credentials win over the URL's)."""
    config = bus_auth.server_config(bus_auth.ensure_creds(creds_file))
    password = secrets.token_urlsafe(16)
    config["authorization"]["users"].append({"user": "tandem-test", "password": password})
    server = EmbeddedNats(config=config)
    try:
        yield server.start().replace("nats://", f"nats://tandem-test:{password}@")
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_creds(tmp_path_factory):
    """TANDEM_NATS_CREDS_FILE of every stack the e2e tests start (they copy os.environ)."""
    path = str(tmp_path_factory.mktemp("nats-auth") / "nats.creds")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_NATS_CREDS_FILE", path)
        yield path


@pytest.fixture(scope="module")
def nats_server(nats_creds):
    """The e2e tests' NATS, one per module (a module's stacks leave JetStream state behind —
    sessions, the prefix index — which the next module's router would load): secured as
    `tandem up`'s own (``secured_nats``)."""
    with secured_nats(nats_creds) as url:
        yield url
