"""KV pool core: keys, codecs, tiers, atomic writes, restart, corruption, disk full (the shared tiers:
tests/integration/test_pool_tiers.py)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kvpool.codec import (HEADER, LOSSLESS, LOSSY, RAW, ChunkShape, Codec, CorruptEntry, ForgedEntry, decode_entry,
                          decode_entry_into, entry_info)
from kvpool.keys import KeyScope, check_key, chunk_keys, chunk_keys_from_seed, tail_key
from kvpool.pool import KVPool, PoolConfig
from kvpool.store import DirTier, MemoryTier

LAYOUT = {"version": 1, "n_layers": 2, "n_kv_heads": 3, "head_dim": 8, "block_size": 4, "dtype": "float16"}
SHAPE = ChunkShape.from_layout(LAYOUT)
SCOPE = KeyScope("model-a", LAYOUT, chunk_tokens=16)


def kv_bytes(tokens: int = 16, seed: int = 0) -> bytes:
    """KV-like float16 data: smooth per channel, like real keys and values."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (tokens // 4, 2, 2, 4, 3, 8)) * rng.uniform(0.1, 4, (1, 2, 2, 1, 3, 8))
    return x.astype(np.float16).tobytes()


def entry(key: str, seed: int = 0, codec: str = LOSSLESS) -> bytes:
    return Codec(codec).encode(key, kv_bytes(seed=seed))


KEYS = chunk_keys(SCOPE, list(range(100)))


# -- keys ---------------------------------------------------------------------------------------

def test_keys_chain_the_whole_prefix():
    a = chunk_keys(SCOPE, list(range(40)))
    b = chunk_keys(SCOPE, list(range(40)) + [7] * 10)
    assert len(a) == 2 and a == b[:2] and len(b) == 3  # 50 tokens: 3 full chunks of 16
    changed = chunk_keys(SCOPE, [99] + list(range(1, 40)))
    assert changed[0] != a[0] and changed[1] != a[1]  # a change early changes every later key
    assert chunk_keys(SCOPE, list(range(40)), limit=31) == a[:1]
    assert chunk_keys(SCOPE, list(range(15))) == []
    assert all(check_key(k) == k for k in a)


@pytest.mark.parametrize("other", [KeyScope("model-b", LAYOUT, 16), KeyScope("model-a", LAYOUT, 16, tenant="t2"),
                                   KeyScope("model-a", dict(LAYOUT, version=2), 16), KeyScope("model-a", LAYOUT, 32)])
def test_scopes_never_share_keys(other):
    assert chunk_keys(other, list(range(64)))[0] != chunk_keys(SCOPE, list(range(64)))[0]


def test_tenants_never_share_keys_and_the_public_tenant_keeps_the_scope():
    ids = list(range(64))
    public, alice, bob = (chunk_keys(SCOPE, ids, tenant=t) for t in ("", "alice", "bob"))
    assert public == chunk_keys_from_seed(SCOPE.seed().hex(), 16, ids)   # no tenant: the keys as before
    assert not set(alice) & set(bob) and not set(alice) & set(public)
    assert alice == chunk_keys_from_seed(SCOPE.seed().hex(), 16, ids, tenant="alice")  # the router's keys


def test_a_tail_key_names_exactly_its_tokens():
    a = chunk_keys(SCOPE, list(range(40)))
    tail = tail_key(a[-1], list(range(32, 40)))
    assert check_key(tail) == tail and tail not in a and tail == tail_key(bytes.fromhex(a[-1]), list(range(32, 40)))
    assert tail != tail_key(a[-1], list(range(32, 39)) + [7])      # another token
    assert tail != tail_key(a[-1], list(range(32, 36)))            # fewer tokens
    assert tail != tail_key(a[0], list(range(32, 40)))             # another prefix
    assert tail != tail_key(chunk_keys(SCOPE, list(range(40)), tenant="t")[-1], list(range(32, 40)))  # tenant


def test_bad_scope_and_key_rejected():
    with pytest.raises(ValueError, match="multiple of the KV block size"):
        KeyScope("m", LAYOUT, chunk_tokens=10)
    for bad in ("../etc/passwd", "ab" * 31, "G" * 64):
        with pytest.raises(ValueError, match="invalid pool key"):
            check_key(bad)


# -- codecs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", [LOSSLESS, RAW])
def test_lossless_round_trip_is_exact(codec):
    raw = kv_bytes(64)
    e = Codec(codec).encode(KEYS[0], raw)
    assert decode_entry(e, KEYS[0]) == raw
    assert entry_info(e)[:3] == (KEYS[0], codec, len(raw))
    assert Codec(codec).lossless and not Codec(LOSSY).lossless
    if codec == RAW:
        assert len(e) == HEADER.size + len(raw)


@pytest.mark.parametrize("codec", [LOSSLESS, RAW])
def test_decode_into_a_slice_of_the_destination(codec):
    raw = kv_bytes(64)
    dst = bytearray(b"\xaa" * (3 * len(raw)))
    decode_entry_into(Codec(codec).encode(KEYS[0], raw), memoryview(dst)[len(raw):2 * len(raw)], KEYS[0])
    assert dst[len(raw):2 * len(raw)] == raw and set(dst[:len(raw)]) == set(dst[2 * len(raw):]) == {0xaa}
    with pytest.raises(CorruptEntry, match="its destination"):
        decode_entry_into(Codec(codec).encode(KEYS[0], raw), bytearray(len(raw) - 2))


def test_lossless_round_trip_special_values():
    raw = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 6e-8, np.nan] * 8, dtype=np.float16).tobytes()
    assert decode_entry(Codec().encode(KEYS[0], raw)) == raw


def test_lossy_round_trip_is_close_and_smaller():
    raw = kv_bytes(64)
    lossy = Codec(LOSSY).encode(KEYS[0], raw, SHAPE)
    out = np.frombuffer(decode_entry(lossy), dtype=np.float16).astype(np.float32)
    ref = np.frombuffer(raw, dtype=np.float16).astype(np.float32)
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= np.abs(ref).max() / 127  # within one int8 step of the scale
    assert len(lossy) < len(Codec(LOSSLESS).encode(KEYS[0], raw))
    with pytest.raises(ValueError, match="chunk shape"):
        Codec(LOSSY).encode(KEYS[0], raw)


@pytest.mark.parametrize("codec", [LOSSLESS, RAW])
@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "key"])
def test_corrupt_entries_are_detected(damage, codec):
    e = bytearray(entry(KEYS[0], codec=codec))
    if damage == "flip":
        e[HEADER.size + 10] ^= 0x40
    elif damage == "truncate":
        e = e[:-100]
    elif damage == "magic":
        e[0:4] = b"XXXX"
    with pytest.raises(CorruptEntry):
        decode_entry(bytes(e), KEYS[1] if damage == "key" else KEYS[0])


def test_mac_binds_entry_to_the_secret():
    raw = kv_bytes()
    signed = Codec(secret=b"deployment").encode(KEYS[0], raw)
    assert decode_entry(signed, KEYS[0], b"deployment") == raw
    for forged in (Codec().encode(KEYS[0], raw), Codec(secret=b"guess").encode(KEYS[0], raw)):
        decode_entry(forged, KEYS[0])   # well-formed: the pool (no secret) accepts it ...
        with pytest.raises(ForgedEntry):  # ... a worker does not load it
            decode_entry(forged, KEYS[0], b"deployment")
    moved = bytearray(signed)           # a signed entry replayed under another key
    moved[HEADER.size - 96:HEADER.size - 64] = bytes.fromhex(KEYS[1])
    with pytest.raises(ForgedEntry):
        decode_entry(bytes(moved), KEYS[1], b"deployment")


# -- tiers and the pool -------------------------------------------------------------------------

def test_memory_tier_lru_within_capacity():
    e = entry(KEYS[0])
    t = MemoryTier(capacity=len(e) * 2 + 10)
    evicted = []
    t.on_evict = lambda tier, k: evicted.append(k)
    for k in KEYS[:3]:
        assert t.put(k, entry(k))
        if k == KEYS[1]:
            assert t.get(KEYS[0]) is not None  # KEYS[0] becomes most recent
    assert evicted == [KEYS[1]] and t.used <= t.capacity
    assert t.contains(KEYS[0]) and not t.contains(KEYS[1])


def test_disk_tier_survives_restart_and_evicts(tmp_path):
    t = DirTier(str(tmp_path), capacity=10 << 20)
    for k in KEYS[:3]:
        assert t.put(k, entry(k))
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]
    again = DirTier(str(tmp_path), capacity=10 << 20)
    assert len(again) == 3 and again.get(KEYS[2]) == entry(KEYS[2])
    small = DirTier(str(tmp_path), capacity=len(entry(KEYS[0])) * 2)  # rebuild evicts down to capacity
    assert len(small) == 2 and small.used <= small.capacity
    assert sum(len(fs) for _, _, fs in os.walk(tmp_path)) == 2


def test_a_directory_that_refuses_writes_says_so_without_flooding_the_log(tmp_path, monkeypatch, caplog):
    """Every write refused (a read-only or immutable directory): serving goes on from the other
    tiers; the first failure is a warning, then one a minute with the count since (one a chunk
    flooded the log: 26 lines for one prompt; a doubling count went all but silent); no warning
    about a temp file that was never created; and the count is a series of its own."""
    import logging

    from kvpool import store
    from shared import metrics
    t = DirTier(str(tmp_path), capacity=10 << 20)
    entries = {k: entry(k) for k in KEYS}

    def refuse(*a, **k):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(store.os, "open", refuse)
    clock = [1000.0]
    monkeypatch.setattr(store.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger=store.log.name):
        for i in range(10):
            k = KEYS[i % len(KEYS)]
            assert not t.put(k, entries[k])
            clock[0] += 20
    warned = [r.getMessage() for r in caplog.records if "cannot store" in r.getMessage()]
    assert len(warned) == 4 and t.write_errors == 10, warned          # at 0, 60, 120, 180 s
    assert warned[0].endswith("1 write(s) failed so far)") and warned[1].endswith("(3 since the last such warning)")
    assert not [r for r in caplog.records if "cannot remove" in r.getMessage()]
    metrics.watch_pool_tiers([t])
    assert 'tandem_pool_write_errors_total{tier="disk"} 10.0' in metrics.render()[0].decode()


def test_a_read_the_system_refuses_is_a_miss_that_keeps_the_entry(tmp_path, monkeypatch):
    """EMFILE, EIO, an NFS server away: the entry is not at fault — a miss, counted, the file
    kept (every such read deleted a good entry: on a shared tier, on every node at once); a
    corrupt one is still removed."""
    from kvpool import store
    t = DirTier(str(tmp_path), capacity=10 << 20)
    t.put(KEYS[0], entry(KEYS[0]))

    def busy(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(store, "open_entry", busy)
    assert t.get(KEYS[0]) is None and t.read_errors == 1 and t.corrupt == 0
    assert os.path.exists(t.path(KEYS[0])) and t.contains(KEYS[0])
    monkeypatch.undo()
    assert t.get(KEYS[0]) == entry(KEYS[0])


def test_a_root_removed_while_running_comes_back_private(tmp_path):
    import shutil
    import stat
    t = DirTier(str(tmp_path / "pool"), capacity=10 << 20)
    shutil.rmtree(tmp_path / "pool")
    assert t.put(KEYS[0], entry(KEYS[0]))
    assert stat.S_IMODE(os.stat(tmp_path / "pool").st_mode) == 0o700


def test_the_disk_tier_is_its_users_alone(tmp_path):
    """Every tenant's KV is in there: files 0600, directories 0700; a root another version made
    0755 is closed at start (the probe found every entry world-readable)."""
    import stat
    root = tmp_path / "pool"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    t = DirTier(str(root), capacity=10 << 20)
    t.put(KEYS[0], entry(KEYS[0]))
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)   # noqa: E731
    assert mode(root) == 0o700 and mode(t.path(KEYS[0])) == 0o600
    assert mode(os.path.dirname(t.path(KEYS[0]))) & 0o077 == 0


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_file_is_a_miss_and_removed(tmp_path, damage):
    pool = KVPool.from_config(PoolConfig(ram_bytes=0, disk_dir=str(tmp_path)))
    pool.put(KEYS[0], entry(KEYS[0]))
    disk = pool.tiers[0]
    p = disk.path(KEYS[0])
    data = bytearray(open(p, "rb").read())
    if damage == "flip":
        data[-5] ^= 1
    else:
        data = data[: len(data) // 2]
    open(p, "wb").write(data)
    assert pool.get(KEYS[0]) is None
    assert not os.path.exists(p) and disk.corrupt == 1 and pool.lookup(KEYS[:1]) == []


def test_truncated_file_removed_at_restart(tmp_path):
    t = DirTier(str(tmp_path), capacity=10 << 20)
    t.put(KEYS[0], entry(KEYS[0]))
    t.put(KEYS[1], entry(KEYS[1]))
    with open(t.path(KEYS[1]), "r+b") as f:
        f.truncate(50)
    again = DirTier(str(tmp_path), capacity=10 << 20)
    assert len(again) == 1 and again.contains(KEYS[0]) and not os.path.exists(t.path(KEYS[1]))


def test_disk_full_is_logged_and_serving_goes_on(tmp_path, monkeypatch, caplog):
    events = []
    pool = KVPool.from_config(PoolConfig(ram_bytes=1 << 20, disk_dir=str(tmp_path)),
                              on_event=lambda kind, tier, keys: events.append((kind, tier)))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvpool.store._write_all", full)
    assert pool.put(KEYS[0], entry(KEYS[0])) == ["ram"]
    assert "is full" in caplog.text and pool.tiers[1].write_errors == 1
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs]  # no half-written file
    assert pool.get(KEYS[0]) == entry(KEYS[0])
    assert events == [("stored", "ram")]
    monkeypatch.undo()
    assert pool.put(KEYS[1], entry(KEYS[1])) == ["ram", "disk"]


def test_put_rejects_bad_entries_and_lookup_stops_at_first_miss(tmp_path):
    pool = KVPool.from_config(PoolConfig(ram_bytes=1 << 20))
    with pytest.raises(CorruptEntry):
        pool.put(KEYS[1], entry(KEYS[0]))  # entry for another key
    pool.put(KEYS[0], entry(KEYS[0]))
    pool.put(KEYS[2], entry(KEYS[2]))
    assert pool.lookup(KEYS[:3]) == ["ram"]
    assert pool.stats()["rejected"] == 1


def test_pool_config_validation(tmp_path):
    with pytest.raises(ValueError, match="at least one tier"):
        PoolConfig(ram_bytes=0).validate()
    with pytest.raises(ValueError, match="must differ"):
        PoolConfig(disk_dir=str(tmp_path), shared_dir=str(tmp_path)).validate()


def test_auto_codec_follows_the_tiers_and_lossless_codecs_share_entries():
    from shared.kv_connector import key_scope
    from shared.settings import PoolSettings
    assert PoolSettings(codec="auto").resolved_codec() == RAW                     # local disk: no compression
    assert PoolSettings(codec="auto", redis_url="redis://h:6379/0").resolved_codec() == LOSSLESS
    assert PoolSettings(codec="auto", shared_dir="/nfs/pool").resolved_codec() == LOSSLESS
    assert PoolSettings(codec=LOSSY).resolved_codec() == LOSSY
    seed = {c: key_scope("m", LAYOUT, PoolSettings(codec=c)).seed() for c in ("auto", RAW, LOSSLESS, LOSSY)}
    assert seed["auto"] == seed[RAW] == seed[LOSSLESS] != seed[LOSSY]             # same bytes: same entries
    with pytest.raises(ValueError, match="TANDEM_POOL_CODEC"):
        PoolSettings(codec="lz4").validate()


def _within(seconds: float, fn):
    """``fn()``'s result, or a failure when it has not returned within ``seconds`` (a blocked read)."""
    import threading
    out: list = []

    def run():
        try:
            out.append((fn(), None))
        except Exception as e:
            out.append((None, e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} still blocked after {seconds} s"
    result, error = out[0]
    if error is not None:
        raise error
    return result


def test_an_entry_that_is_no_regular_file_is_a_miss_not_a_blocked_reader(tmp_path):
    """A FIFO (or a device) in an entry's place blocked the reading thread in open() for good: the
    pool service's get, a worker's local read of the disk tier (2 such reads left every later
    pool load of that worker timing out) and a restart's rebuild."""
    from kvpool.codec import read_entry_into
    t = DirTier(str(tmp_path), capacity=10 << 20)
    for k in KEYS[:2]:
        t.put(k, entry(k))
    for k in KEYS[:2]:
        os.unlink(t.path(k))
        os.mkfifo(t.path(k), 0o600)
    out = bytearray(1 << 16)
    with pytest.raises(CorruptEntry, match="not a regular file"):
        _within(10, lambda: read_entry_into(t.path(KEYS[0]), out, KEYS[0]))
    assert _within(10, lambda: t.get(KEYS[0])) is None
    assert t.corrupt == 1 and not os.path.exists(t.path(KEYS[0]))          # removed as unusable
    again = _within(10, lambda: DirTier(str(tmp_path), capacity=10 << 20))  # a restart's rebuild
    assert len(again) == 0 and not os.path.exists(t.path(KEYS[1]))


def test_a_wrong_key_is_said_where_it_differs():
    """Keys sharing their first 16 characters were logged as `holds key X…, expected X…`."""
    other = KEYS[0][:20] + ("0" if KEYS[0][20] != "0" else "1") + KEYS[0][21:]
    with pytest.raises(CorruptEntry, match=r"differ from character 20"):
        decode_entry(entry(KEYS[0]), other)


def test_a_device_full_below_capacity_evicts_the_oldest_for_new_entries(tmp_path, monkeypatch, caplog):
    """A disk smaller than TANDEM_POOL_DISK_GB (or shared): the tier kept its oldest entries and
    stored no new prefix for good. Now the least recently used make room, for one retry: a device
    full of others' data still just skips the entry."""
    import kvpool.store as store
    t = DirTier(str(tmp_path), capacity=10 << 20)
    evicted = []
    t.on_evict = lambda tier, k: evicted.append(k)
    room = [2 * len(entry(KEYS[0]))]           # the device holds two entries
    real = store._write_all

    def device(fd, data):
        held = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path) for f in fs
                   if f.endswith(".kvp"))
        if held + len(data) > room[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(store, "_write_all", device)
    for k in KEYS[:3]:
        assert t.put(k, entry(k))
    assert evicted == [KEYS[0]] and t.contains(KEYS[2]) and t.contains(KEYS[1]) and not t.contains(KEYS[0])
    assert "made room for a new entry" in caplog.text and t.get(KEYS[2]) == entry(KEYS[2])
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]
    room[0] = 0                                # someone else's data fills it: one retry, then skipped
    assert not t.put(KEYS[3], entry(KEYS[3])) and len(t) == 1
    assert t.write_errors == 1 and t.room_made == 2    # KEYS[2] was stored after room was made: no error


def test_a_tier_too_small_for_a_prompt_keeps_its_head_not_its_unreachable_tail(tmp_path):
    """A chain is put tail first and a lookup or read counts its head as the most recently used:
    when the tier cannot hold the whole prompt, what it keeps is a prefix a lookup reaches (it
    kept only the tail: head first in, head first out — stored, counted in tandem_pool_bytes,
    never a hit). And an older chain goes before the head of one used since."""
    from kvpool.codec import pack_entries
    from services.kvpool import PoolService
    raw = {k: entry(k, codec=RAW) for k in KEYS}            # one size: the capacity counts entries
    pool = KVPool.from_config(PoolConfig(ram_bytes=0, disk_dir=str(tmp_path), disk_bytes=3 * len(raw[KEYS[0]])))
    svc = PoolService.__new__(PoolService)
    svc.pool = pool
    assert svc._store(KEYS[:5], pack_entries([raw[k] for k in KEYS[:5]])) == 5
    assert pool.lookup(KEYS[:5]) == ["disk"] * 3            # the first three, reachable
    pool.lookup(KEYS[:3], touch=True)
    pool.put(KEYS[5], raw[KEYS[5]])                         # evicts the chain's third, not its head
    assert pool.lookup(KEYS[:3]) == ["disk"] * 2


def test_temp_files_of_writers_that_died_are_removed_at_start(tmp_path):
    """A pool killed mid-write leaves its partial temp file: on a local disk tier it is removed at
    the next start when its writer (the pid in its name) is gone — it kept the device's room for
    an hour, uncounted — and one of a live writer stays (a shared tier keeps the hour rule: the
    pid may be another node's)."""
    import subprocess
    t = DirTier(str(tmp_path), capacity=10 << 20)
    t.put(KEYS[0], entry(KEYS[0]))
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = f"{t.path(KEYS[1])}.{gone.pid}.deadbeef.tmp"
    live = f"{t.path(KEYS[2])}.{os.getppid()}.cafef00d.tmp"
    for p in (dead, live):
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "wb").write(b"partial")
    again = DirTier(str(tmp_path), capacity=10 << 20)
    assert not os.path.exists(dead) and os.path.exists(live) and len(again) == 1
    open(dead, "wb").write(b"partial")
    DirTier(str(tmp_path), capacity=10 << 20, name="shared", shared=True)
    assert os.path.exists(dead)


def test_a_write_stored_after_room_was_made_is_no_write_error(tmp_path, monkeypatch, caplog):
    """The device full below the tier's capacity, room made, the entry stored: not a write error
    (a small disk that kept evicting counted every write as failed, and said "not stored" of
    entries it stored); one the device refuses even then is."""
    from kvpool import store
    t = DirTier(str(tmp_path), capacity=10 << 20)
    for k in KEYS[:2]:
        t.put(k, entry(k))
    real, calls = store._write_all, []

    def full_once(fd, data):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)
    monkeypatch.setattr(store, "_write_all", full_once)
    assert t.put(KEYS[2], entry(KEYS[2])) and t.write_errors == 0 and t.room_made == 1
    assert "not stored" not in caplog.text and t.contains(KEYS[2])

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(store, "_write_all", full)
    assert not t.put(KEYS[3], entry(KEYS[3])) and t.write_errors == 1 and "is full" in caplog.text
