"""The pool's shared tiers, each against the same tests: a shared directory and a real Redis server.

Redis: ``TANDEM_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); each test writes under
a prefix of its own and deletes it after. Without a server (or redis-py) the Redis cases are
skipped with the reason.
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from kvpool.codec import Codec, ForgedEntry, decode_entry
from kvpool.pool import KVPool, PoolConfig
from kvpool.store import DirTier, RedisTier
from tests.unit.test_kvpool import KEYS, entry, kv_bytes

REDIS_URL = os.environ.get("TANDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _redis_client():
    redis = pytest.importorskip("redis", reason="redis-py is not installed (tandem-serve[redis])")
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis server at {REDIS_URL}: {e}")
    return client


class DirStore:
    """A shared directory tier; ``raw`` reads / writes a stored entry behind the tier's back."""
    kind = "shared"

    def __init__(self, tmp_path):
        self.root = str(tmp_path / "shared")

    def config(self, **kw) -> PoolConfig:
        return PoolConfig(ram_bytes=kw.pop("ram_bytes", 0), shared_dir=self.root,
                          shared_bytes=kw.pop("capacity", 256 << 20), **kw)

    def tier(self, capacity: int = 256 << 20) -> DirTier:
        return DirTier(self.root, capacity, "shared", shared=True)

    def raw(self, key: str, data: bytes | None = None) -> bytes | None:
        p = os.path.join(self.root, key[:2], key + ".kvp")
        if data is not None:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(data)
        try:
            with open(p, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def count(self) -> int:
        return sum(f.endswith(".kvp") for _, _, fs in os.walk(self.root) for f in fs)

    def close(self) -> None:
        pass


class RedisStore:
    kind = "redis"

    def __init__(self, tmp_path):
        self.client = _redis_client()
        self.prefix = f"tandem-test:{uuid.uuid4().hex[:12]}:"

    def config(self, **kw) -> PoolConfig:
        return PoolConfig(ram_bytes=kw.pop("ram_bytes", 0), redis_url=REDIS_URL, redis_prefix=self.prefix,
                          redis_bytes=kw.pop("capacity", 256 << 20), **kw)

    def tier(self, capacity: int = 256 << 20) -> RedisTier:
        return RedisTier(REDIS_URL, capacity, prefix=self.prefix)

    def raw(self, key: str, data: bytes | None = None) -> bytes | None:
        if data is not None:
            self.client.set(self.prefix + key, data)
        return self.client.get(self.prefix + key)

    def count(self) -> int:
        return sum(1 for _ in self.client.scan_iter(match=self.prefix + "*"))

    def close(self) -> None:
        names = list(self.client.scan_iter(match=self.prefix + "*"))
        if names:
            self.client.delete(*names)
        self.client.close()


@pytest.fixture(params=[DirStore, RedisStore], ids=["shared-dir", "redis"])
def store(request, tmp_path):
    s = request.param(tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_survives_restart_and_evicts(store):
    t = store.tier()
    for k in KEYS[:3]:
        assert t.put(k, entry(k))
    assert t.get(KEYS[0]) is not None            # KEYS[0] most recent: KEYS[1] is the oldest now
    again = store.tier()                         # a new process: the index is rebuilt from the store
    assert len(again) == 3 and again.get(KEYS[2]) == entry(KEYS[2])
    small = store.tier(capacity=len(entry(KEYS[0])) * 2)   # rebuild evicts down to capacity
    assert len(small) == 2 and small.used <= small.capacity and store.count() == 2


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_entry_is_a_miss_and_removed(store, damage):
    pool = KVPool.from_config(store.config())
    pool.put(KEYS[0], entry(KEYS[0]))
    data = bytearray(store.raw(KEYS[0]))
    if damage == "flip":
        data[-5] ^= 1
    else:
        data = data[: len(data) // 2]
    store.raw(KEYS[0], bytes(data))
    assert pool.get(KEYS[0]) is None
    assert store.raw(KEYS[0]) is None and pool.tiers[0].corrupt == 1 and pool.lookup(KEYS[:1]) == []


def test_broken_entry_removed_at_restart(store):
    t = store.tier()
    t.put(KEYS[0], entry(KEYS[0]))
    store.raw(KEYS[1], entry(KEYS[1])[:50])
    store.raw(KEYS[2], entry(KEYS[0]))           # a whole entry under another chunk's key
    again = store.tier()
    assert len(again) == 1 and again.contains(KEYS[0])
    assert store.raw(KEYS[1]) is None and store.raw(KEYS[2]) is None and again.corrupt == 2


def test_two_writers_of_the_same_chunk(store):
    """Two pools (two nodes) on one shared store write the same chunk at once."""
    pools = [KVPool.from_config(store.config()) for _ in range(2)]
    e = entry(KEYS[0])
    barrier = threading.Barrier(8)
    results = []

    def write(pool):
        barrier.wait()
        results.append(pool.put(KEYS[0], e))

    threads = [threading.Thread(target=write, args=(pools[i % 2],)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(r == [store.kind] for r in results)
    assert store.count() == 1 and store.raw(KEYS[0]) == e
    for pool in pools:
        assert pool.get(KEYS[0]) == e


def test_shared_tier_sees_other_nodes_entries(store):
    a = KVPool.from_config(store.config(ram_bytes=1 << 20))
    b = KVPool.from_config(store.config(ram_bytes=1 << 20))
    a.put(KEYS[0], entry(KEYS[0]))
    assert b.lookup(KEYS[:2]) == [store.kind]
    assert b.get(KEYS[0]) == entry(KEYS[0])
    assert b.lookup(KEYS[:1]) == ["ram"]  # promoted


def test_an_entry_without_the_deployments_secret_is_never_loaded(store):
    """Whoever can write to the shared store but lacks TANDEM_POOL_KEY cannot make an entry a
    worker loads: the tier serves it (checksum fine), the worker's decode refuses it."""
    secret = b"deployment-secret"
    pool = KVPool.from_config(store.config())
    pool.put(KEYS[0], Codec(secret=secret).encode(KEYS[0], kv_bytes()))
    assert decode_entry(pool.get(KEYS[0]), KEYS[0], secret) == kv_bytes()
    store.raw(KEYS[1], Codec(secret=b"someone-else").encode(KEYS[1], kv_bytes(seed=1)))
    forged = pool.get(KEYS[1])
    assert forged is not None
    with pytest.raises(ForgedEntry):
        decode_entry(forged, KEYS[1], secret)


def test_redis_down_is_a_miss_and_serving_goes_on(caplog):
    """A Redis tier whose server is gone: the pool starts, puts land in RAM, reads are misses."""
    pytest.importorskip("redis", reason="redis-py is not installed (tandem-serve[redis])")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                # nobody listens there
    pool = KVPool.from_config(PoolConfig(ram_bytes=1 << 20, redis_url=f"redis://:pw@127.0.0.1:{port}/0"))
    assert "starting with an empty index" in caplog.text and ":pw@" not in caplog.text
    assert pool.put(KEYS[0], entry(KEYS[0])) == ["ram"]
    assert pool.tiers[1].write_errors == 1 and "serving goes on" in caplog.text
    assert pool.lookup(KEYS[:2]) == ["ram"] and pool.get(KEYS[0]) == entry(KEYS[0])
    assert pool.tiers[1].get(KEYS[1]) is None


def test_redis_url_checked():
    with pytest.raises(ValueError, match="redis://"):
        PoolConfig(redis_url="127.0.0.1:6379").validate()
    assert PoolConfig(ram_bytes=0, redis_url="redis://127.0.0.1:6379/0").validate()
