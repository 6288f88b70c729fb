"""Bus credentials per service role, and the NATS permissions each role gets (docs/security.md).

    creds = ensure_creds(path)                  # `tandem up`: the role credentials file (0600)
    conf = server_config(creds)                 # the nats-server authorization block for them
    user, password = role_login(path, "router")  # a service: its role's entry (None: no file / role)

Roles: ``gateway``, ``router``, ``worker`` (prefill, gpu-decode and cpu-decode), ``kvpool`` and
``tap`` (read only). Each role may publish only the subjects its part of the request life cycle
sends (shared/subjects.py) — only workers publish on stream subjects, only routers publish
decisions (and, as replies, plans), only the gateway publishes aborts and asks workers to prefill
or generate, only routers ask a worker to migrate — and subscribe only to what it serves or
reads. Replies need no publish permission: every role but tap may answer the requests it
received (NATS ``allow_responses``), and reads replies only on its own inbox prefix
(``_INBOX.<role>.``, which ``Bus.connect`` sets), so no role reads another's replies. JetStream
(the KV buckets and the KV event stream) is allowed per stream, to the roles that use it.

This module only describes; it opens no connection (shared/bus.py connects, services/up.py
starts the embedded server with ``server_config``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets

from shared import subjects as S

log = logging.getLogger(__name__)

GATEWAY, ROUTER, WORKER, KVPOOL, TAP = "gateway", "router", "worker", "kvpool", "tap"
ROLES: tuple[str, ...] = (GATEWAY, ROUTER, WORKER, KVPOOL, TAP)
USER_PREFIX = "tandem-"                 # a role's NATS user name: tandem-<role>
ROUTE_USER = "tandem-route"             # the cluster's route credential (no client logs in with it)
CREDS_VERSION = 1

# JetStream streams and the services that use them (bucket ``b`` is stream ``KV_b``)
KVEVENTS_STREAM = "TANDEM_KVEVENTS"     # shared/kv_events.py STREAM
RESPONSES_BUCKET = "tandem_responses"   # services/gateway/response_store.py BUCKET
SESSIONS_BUCKET = "tandem_sessions"     # services/sessions.py BUCKET
PREFIX_BUCKET = "tandem_prefix_index"   # services/prefix_index.py BUCKET


def role_of(service: str) -> str:
    """The credential role of a service (``tandem serve SERVICE``'s name, or tap)."""
    if service in (S.PREFILL, S.GPU_DECODE, S.CPU_DECODE, WORKER):
        return WORKER
    if service in ROLES:
        return service
    raise ValueError(f"no bus role for service {service!r}: expected one of "
                     f"{', '.join(S.ROLES + (WORKER, TAP))}")


INBOX = "_INBOX"   # every reply subject starts here (nats-py's default inbox prefix, and each role's)


def inbox_prefix(role: str) -> str:
    """Where a role's requests get their replies (nats-py ``inbox_prefix``)."""
    return f"{INBOX}.{role}"


def _stream_admin(stream: str) -> list[str]:
    """Look up and create a stream (what a publisher that makes sure the stream exists needs)."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}"]


def _stream_getter(stream: str) -> list[str]:
    """Look up a stream's messages one at a time (KV gets: ``STREAM.MSG.GET``, whose reply wraps
    the message in JSON; not ``DIRECT.GET``, whose reply is the stored message as it is) and purge
    them (KV purge, snapshot clean-up)."""
    return _stream_admin(stream) + [f"$JS.API.STREAM.PURGE.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}"]


def _stream_reader(stream: str) -> list[str]:
    """Read a stream through a consumer (the router's ordered consumer of the KV events) with its
    flow control. Only for a stream the role cannot write: a push consumer delivers to whatever
    subject its creator names, and nats-server does not check the creator may publish there
    (nats-server#8274), so a role that could store a message and make a consumer could have
    the server publish it anywhere — a token on a client's stream, a worker's heartbeat."""
    return _stream_getter(stream) + [
        f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.FC.{stream}.>"]


def _bucket(bucket: str) -> list[str]:
    """Use a JetStream KV bucket: its stream's lookups, gets and purges, writes to its keys; its
    keys listed from the stream's info (``Bus.kv_keys``). No consumers: the role writes it (above)."""
    return _stream_getter(f"KV_{bucket}") + [f"$KV.{bucket}.>"]


def _worker_heartbeats() -> list[str]:
    return [f"{S.PREFIX}.heartbeat.{role}.*" for role in (S.PREFILL, S.GPU_DECODE, S.CPU_DECODE)]


def permissions(role: str) -> dict:
    """The NATS permissions of ``role`` (the ``permissions`` map of its user)."""
    p = S.PREFIX
    if role == TAP:  # read only: every subject, replies included; publishes nothing, joins no queue group
        # (a member of the router's group would be handed route requests nobody answers)
        return {"publish": {"deny": [">"]}, "subscribe": {"allow": [">"], "deny": ["> >"]}}
    pub: list[str]
    sub: list[str]
    if role == GATEWAY:
        pub = [S.ROUTE, S.ROUTER_SESSION, S.ABORT, f"{p}.worker.*.prefill", f"{p}.worker.*.generate",
               f"{p}.worker.*.where", *_bucket(RESPONSES_BUCKET)]
        sub = [f"{p}.stream.*", S.HEARTBEAT_ALL, f"{p}.gateway.*.alive"]
    elif role == ROUTER:
        pub = [S.ROUTER_DECISION, S.heartbeat_role(S.ROUTER), f"{p}.worker.*.migrate",
               *_bucket(SESSIONS_BUCKET), *_bucket(PREFIX_BUCKET), *_stream_reader(KVEVENTS_STREAM)]
        sub = [S.ROUTE, S.ROUTER_SESSION, S.ROUTER_DECISION, S.HEARTBEAT_ALL, S.KV_EVENTS_ALL]
    elif role == WORKER:
        pub = [f"{p}.stream.*", *_worker_heartbeats(), f"{p}.worker.*.decode", f"{p}.gateway.*.alive",
               S.POOL_LOOKUP, f"{p}.kvpool.*.get", f"{p}.kvpool.*.put", f"{p}.kvevents.*", f"{p}.transfer.*",
               *_stream_admin(KVEVENTS_STREAM)]
        sub = [f"{p}.worker.>", S.ABORT, S.HEARTBEAT_ALL]
    elif role == KVPOOL:
        pub = [f"{p}.kvevents.*", f"{p}.transfer.*", S.heartbeat_role(S.KVPOOL), *_stream_admin(KVEVENTS_STREAM)]
        sub = [S.POOL_LOOKUP, f"{p}.kvpool.*.get", f"{p}.kvpool.*.put",
               S.HEARTBEAT_ALL]  # the live workers' data-plane addresses (the only ones it sends to)
    else:
        raise ValueError(f"unknown bus role {role!r}: expected one of {', '.join(ROLES)}")
    return {"publish": {"allow": pub}, "subscribe": {"allow": sub + [f"{inbox_prefix(role)}.>"]},
            "allow_responses": True}


# -- the credentials file --------------------------------------------------------------------

def new_creds(roles: tuple[str, ...] = ROLES, old: dict | None = None) -> dict:
    """Credentials for ``roles``: ``old``'s entries kept, a random password for each missing one;
    and the route credential the servers of a cluster present to each other (shared/nats_cluster.py)."""
    users = dict((old or {}).get("users", {}))
    for role in roles:
        users.setdefault(role, {"user": USER_PREFIX + role, "password": secrets.token_urlsafe(32)})
    route = (old or {}).get("route") or {"user": ROUTE_USER, "password": secrets.token_urlsafe(32)}
    return {"version": CREDS_VERSION, "users": users, "route": route}


def route_login(creds: dict) -> tuple[str, str] | None:
    """(user, password) the servers of a cluster authenticate their routes with (None: none yet)."""
    r = creds.get("route")
    return (r["user"], r["password"]) if isinstance(r, dict) and "user" in r and "password" in r else None


def read_creds(path: str) -> dict | None:
    """The credentials file's contents (None: no file); ValueError naming the file when it is bad."""
    path = os.path.expanduser(path)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"NATS credentials file {path}: {e}") from None
    users = data.get("users") if isinstance(data, dict) else None
    if not isinstance(users, dict) or not all(
            isinstance(u, dict) and isinstance(u.get("user"), str) and isinstance(u.get("password"), str)
            for u in users.values()):
        raise ValueError(f"NATS credentials file {path}: expected {{\"users\": {{role: {{\"user\", \"password\"}}}}}}")
    return data


def role_login(path: str | None, role: str) -> tuple[str, str] | None:
    """(user, password) of ``role`` in the credentials file at ``path``; None without one."""
    if not path:
        return None
    data = read_creds(path)
    entry = (data or {}).get("users", {}).get(role)
    return None if entry is None else (entry["user"], entry["password"])


def ensure_creds(path: str) -> dict:
    """The credentials file at ``path`` with an entry for every role: created (random passwords,
    mode 0600, atomically) when missing, completed when a role is missing, else read."""
    old = read_creds(path)
    if old is not None and all(r in old["users"] for r in ROLES) and route_login(old) is not None:
        return old
    creds = new_creds(old=old)
    if write_private(path, json.dumps(creds, indent=1), replace=old is not None):
        log.info("NATS role credentials %s in %s", "completed" if old else "created", os.path.expanduser(path))
    return read_creds(path) or creds


def key_file(path: str, what: str) -> bool:
    """Create a deployment secret file (a random key, mode 0600) unless it exists; True: made here.
    The pool secret (TANDEM_POOL_KEY_FILE), so pool entries carry a MAC only this deployment can
    make, and the data-plane key (TANDEM_DATA_KEY_FILE), so receivers take KV from its services only."""
    if os.path.exists(os.path.expanduser(path)) or not write_private(path, secrets.token_hex(32)):
        return False            # (False from write_private: another process made it meanwhile)
    log.info("%s created in %s", what, os.path.expanduser(path))
    return True


def write_private(path: str, text: str, replace: bool = False) -> bool:
    """Write ``text`` to ``path`` readable by this user only (0600), atomically; unless ``replace``,
    never over a file that exists (another process's, made meanwhile). True: written."""
    path = os.path.expanduser(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    try:
        if replace:
            os.replace(tmp, path)
            return True
        os.link(tmp, path)    # atomic, and never over a file another process made meanwhile
        return True
    except FileExistsError:
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


CLIENT_PING_S = 5.0   # the server's pings to a client it heard nothing from (server_config)
CLIENT_PINGS = 3      # unanswered in a row: the client is dropped


def server_config(creds: dict, account: str | None = None, client_ping_s: float = CLIENT_PING_S) -> dict:
    """The nats-server configuration (JSON is valid NATS config) accepting only ``creds``' users,
    each with its role's permissions: in the global account, or in ``account`` (with JetStream;
    a server shared with other applications keeps Tandem's subjects apart that way). A client
    silent for ``CLIENT_PINGS`` pings ``client_ping_s`` apart is dropped, its subscriptions with
    it (a live client pings every TANDEM_NATS_PING_S, so it is never asked): a frozen router copy
    kept its share of the routers' queue group — session updates waited 10 s on it — for the
    ~4 minutes of nats-server's default (2 pings of 2 minutes)."""
    users = [{"user": e["user"], "password": e["password"], "permissions": permissions(role)}
             for role, e in creds["users"].items() if role in ROLES]
    ping = {"ping_interval": f"{max(1, round(client_ping_s * 1000))}ms", "ping_max": CLIENT_PINGS}
    if account is None:
        return {"authorization": {"users": users}, **ping}
    return {"accounts": {account: {"jetstream": "enabled", "users": users}}, **ping}
