"""``tandem nats-auth``: the bus role credentials, and the nats-server configuration accepting them.

    tandem nats-auth --config /etc/nats/tandem-auth.conf   # creds file (kept), then the config
    tandem nats-auth --config -                             # the authorization block on stdout
    tandem nats-auth --config - --account TANDEM            # the users in an account of their own
    tandem nats-auth --config nats.conf --cluster nats-0.nats:6222,nats-1.nats:6222,nats-2.nats:6222
                                                            # every server of a 3-server cluster

Creates TANDEM_NATS_CREDS_FILE (a random password per role, mode 0600) unless it exists, then
writes the nats-server ``authorization`` block for it (every role user with its permissions,
shared/bus_auth.py) — or, with ``--account``, an ``accounts`` block holding them in an account
with JetStream — which is a whole configuration file for ``nats-server -c`` and can be
``include``d in a larger one. What compose.yaml's ``nats-auth`` step runs; `tandem up` does the
same for its embedded server by itself. docs/security.md shows how to use it with an external
NATS.

With ``--cluster`` (every server's route address), the file configures each server of one NATS
cluster (shared/nats_cluster.py): the same users, JetStream, the routes, the route credential
(kept in the credentials file: a server without it cannot join), TLS for clients and routes with
``--tls-cert``/``--tls-key``. Start each server with ``nats-server -c FILE -n NAME -sd DIR`` (a
name of its own, stable across restarts). docs/deploy.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from shared import bus_auth, nats_cluster
from shared.settings import Settings, env_help

log = logging.getLogger("tandem.nats_auth")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True,
                   help="where to write the nats-server authorization config (mode 0600); '-': stdout")
    p.add_argument("--account", default=None,
                   help="put the users in this NATS account (with JetStream) instead of the global one")
    p.add_argument("--data-key-file", default=None, metavar="PATH",
                   help="also make the data-plane key there (random, mode 0600) unless it exists: services "
                        "that share the file (a volume: compose.yaml) tag and check their KV frames with it")
    p.add_argument("--pool-key-file", default=None, metavar="PATH",
                   help="also make the KV pool secret there (the same way): for the workers only, never the pool")
    c = p.add_argument_group("a cluster of NATS servers (docs/deploy.md)")
    c.add_argument("--cluster", default=None, metavar="HOST[:PORT],...",
                   help="every server's route address (itself included; port 6222 if none): "
                        "write the configuration of each server of that cluster")
    c.add_argument("--cluster-name", default=nats_cluster.DEFAULT_CLUSTER, help="the cluster's name")
    c.add_argument("--cluster-listen", default=f"0.0.0.0:{nats_cluster.DEFAULT_ROUTE_PORT}",
                   help="where each server takes routes")
    c.add_argument("--store-dir", default=None, help="JetStream store directory (else nats-server -sd)")
    c.add_argument("--max-file-store", default=None,
                   help="JetStream file storage limit per server, e.g. 10G (docs/deploy.md: sizing)")
    c.add_argument("--tls-cert", default=None, help="server certificate (PEM): TLS for clients and routes")
    c.add_argument("--tls-key", default=None, help="its private key (PEM)")
    c.add_argument("--tls-ca", default=None, help="CA (PEM) that verifies route peers (and clients with --tls-verify)")
    c.add_argument("--tls-verify", action="store_true", help="mutual TLS for clients too")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = env_help()


CLUSTER_ONLY = ("store_dir", "max_file_store", "tls_cert", "tls_key", "tls_ca", "tls_verify")   # ignored without it


def config_text(creds: dict, account: str | None = None) -> str:
    """The ``authorization`` (or ``accounts``) block in NATS configuration syntax (its value JSON)."""
    return "".join(f"{key}: {json.dumps(value, indent=1)}\n"
                   for key, value in bus_auth.server_config(creds, account).items())


def cluster_text(creds: dict, args: argparse.Namespace) -> str:
    """Every server's configuration of the cluster ``args.cluster`` names."""
    routes = [r.strip() for r in args.cluster.split(",") if r.strip()]
    conf = nats_cluster.cluster_config(
        creds, routes, name=args.cluster_name, listen=args.cluster_listen, account=args.account,
        store_dir=args.store_dir, max_file_store=args.max_file_store, tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_ca=args.tls_ca, tls_verify=args.tls_verify)
    return "".join(f"{key}: {json.dumps(value, indent=1)}\n" for key, value in conf.items())


def main(args: argparse.Namespace) -> int:
    try:
        path = Settings.from_env().nats.creds_file
        if not path:
            raise ValueError("TANDEM_NATS_CREDS_FILE is empty: nothing to make credentials in")
        cluster = getattr(args, "cluster", None)
        if cluster is not None and (not cluster.strip() or any(not r.strip() for r in cluster.split(","))):
            raise ValueError(f"--cluster {cluster!r}: expected every server's route address, comma-separated "
                             "(an unset shell variable?)")
        if cluster and len(cluster.split(",")) < 2:
            raise ValueError(f"--cluster {cluster!r} names one server: a cluster is every server's route address, "
                             "comma-separated (3 for JetStream to survive one lost server); one server needs no "
                             "--cluster")
        if not cluster:
            given = [f"--{k.replace('_', '-')}" for k in CLUSTER_ONLY if getattr(args, k, None)]
            if given:
                raise ValueError(f"{', '.join(given)}: only with --cluster (the single-server block is the "
                                 "authorization alone)")
        creds = bus_auth.ensure_creds(path)
        text = cluster_text(creds, args) if getattr(args, "cluster", None) else config_text(creds, args.account)
    except ValueError as e:
        log.error("%s", e)
        return 2
    for key_path, what in ((getattr(args, "data_key_file", None), "data-plane key"),
                           (getattr(args, "pool_key_file", None), "pool secret")):
        try:
            if key_path:
                bus_auth.key_file(key_path, what)
        except OSError as e:
            log.error("cannot make the %s in %s: %s", what, key_path, e.strerror or e)
            return 2
    if args.config == "-":
        sys.stdout.write(text)
    else:
        try:
            bus_auth.write_private(args.config, text, replace=True)
        except OSError as e:   # a directory, /proc, a read-only place: one line, not a traceback
            log.error("cannot write the nats-server configuration to %s: %s", args.config, e.strerror or e)
            return 2
        log.info("nats-server %s for the roles of %s written to %s",
                 f"cluster configuration ({args.cluster})" if getattr(args, "cluster", None)
                 else "authorization", path, args.config)
    return 0
