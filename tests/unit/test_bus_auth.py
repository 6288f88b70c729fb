"""shared/bus_auth.py without a server: who may publish and subscribe to which subject (NATS
wildcard matching of the role permissions), and the credentials file."""

from __future__ import annotations

import json
import os
import stat

import pytest

from shared import bus_auth, subjects

ROLES = bus_auth.ROLES


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def allowed(role: str, action: str, subject: str) -> bool:
    perm = bus_auth.permissions(role)[action]
    return any(matches(p, subject) for p in perm.get("allow", [])) and not any(
        matches(p, subject) for p in perm.get("deny", []))


def who(action: str, subject: str) -> set[str]:
    return {r for r in ROLES if allowed(r, action, subject)}


def test_matcher():
    assert matches("tandem.stream.*", "tandem.stream.r1") and not matches("tandem.stream.*", "tandem.stream.a.b")
    assert matches("tandem.>", "tandem.a.b") and not matches("tandem.>", "tandem")
    assert matches("$KV.b.>", "$KV.b.k") and not matches("$KV.b.>", "$KV.c.k")


def test_who_publishes_what():
    W, GW, R, P = bus_auth.WORKER, bus_auth.GATEWAY, bus_auth.ROUTER, bus_auth.KVPOOL
    assert who("publish", subjects.stream("r1")) == {W}                 # only workers publish tokens
    assert who("publish", subjects.ROUTER_DECISION) == {R}              # only routers publish plans
    assert who("publish", subjects.ABORT) == {GW}                       # only the gateway aborts
    assert who("publish", subjects.ROUTE) == {GW}
    assert who("publish", subjects.worker_prefill("w1")) == {GW}
    assert who("publish", subjects.worker_generate("w1")) == {GW}
    assert who("publish", subjects.worker_migrate("w1")) == {R}
    assert who("publish", subjects.worker_decode("w1")) == {W}          # hand-offs, migrations
    assert who("publish", subjects.kvpool_put("p1")) == {W}             # the pool's entries
    assert who("publish", subjects.kvpool_get("p1")) == {W}
    assert who("publish", subjects.kv_events("h")) == {W, P}
    assert who("publish", subjects.heartbeat(subjects.ROUTER, "r")) == {R}
    for role in (subjects.PREFILL, subjects.GPU_DECODE, subjects.CPU_DECODE):
        assert who("publish", subjects.heartbeat(role, "w")) == {W}
    assert who("publish", subjects.heartbeat(subjects.KVPOOL, "p")) == {P}   # (a pool is no worker)
    assert who("publish", "_INBOX.gateway.x.y") == set()               # replies: allow_responses only
    assert all(bus_auth.permissions(r).get("allow_responses") for r in ROLES if r != bus_auth.TAP)


def test_who_reads_what():
    assert who("subscribe", subjects.stream("r1")) == {bus_auth.GATEWAY, bus_auth.TAP}
    assert who("subscribe", subjects.ROUTE) == {bus_auth.ROUTER, bus_auth.TAP}
    assert who("subscribe", subjects.worker_migrate("w")) == {bus_auth.WORKER, bus_auth.TAP}
    assert who("subscribe", subjects.POOL_LOOKUP) == {bus_auth.KVPOOL, bus_auth.TAP}
    for role in set(ROLES) - {bus_auth.TAP}:   # each reads its own replies only
        assert who("subscribe", f"{bus_auth.inbox_prefix(role)}.abc.1") == {role, bus_auth.TAP}


def test_jetstream_per_stream():
    sessions = f"$JS.API.STREAM.INFO.KV_{bus_auth.SESSIONS_BUCKET}"
    assert who("publish", sessions) == {bus_auth.ROUTER}
    assert who("publish", f"$KV.{bus_auth.RESPONSES_BUCKET}.t.resp_1") == {bus_auth.GATEWAY}
    assert who("publish", f"$JS.API.STREAM.CREATE.{bus_auth.KVEVENTS_STREAM}") == {
        bus_auth.ROUTER, bus_auth.WORKER, bus_auth.KVPOOL}
    assert who("publish", f"$JS.API.STREAM.DELETE.{bus_auth.KVEVENTS_STREAM}") == set()


def test_the_names_match_the_services():
    from services import prefix_index, sessions
    from services.gateway import response_store as responses
    from shared import kv_events
    assert (sessions.BUCKET, prefix_index.BUCKET, kv_events.STREAM, responses.BUCKET) == (
        bus_auth.SESSIONS_BUCKET, bus_auth.PREFIX_BUCKET, bus_auth.KVEVENTS_STREAM, bus_auth.RESPONSES_BUCKET)


def test_creds_file_created_private_completed_and_kept(tmp_path):
    path = str(tmp_path / "sub" / "nats.creds")
    first = bus_auth.ensure_creds(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert set(first["users"]) == set(ROLES)
    assert bus_auth.ensure_creds(path) == first
    partial = {"users": {r: e for r, e in first["users"].items() if r != bus_auth.TAP}}
    with open(path, "w") as f:
        json.dump(partial, f)
    completed = bus_auth.ensure_creds(path)  # a role added later gets an entry, the others kept
    assert {r: completed["users"][r] for r in partial["users"]} == partial["users"]
    assert bus_auth.role_login(path, bus_auth.TAP) == (completed["users"][bus_auth.TAP]["user"],
                                                       completed["users"][bus_auth.TAP]["password"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert bus_auth.role_login(None, bus_auth.TAP) is None
    assert bus_auth.role_login(str(tmp_path / "missing"), bus_auth.TAP) is None


def test_a_bad_creds_file_is_a_clear_error(tmp_path):
    path = tmp_path / "nats.creds"
    path.write_text('{"users": {"gateway": "no"}}')
    with pytest.raises(ValueError, match=str(path)):
        bus_auth.role_login(str(path), bus_auth.GATEWAY)
    path.write_text("not json")
    with pytest.raises(ValueError, match=str(path)):
        bus_auth.ensure_creds(str(path))


def test_server_config_in_an_account():
    creds = bus_auth.new_creds()
    users = bus_auth.server_config(creds)["authorization"]["users"]
    acc = bus_auth.server_config(creds, "TANDEM")["accounts"]["TANDEM"]
    assert acc["users"] == users and acc["jetstream"] == "enabled"
    assert {u["user"] for u in users} == {f"tandem-{r}" for r in ROLES}
