"""Storage tiers for pool entries: RAM (LRU, bounded bytes), directories (local NVMe, shared) and
Redis (a networked store every node shares).

Every tier holds whole entries (``kvpool.codec``) under their key and has a byte capacity;
putting past it evicts the least recently used entries (``on_evict(tier, key)`` hears of it).

``DirTier`` files: ``<root>/<key[:2]>/<key>.kvp``. A write goes to a unique temp file in the
same directory, is fsynced, then renamed over the final name — a reader sees the whole entry
or none, and two writers of the same chunk both end with the same complete file. The index is
rebuilt from the directory at start (so the pool survives restarts); entries whose header or
size do not check out are removed then, and an entry whose checksum fails when read is removed
and reported as a miss; a read the system refuses (too many open files, an NFS hiccup) is a miss
that keeps the file. A full disk (or any write error) is logged — once a minute at most, with
the count — and the put is skipped: serving goes on. Each tier's counts (write errors, corrupt
entries, evictions) are series of their own (``shared.metrics.watch_pool_tiers``). A ``shared`` tier (NFS or any shared filesystem) also looks on disk for keys
missing from its index, since other nodes write there too.

``RedisTier`` (the optional extra ``tandem-serve[redis]``): one Redis value per entry under
``<prefix><key>``; a SET is atomic (a reader sees the whole entry or none) and the stored bytes
are the entry as it is, header, checksum and MAC included. Always shared: every pool copy that
names the same server and prefix sees the others' entries. Its index is rebuilt at start by
scanning the prefix (headers checked, broken values deleted, least recently used first), so the
tier survives a restart of every Tandem service. A server that is down or refuses a write (its
``maxmemory``) is logged and treated as a miss / a skipped put: serving goes on.
"""

from __future__ import annotations

import abc
import errno
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from typing import Callable

from kvpool.codec import HEADER, CorruptEntry, entry_info, open_entry, verify_entry
from kvpool.pins import Pins

log = logging.getLogger("tandem.kvpool")

SUFFIX = ".kvp"
STALE_TEMP_S = 3600.0  # temp files older than this are leftovers of a crashed writer
SAY_EVERY_S = 60.0     # a failing tier's repeated warning (a write, a read, room made) once a minute at most


def entry_path(root: str, key: str) -> str:
    """Where a directory tier rooted at ``root`` keeps ``key``'s entry."""
    return os.path.join(root, key[:2], key + SUFFIX)


class Tier(abc.ABC):
    name: str
    capacity: int              # bytes at most
    where: str = ""            # its directory or server, for messages

    def __init__(self):
        self.on_evict: Callable[[str, str], None] | None = None
        self.used = 0          # bytes held
        self.hits = self.misses = self.corrupt = self.write_errors = self.evictions = 0
        self.read_errors = 0   # reads the system refused (not the entry's fault: the file is kept)
        self.room_made = 0     # entries evicted early because the device was full below the capacity
        self._said: dict[str, tuple[float, int]] = {}   # warning kind -> (last said, count then)
        self._lock = threading.Lock()
        self.pins: Pins | None = None   # entries eviction skips while pinned (kvpool/pins.py; None: none)
        self.out_of_space = False        # the last failed write was the device's "full" (ENOSPC, EDQUOT)
        self.last_error: Exception | None = None   # the last failed write's

    def _say(self, kind: str, count: int, msg: str, *args) -> None:
        """A warning that may repeat for every entry while a fault lasts: the first one, then at
        most one every ``SAY_EVERY_S`` with how many happened since (the rest at debug)."""
        now = time.monotonic()
        last, then = self._said.get(kind, (-SAY_EVERY_S, 0))
        if now - last < SAY_EVERY_S:
            log.debug(msg, *args)
            return
        self._said[kind] = (now, count)
        since = f" ({count - then} since the last such warning)" if then else ""
        log.warning(msg + since, *args)

    def pin(self, key: str, tenant: str, until: float) -> bool:
        """Pin a held ``key`` for ``tenant`` until ``until`` (time.time()); False when not held or
        pins are off. Past the tenant's share its oldest pins are unpinned (``Pins.pin``)."""
        with self._lock:
            size = self._index.get(key)
            if size is None or self.pins is None:
                return False
            return key not in self.pins.pin(key, tenant, size, until)

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The verified entry, or None (absent, or corrupt: then it is removed)."""

    def put(self, key: str, entry: bytes, replace: bool = False) -> bool:
        """Store a verified entry; False when it could not be stored (too big, disk full).
        ``replace``: write it over the entry held under ``key`` (a writer could not use that one)."""
        with self._lock:
            if replace and key in self._index:
                self.used -= self._index.pop(key)
            held = self._admit(key, len(entry))
            if held is not None:
                return held
        if not self._write(key, entry):
            if not (self.out_of_space and self._make_room_on_a_full_device(len(entry))
                    and self._write(key, entry)):
                self._write_failed(key)
                return False
        with self._lock:
            if key not in self._index:
                self._index[key] = len(entry)
                self.used += len(entry)
        return True

    def _write_failed(self, key: str) -> None:
        """A put that did not store ``key`` (after room was made, where the device was full):
        counted (tandem_pool_write_errors_total), and said — the first, then once a minute with
        the count, each kind on its own (a full device does not hide a read-only one)."""
        self.write_errors += 1
        e = self.last_error
        if self.out_of_space:
            self._say("full", self.write_errors, "%s tier %s is full: entry %s not stored (serving goes on; "
                      "%d write(s) failed so far)", self.name, self.where, key[:16], self.write_errors)
        else:
            self._say(f"write {getattr(e, 'errno', '')}", self.write_errors, "%s tier %s: cannot store %s: %s "
                      "(serving goes on; %d write(s) failed so far)", self.name, self.where, key[:16], e,
                      self.write_errors)

    def _make_room_on_a_full_device(self, nbytes: int) -> bool:
        """The device said it is full (``out_of_space``) before the tier reached its capacity (a
        disk smaller than TANDEM_POOL_DISK_GB, or shared with other data): the least recently used
        unpinned entries go until ``nbytes`` are freed, for the new entry — the tier kept its
        oldest entries for good and stored no new prefix. False: not enough of its own to free."""
        with self._lock:
            freed = 0
            while freed < nbytes:
                size = self._evict_oldest()
                if size is None:
                    return False
                freed += size
        self.room_made += 1
        self._say("room", self.room_made, "%s tier: the device is full below the tier's capacity: its %.1f MiB "
                  "least recently used made room for a new entry", self.name, freed / 2**20)
        return True

    @abc.abstractmethod
    def _write(self, key: str, entry: bytes) -> bool:
        """Put the entry's bytes in place (room is made); False on failure (``out_of_space`` set
        when the device said it is full)."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """The tier has ``key`` (a shared tier also asks its store: I/O)."""

    def holds(self, key: str) -> bool:
        """``key`` is in this tier's index (no I/O: safe on an event loop)."""
        with self._lock:
            return key in self._index

    def touch(self, key: str) -> None:
        """``key`` was used without a ``get`` (a worker read its file): now most recent."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)

    @abc.abstractmethod
    def remove(self, key: str) -> None: ...

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[str]:
        """The keys this tier indexes now."""
        with self._lock:
            return list(self._index)

    def stats(self) -> dict:
        return {"tier": self.name, "entries": len(self), "bytes": self.used, "capacity": self.capacity,
                "hits": self.hits, "misses": self.misses, "corrupt": self.corrupt, "read_errors": self.read_errors,
                "write_errors": self.write_errors, "evictions": self.evictions}

    def _admit(self, key: str, nbytes: int) -> bool | None:
        """Under the lock, before a put: True when ``key`` is held already (now most recent),
        False when ``nbytes`` can never fit, None once room is made for it."""
        if key in self._index:
            self._index.move_to_end(key)
            return True
        if nbytes > self.capacity:
            return False
        return None if self._evict_for(nbytes) else False

    def _indexed(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def _adopt(self, found: list[tuple], where) -> None:
        """Take the entries found at start-up, (age order, key, size), as the index: oldest first out."""
        found.sort()
        with self._lock:
            self._index = OrderedDict((k, n) for _, k, n in found)
            self.used = sum(n for _, _, n in found)
            self._evict_for(0)
        log.info("%s tier %s: %d entries, %.1f MiB", self.name, where, len(self._index), self.used / 2**20)

    def _evict_for(self, nbytes: int) -> bool:
        """Drop least recently used entries — unpinned ones: a pinned entry stays while its pin
        lasts — until ``nbytes`` more fit (caller holds the lock); False when pins leave no room."""
        while self.used + nbytes > self.capacity:
            if self._evict_oldest() is None:
                return False
        return True

    def _evict_oldest(self) -> int | None:
        """Drop the least recently used unpinned entry (caller holds the lock): its size, or None
        when every entry is pinned (or there is none)."""
        key = next((k for k in self._index if self.pins is None or not self.pins.pinned(k)), None)
        if key is None:
            return None
        size = self._index.pop(key)
        self.used -= size
        self.evictions += 1
        self._drop(key)
        if self.on_evict is not None:
            self.on_evict(self.name, key)
        return size

    def _drop(self, key: str) -> None:
        """Free an evicted entry's storage."""

    def _hit(self, key: str, nbytes: int) -> None:
        """A read found ``key`` (perhaps written by another node): indexed, now most recent."""
        with self._lock:
            if key not in self._index:
                self._index[key] = nbytes
                self.used += nbytes
            self._index.move_to_end(key)
        self.hits += 1

    def _unusable(self, key: str, why: Exception) -> None:
        """A read found ``key`` corrupt or unreadable: removed, counted, a miss (returns None)."""
        log.warning("%s tier: entry %s unusable (%s): removed, treated as a miss", self.name, key[:16], why)
        self.corrupt += 1
        self.misses += 1
        self.remove(key)

    def _forget(self, key: str) -> None:
        """Drop ``key`` from the index (its storage is gone or going)."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used -= size
            if self.pins is not None:
                self.pins.forget(key)


class MemoryTier(Tier):
    def __init__(self, capacity: int, name: str = "ram"):
        super().__init__()
        self.name, self.capacity = name, capacity
        self._index: OrderedDict[str, int] = OrderedDict()   # key -> size, LRU first
        self._data: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._index.move_to_end(key)
            self.hits += 1
            return entry

    def _write(self, key: str, entry: bytes) -> bool:
        self._data[key] = bytes(entry)
        return True

    def contains(self, key: str) -> bool:
        return key in self._data

    def remove(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used -= size
                self._data.pop(key, None)
            if self.pins is not None:
                self.pins.forget(key)

    def _drop(self, key: str) -> None:
        self._data.pop(key, None)


class DirTier(Tier):
    def __init__(self, root: str, capacity: int, name: str = "disk", shared: bool = False):
        super().__init__()
        self.name, self.capacity, self.shared = name, capacity, shared
        self.root = self.where = os.path.abspath(root)
        self._index: OrderedDict[str, int] = OrderedDict()   # key -> file size, LRU first
        # every tenant's KV is in here: the service's user's alone (files 0600, directories 0700;
        # every copy sharing the directory runs as that user: the image's, uid 999). A root made
        # before (0755) is closed now, which closes what is under it
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        try:
            if os.stat(self.root).st_mode & 0o077:
                os.chmod(self.root, 0o700)
        except OSError as e:   # (a mount point that is not ours: its owner decides)
            log.warning("KV pool %s tier %s: could not make it private (%s)", name, self.root, e)
        self.rebuild()

    def path(self, key: str) -> str:
        return entry_path(self.root, key)

    def rebuild(self) -> None:
        """Index every valid entry on disk (oldest access first); remove broken ones."""
        found: list[tuple[float, str, int]] = []
        now, left = time.time(), 0
        for sub in sorted(os.listdir(self.root)):
            d = os.path.join(self.root, sub)
            if not os.path.isdir(d):
                continue
            for fname in os.listdir(d):
                p = os.path.join(d, fname)
                if fname.endswith(".tmp"):
                    left += _remove_if_stale(p, now, local=not self.shared)
                    continue
                if not fname.endswith(SUFFIX):
                    continue
                key = fname[:-len(SUFFIX)]
                try:
                    st = os.stat(p)
                    with open_entry(p) as f:
                        got_key, _, _, total = entry_info(f.read(HEADER.size))
                    if got_key != key or total != st.st_size:
                        raise CorruptEntry(f"header says {total} bytes for key {got_key[:16]}…")
                except CorruptEntry as e:
                    log.warning("%s tier: removing broken entry %s: %s", self.name, p, e)
                    self.corrupt += 1
                    _unlink(p)
                    continue
                except OSError:
                    continue  # removed meanwhile (another node)
                found.append((st.st_atime, key, st.st_size))
        if left:
            log.info("%s tier: %d temp file(s) of writers that died removed", self.name, left)
        self._adopt(found, self.root)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            known = key in self._index
        if not known and not self.shared:
            self.misses += 1
            return None
        p = self.path(key)
        try:
            with open_entry(p) as f:
                entry = f.read()
            verify_entry(entry, key)
        except FileNotFoundError:
            self._forget(key)
            self.misses += 1
            return None
        except CorruptEntry as e:
            return self._unusable(key, e)
        except OSError as e:   # the system's refusal (EMFILE, EIO, an NFS server away): not the entry's fault
            self.read_errors += 1
            self.misses += 1
            self._say("read", self.read_errors, "%s tier: cannot read entry %s: %s (a miss; the entry is kept)",
                      self.name, key[:16], e)
            return None
        self._hit(key, len(entry))
        return entry

    def _write(self, key: str, entry: bytes) -> bool:
        p = self.path(key)
        tmp = f"{p}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = None
        try:
            # the root first: makedirs gives only the leaf its mode (a root removed while running
            # came back 0755, every key name readable to any user until a restart)
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, entry)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, p)   # atomic: readers see the old state or the whole entry
        except OSError as e:   # (counted and said by ``put`` once it gives up: ``_write_failed``)
            if fd is not None:    # (no temp file to remove when it was never created)
                _unlink(tmp)
            self.out_of_space = e.errno in (errno.ENOSPC, errno.EDQUOT)
            self.last_error = e
            return False
        self.out_of_space = False
        return True

    def contains(self, key: str) -> bool:
        if self._indexed(key):
            return True
        return self.shared and os.path.exists(self.path(key))

    def remove(self, key: str) -> None:
        self._forget(key)
        _unlink(self.path(key))

    def _drop(self, key: str) -> None:
        _unlink(self.path(key))


class RedisTier(Tier):
    """Entries in a Redis server (``redis://[:password@]host:port/db``, ``rediss://`` for TLS)."""

    def __init__(self, url: str, capacity: int, name: str = "redis", prefix: str = "tandem:kvpool:",
                 timeout: float = 5.0):
        super().__init__()
        try:
            import redis
        except ImportError as e:
            raise RuntimeError("the Redis pool tier needs redis-py: pip install 'tandem-serve[redis]'") from e
        self._errors = redis.RedisError
        self.name, self.capacity, self.prefix = name, capacity, prefix
        self.shared = True
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.where = _redacted(url)
        self._index: OrderedDict[str, int] = OrderedDict()   # key -> value size, LRU first
        self.rebuild()

    def rkey(self, key: str) -> str:
        return self.prefix + key

    def rebuild(self) -> None:
        """Index every valid entry under the prefix (least recently used first); delete broken ones."""
        found: list[tuple[int, str, int]] = []
        try:
            names = [n.decode() for n in self.client.scan_iter(match=self.prefix + "*", count=1000)]
            for i in range(0, len(names), 256):
                batch = names[i:i + 256]
                pipe = self.client.pipeline(transaction=False)
                for n in batch:
                    pipe.getrange(n, 0, HEADER.size - 1)
                    pipe.strlen(n)
                    pipe.object("idletime", n)
                res = pipe.execute(raise_on_error=False)
                for j, n in enumerate(batch):
                    head, size, idle = res[3 * j: 3 * j + 3]
                    if isinstance(head, Exception) or not size:
                        continue  # removed meanwhile (another node)
                    key = n[len(self.prefix):]
                    try:
                        got_key, _, _, total = entry_info(head)
                        if got_key != key or total != size:
                            raise CorruptEntry(f"header says {total} bytes for key {got_key[:16]}…")
                    except CorruptEntry as e:
                        log.warning("%s tier: removing broken entry %s: %s", self.name, n, e)
                        self.corrupt += 1
                        self.client.delete(n)
                        continue
                    found.append((-(idle if isinstance(idle, int) else 0), key, size))
        except self._errors as e:
            log.warning("%s tier %s: cannot read the server's entries (%s): starting with an empty index; "
                        "entries there are still found when asked for", self.name, self.where, e)
        self._adopt(found, self.where)

    def get(self, key: str) -> bytes | None:
        try:
            entry = self.client.get(self.rkey(key))
        except self._errors as e:
            log.warning("%s tier %s: cannot read %s (%s): treated as a miss", self.name, self.where, key[:16], e)
            self.misses += 1
            return None
        if entry is None:
            self._forget(key)
            self.misses += 1
            return None
        try:
            verify_entry(entry, key)
        except CorruptEntry as e:
            return self._unusable(key, e)
        self._hit(key, len(entry))
        return entry

    def _write(self, key: str, entry: bytes) -> bool:
        try:
            self.client.set(self.rkey(key), entry)
        except self._errors as e:   # (counted and said by ``put``: ``_write_failed``)
            self.out_of_space, self.last_error = False, e
            return False
        return True

    def contains(self, key: str) -> bool:
        if self._indexed(key):
            return True
        try:
            return bool(self.client.exists(self.rkey(key)))
        except self._errors:
            return False

    def remove(self, key: str) -> None:
        self._forget(key)
        self._drop(key)

    def _drop(self, key: str) -> None:
        try:
            self.client.delete(self.rkey(key))
        except self._errors as e:
            log.warning("%s tier %s: cannot delete %s: %s", self.name, self.where, key[:16], e)


def _redacted(url: str) -> str:
    """``url`` without its password (for logs)."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}"


def _write_all(fd: int, data) -> None:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e)


def _remove_if_stale(path: str, now: float, local: bool = False) -> int:
    """Remove a temp file a writer left (1: removed): older than ``STALE_TEMP_S``, or — ``local``:
    a directory only this host writes — whose writer (the pid in its name) is no process now (a
    pool killed mid-write: its partial file took room the tier does not count)."""
    try:
        if now - os.stat(path).st_mtime > STALE_TEMP_S or local and not _alive(path):
            _unlink(path)
            return 1
    except OSError:
        pass
    return 0


def _alive(path: str) -> bool:
    """Is the writer of temp file ``path`` (``<entry>.<pid>.<hex>.tmp``) a process here now?"""
    try:
        pid = int(path.rsplit(".", 3)[1])
    except (IndexError, ValueError):
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # (someone else's process: alive)
        return True
    return True
