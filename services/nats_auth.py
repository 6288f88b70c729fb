"""``tandem nats-auth``: the bus role credentials, and the nats-server configuration accepting them.

    tandem nats-auth --config /etc/nats/tandem-auth.conf   # creds file (kept), then the config
    tandem nats-auth --config -                             # the authorization block on stdout
    tandem nats-auth --config - --account TANDEM            # the users in an account of their own

Creates TANDEM_NATS_CREDS_FILE (a random password per role, mode 0600) unless it exists, then
writes the nats-server ``authorization`` block for it (every role user with its permissions,
shared/bus_auth.py) — or, with ``--account``, an ``accounts`` block holding them in an account
with JetStream — which is a whole configuration file for ``nats-server -c`` and can be
``include``d in a larger one. What compose.yaml's ``nats-auth`` step runs; `tandem up` does the
same for its embedded server by itself. docs/security.md shows how to use it with an external
NATS.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from shared import bus_auth
from shared.settings import Settings, env_help

log = logging.getLogger("tandem.nats_auth")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True,
                   help="where to write the nats-server authorization config (mode 0600); '-': stdout")
    p.add_argument("--account", default=None,
                   help="put the users in this NATS account (with JetStream) instead of the global one")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = env_help()


def config_text(creds: dict, account: str | None = None) -> str:
    """The ``authorization`` (or ``accounts``) block in NATS configuration syntax (its value JSON)."""
    return "".join(f"{key}: {json.dumps(value, indent=1)}\n"
                   for key, value in bus_auth.server_config(creds, account).items())


def main(args: argparse.Namespace) -> int:
    try:
        path = Settings.from_env().nats.creds_file
        if not path:
            raise ValueError("TANDEM_NATS_CREDS_FILE is empty: nothing to make credentials in")
        text = config_text(bus_auth.ensure_creds(path), args.account)
    except ValueError as e:
        log.error("%s", e)
        return 2
    if args.config == "-":
        sys.stdout.write(text)
    else:
        bus_auth.write_private(args.config, text, replace=True)
        log.info("nats-server authorization for the roles of %s written to %s", path, args.config)
    return 0
