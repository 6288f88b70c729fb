"""``tandem nats-auth``: the bus role credentials, and the nats-server configuration accepting them.

    tandem nats-auth --config /etc/nats/tandem-auth.conf   # creds file (kept), then the config
    tandem nats-auth --config -                             # the authorization block on stdout

Creates TANDEM_NATS_CREDS_FILE (a random password per role, mode 0600) unless it exists, then
writes the nats-server ``authorization`` block for it (every role user with its permissions,
shared/bus_auth.py), which is a whole configuration file for ``nats-server -c`` and can be
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
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = env_help()


def config_text(creds: dict) -> str:
    """The ``authorization`` block in NATS configuration syntax (its value is JSON)."""
    return "authorization: " + json.dumps(bus_auth.server_config(creds)["authorization"], indent=1) + "\n"


def main(args: argparse.Namespace) -> int:
    try:
        path = Settings.from_env().nats.creds_file
        if not path:
            raise ValueError("TANDEM_NATS_CREDS_FILE is empty: nothing to make credentials in")
        text = config_text(bus_auth.ensure_creds(path))
    except ValueError as e:
        log.error("%s", e)
        return 2
    if args.config == "-":
        sys.stdout.write(text)
    else:
        bus_auth.write_private(args.config, text, replace=True)
        log.info("nats-server authorization for the roles of %s written to %s", path, args.config)
    return 0
