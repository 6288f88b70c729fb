"""bench.tenants' round against the fake gateway of test_gateway, with the bench's two API keys:
key A's flood and key B's one request are sent under their keys (their tenants differ), and the
table reports the ratios."""

from __future__ import annotations

import argparse
import asyncio

from bench import tenants
from shared.settings import GatewaySettings
from tests.unit.test_gateway import MODEL, FakeBackend, Server


def test_a_round_sends_the_flood_and_b_under_their_keys_and_the_table_has_the_ratios(monkeypatch):
    backend = FakeBackend()
    keys = ",".join(f"{k}=standard" for k in tenants.KEYS.values())
    monkeypatch.setattr(tenants, "MODEL", MODEL)
    args = argparse.Namespace(flood=3, flood_tokens=4, rounds=1, max_seqs=2, threads=0, json=None)
    with Server(backend, GatewaySettings(api_key=None, api_keys=keys)) as server:
        got = asyncio.run(tenants._round(server.url, "t", args))
    assert got["b_ttft"] > 0 and got["flood_wall"] >= 1.0 and got["flood_tokens"] > 0
    owners = [r.owner for r in backend.requests]
    assert len(owners) == 4 and len(set(owners)) == 2 and owners.count(owners[-1]) == 1   # B's last, alone
    sys_ = {name: {"b_alone": 0.05, "b_ttft": b, "flood_tok_s": 270.0, "flood_ttft_median": 5.0, "rounds": []}
            for name, b in (("fair", 2.0), ("fifo", 10.0))}
    text = tenants.table({"config": vars(args), "systems": sys_})
    assert "fifo / fair: 5.0x" in text and "fair / fifo: 1.00" in text and "| fair | 0.05 | 2.00 |" in text


def test_the_scheduler_s_share_is_the_api_key_s_whatever_the_cache_salt():
    """``tenant_owner`` reads the key's tenant back out of the gateway's cache tenant: a salted
    request is its key's for the fair share (a client cannot jump the queue by salting each
    request), and the public tenant, salted or not, is one share."""
    from kvpool.keys import tenant_owner
    from services.gateway.handlers import PUBLIC, cache_tenant, key_tenant

    alice = key_tenant("alice")
    assert tenant_owner(cache_tenant(alice, None)) == tenant_owner(cache_tenant(alice, "s1")) == alice
    assert tenant_owner(cache_tenant(alice, "s1")) != tenant_owner(cache_tenant(key_tenant("bob"), "s1"))
    assert tenant_owner(cache_tenant(PUBLIC, None)) == tenant_owner(cache_tenant(PUBLIC, "x:y")) == ""
