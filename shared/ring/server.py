"""A ring member served to coordinators: a cpu-decode worker's shards of ring sessions.

A cpu-decode worker hosts shards of ring sessions next to its engine (``EngineMember``: a
``LocalMember`` over the engine's own paged KV cache and block manager, so a shard is KV the
worker's heartbeat counts as used) and serves them on a TCP port of its data plane
(``RingServer``; the port goes in its heartbeats as ``ring_port``), one thread per connection;
a connection's shards are released when it closes (its coordinator ended, or died).

Ops (``wire.Op``): ``RESERVE`` / ``LOAD`` a range, ``ATTEND`` a layer's q rows, ``READ`` the
blocks back, ``RELEASE``; ``PARK`` a loaded shard under a claim ticket (the prefill's scatter:
it outlives that connection, and is freed if not claimed within the data-plane timeout) and
``CLAIM`` it (the coordinator's connection owns it from then on).

Fold (``Ring(fold=True)`` with remote members; docs/protocol.md "Ring connections"): the members
pass the running attention state member to member instead of every segment's state to the
coordinator. ``CHAIN`` tells a member its place (index, where the state comes from, the next
member's address and a ticket announced there); it opens an authenticated ring connection to
the next member (``PEER`` with the ticket). A ``STEP`` carries a layer's q|k|v rows (from the
coordinator, or forwarded along the ring with ``pass``); per head group the member attends,
folds its segments into the predecessor's ``STATE`` and sends its own ``STATE`` on — to the
next member, or to the coordinator when it is the tail or the coordinator's own member comes
next. Failures travel down the ring as one ``ERR`` (``lost``: the member whose link broke).
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable

import torch

from kernels.cpu_ring import RingKernels
from shared.logs import sparse
from shared.ring.remote import RemoteMember
from shared.ring.session import LocalMember, RingCapacityError
from shared.ring.wire import (
    SHM_AREA, SLOTS, Attend, Chain, Channel, Err, Load, Mapped, Op, Parts, Peer, Range, Read, Release, Reserve,
    RingMemberLost, ShmAnswer, ShmOffer, State, Step, Ticket, check_ticket, new_region, server_handshake, tensor,
)
from shared.strategy import MAX_RING
from shared.transfer import link as links
from shared.transfer.shm import available as shm_available, shm_unlink

log = logging.getLogger("tandem.ring")

HANDSHAKES = 64   # connections at once that have not proved the data-plane key yet, a thread each (3,000
                  # idle ones held 3,000 threads and 200 MB for 30 s); a new one closes the oldest
HANDSHAKE_S = 5.0  # a new connection's time, from accept, to prove it (a member's client does at once)


def group_heads(nkv: int, groups: int, g: int) -> tuple[int, int]:
    """The kv heads [lo, hi) of head group ``g`` of ``groups`` (the fold's pipelining unit)."""
    return g * nkv // groups, (g + 1) * nkv // groups


class _Chain:
    """A member's place in a session's fold (module doc, "Fold"): its index in shard order,
    where the running state comes from (``prev``: "none" for the first member, "coord" when
    the member before it is the coordinator's own, "peer" over a link from the member before
    it) and where it goes (``next``: a link to the member after it, else the coordinator)."""

    def __init__(self, sid: str, index: int, prev: str, prev_worker: str, coord: Channel):
        self.sid, self.index, self.prev, self.prev_worker, self.coord = sid, index, prev, prev_worker, coord
        self.next: RemoteMember | None = None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()   # states from the peer link, when the
                                                              # step runs on the coordinator's connection
        self.ticket: str | None = None

    def close(self) -> None:
        if self.next is not None:
            self.next.close()
            self.next = None


class EngineMember(LocalMember):
    """A member over a worker's engine cache: ``reserve`` / ``release`` run on the engine's
    thread (``on_engine``: the block manager is the scheduler's), the rest where it is called
    (a shard's blocks are its own; the engine never touches them)."""

    def __init__(self, engine, on_engine: Callable[[Callable], object], name: str):
        kernels = RingKernels.of(engine.model)
        if kernels is None:
            raise ValueError("this engine does not run the fused CPU step: it cannot host ring members")
        super().__init__(kernels, engine.layout, 0, name, kv=engine.kv, blocks=engine.blocks)
        self.on_engine = on_engine

    def reserve(self, sid: str, start: int, end: int) -> None:
        self.on_engine(lambda: LocalMember.reserve(self, sid, start, end))

    def release(self, sid: str) -> None:
        self.on_engine(lambda: LocalMember.release(self, sid))


class RingServer:
    """Serves a worker's ``EngineMember`` to ring coordinators: one thread per connection; a
    connection's shards are released when it closes (its coordinator ended, or died)."""

    def __init__(self, member: LocalMember, host: str = "127.0.0.1", port: int = 0, key: bytes = b"",
                 timeout: float = 30.0, shm: bool = True, fold_timeout: float = 0.0):
        """``shm``: offer coordinators on this host a shared-memory region (module doc).
        ``fold_timeout``: in a fold, how long the first member after the coordinator waits for its
        predecessor's state (``timeout`` when 0); each member after it waits a little longer
        (``fold_wait``), so that the member right after a silent one gives up on it first and names
        it, and the members after pass that on — well before the coordinator gives up on the last
        (``RingConnector.member_timeout``: give this half of it), which would name the wrong one."""
        self.member, self.key, self.timeout = member, key, timeout
        self.fold_timeout = fold_timeout or timeout
        self.shm = shm and shm_available()
        self.identity = links.host_identity()
        self.max_payload = member.kv.numel() * member.kv.element_size() + (1 << 20)
        self._sock = socket.create_server((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._conns = 0
        self._handshakes: dict[socket.socket, object] = {}   # connections still to prove the key -> peer,
        self._hs_lock = threading.Lock()                     # oldest first
        self.turned_away = 0                      # connections closed unproven: HANDSHAKES newer ones came
        self._live: set[socket.socket] = set()   # open connections (closed with the server)
        self._parked: dict[str, tuple[str, threading.Timer]] = {}   # claim ticket -> (shard's sid, expiry)
        self._park_lock = threading.Lock()
        self._chains: dict[str, _Chain] = {}      # session -> its place in a fold
        self._tickets: dict[str, _Chain] = {}     # a predecessor's link, announced, not yet opened
        self._chain_lock = threading.Lock()
        self.step_s = self.wait_s = 0.0           # fold steps here, and their time blocked on a
                                                  # predecessor's state (``tandem bench ring --procs``)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="ring-server", daemon=True)

    def start(self) -> tuple[str, int]:
        self._thread.start()
        log.info("ring member %s serves on %s:%d (%s)", self.member.name, self.host, self.port,
                 "authenticated" if self.key else "NO data-plane key: connections are not authenticated")
        return self.host, self.port

    def close(self) -> None:
        """Stop serving: no new connection, and the open ones end (their shards are released),
        the links to next members too."""
        self._closed = True
        self._sock.close()
        with self._park_lock:
            parked, self._parked = list(self._parked.values()), {}
        for sid, timer in parked:
            timer.cancel()
            self.member.release(sid)
        for chain in list(self._chains.values()):
            chain.close()
        for conn in list(self._live):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def fold_wait(self, index: int) -> float:
        """Seconds member ``index`` of a fold waits for its predecessor: ``fold_timeout``, 7.5 % more
        a place along the ring (under 1.6 times it for the last of MAX_RING)."""
        return self.fold_timeout * (1 + 0.6 * index / MAX_RING)

    def _accept(self) -> None:
        """Accept until closed; an accept that fails (out of descriptors) or a thread that cannot
        start costs that connection, never the listener."""
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("ring member %s: accept failed (%s); going on", self.member.name, e)
                time.sleep(0.1)
                continue
            self._admit(conn, peer)
            self._conns += 1
            try:
                threading.Thread(target=self._serve, args=(conn, peer, self._conns, time.monotonic() + HANDSHAKE_S),
                                 name=f"ring-conn-{self._conns}", daemon=True).start()
            except RuntimeError as e:   # no thread to be had
                self._proven(conn)
                conn.close()
                log.warning("ring member %s: connection from %s not served (%s)", self.member.name, peer, e)

    def _admit(self, conn: socket.socket, peer) -> None:
        """``conn`` joins the handshakes under way; where HANDSHAKES are, the oldest is closed: a
        peer holding connections that prove nothing (slowly, within the deadline) gives up its
        own, not an honest member's place, which proves itself at once."""
        with self._hs_lock:
            old = None
            if len(self._handshakes) >= HANDSHAKES:
                old, old_peer = next(iter(self._handshakes.items()))
                del self._handshakes[old]
                self.turned_away += 1
                n = self.turned_away
            self._handshakes[conn] = peer
        if old is not None:
            # the 1st, 2nd, 4th, 8th... is logged: a flood does not flood the log
            sparse(log, n)(
                "ring member %s closed a connection from %s that had not proved the data-plane key: %d newer "
                "ones came (%d closed so far)", self.member.name, old_peer, HANDSHAKES, n)
            try:
                old.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _proven(self, conn: socket.socket) -> None:
        with self._hs_lock:
            self._handshakes.pop(conn, None)

    def _offer_region(self, ch: Channel, offer: ShmOffer) -> str | None:
        """``SHM``: a region for a coordinator on this host (its name in the reply), else none."""
        if not (self.shm and links.same_host(self.identity, offer.host)):
            ch.send(Op.OK, ShmAnswer())
            return None
        try:
            name, region = new_region(SHM_AREA)
        except OSError as e:
            log.warning("ring member %s: no shared-memory region (%s): the connection stays on TCP",
                        self.member.name, e)
            ch.send(Op.OK, ShmAnswer())
            return None
        try:
            ch.send(Op.OK, ShmAnswer(name, SHM_AREA))
            op, answer, _ = ch.recv()
        except BaseException:
            region.close()
            raise
        finally:
            shm_unlink(name)    # the coordinator holds it now, or never will
        if op != Op.MAPPED:
            region.close()
            raise ConnectionError(f"op {op} where the answer to a shared-memory offer belongs")
        if not Mapped.parse(answer).ok:
            region.close()
            ch.send(Op.OK)
            return None
        ch.attach(region, SHM_AREA)
        ch.send(Op.OK)
        return name

    def _serve(self, conn: socket.socket, peer, n: int, deadline: float) -> None:
        sids: set[str] = set()
        self._live.add(conn)
        ch = None
        try:
            try:   # (its place among the HANDSHAKES, taken by _accept, is given back once it is done)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # a reply's tag follows its payload
                conn.settimeout(min(self.timeout, HANDSHAKE_S))
                ch = server_handshake(conn, self.key, self.max_payload, min(deadline, time.monotonic() + self.timeout))
            finally:
                self._proven(conn)
            if ch is None:
                log.warning("ring member %s refused a connection from %s: no valid proof of the data-plane key",
                            self.member.name, peer)
                return
            conn.settimeout(None)    # a session may be idle between steps as long as it likes
            while True:
                op, meta, payload = ch.recv()
                if op == Op.SHM and ch.got == 1:   # only as the first message of a connection
                    self._offer_region(ch, ShmOffer.parse(meta))
                    continue
                if op == Op.PEER and not sids:      # a predecessor's link: this thread serves it
                    self._serve_peer(ch, str(meta.get("ticket", "")))
                    return
                sid = f"{n}:{meta.get('sid', '')}"
                if op == Op.STEP:
                    chain = self._chains.get(sid)
                    if chain is None:
                        ch.send(Op.ERR, Err("bad_request", f"no fold set up for {meta.get('sid')!r}"))
                    else:
                        self._step(chain, meta, payload, ch)
                    continue
                try:
                    reply, body = self._do(op, sid, meta, payload, sids, ch)
                except RingCapacityError as e:
                    ch.send(Op.ERR, Err("overloaded", str(e)))
                except RingMemberLost as e:
                    ch.send(Op.ERR, Err(e.code, str(e), e.lost))
                except (ValueError, KeyError) as e:
                    ch.send(Op.ERR, Err("bad_request", f"{type(e).__name__}: {e}"))
                else:
                    ch.send(Op.OK, reply, body)
        except (ConnectionError, OSError, struct.error, json.JSONDecodeError):
            pass
        except Exception:
            log.exception("ring connection %d from %s failed", n, peer)
        finally:
            for sid in sids:
                self._drop_chain(sid)
                self.member.release(sid)
            if ch is not None:
                ch.detach()
            self._live.discard(conn)
            conn.close()

    def _do(self, op: int, sid: str, meta: dict, payload: bytearray, sids: set[str], ch: Channel):
        """One request on a coordinator's (or a prefill's) connection: (reply meta, payload)."""
        m = self.member
        if op == Op.RESERVE:
            r = Reserve.parse(meta)
            m.reserve(sid, r.start, r.end)
            sids.add(sid)
            return None, b""
        if op == Op.LOAD:
            m.load(sid, payload, Load.parse(meta).first)
            return None, b""
        if op == Op.ATTEND:
            a = Attend.parse(meta)
            qkv = tensor(payload, (-1, m.kernels.qkv_width))
            if a.store:
                m.store(sid, a.layer, qkv, a.pos)
            parts = m.attend(sid, a.layer, qkv, a.pos)
            if parts is None:
                return Parts(None), b""
            return Parts(list(parts.shape)), parts.contiguous().view(torch.uint8).numpy()
        if op == Op.READ:
            return None, m.read(sid, Read.parse(meta).keys)
        if op == Op.RELEASE:
            Release.parse(meta)
            self._drop_chain(sid)
            m.release(sid)
            sids.discard(sid)
            return None, b""
        if op == Op.PARK:
            return self._park(sid, check_ticket(Ticket.parse(meta).ticket), sids), b""
        if op == Op.CLAIM:
            return self._claim(sid, check_ticket(Ticket.parse(meta).ticket), sids), b""
        if op == Op.CHAIN:
            if sid not in m.shards:
                raise KeyError(f"no shard of {meta.get('sid')!r} here")
            self._set_chain(sid, Chain.parse(meta), ch)
            return None, b""
        raise ValueError(f"unknown ring op {op}")

    def _park(self, sid: str, ticket: str, sids: set[str]) -> Range:
        """A loaded shard of this connection (a prefill's) waits for its coordinator's ``CLAIM``
        under ``ticket``: it outlives the connection, and is freed if not claimed within the
        timeout."""
        if sid not in sids:
            raise ValueError(f"no shard {sid.split(':', 1)[1]!r} on this connection to park")
        sh = self.member.shards[sid]
        with self._park_lock:
            if ticket in self._parked:
                raise ValueError("a shard is parked under that ticket already")
            timer = threading.Timer(self.timeout, self._expire, (ticket,))
            timer.daemon = True
            self._parked[ticket] = (sid, timer)
            sids.discard(sid)
        timer.start()
        return Range(sh.start, sh.end)

    def _claim(self, sid: str, ticket: str, sids: set[str]) -> Range:
        """The shard parked under ``ticket`` becomes this connection's ``sid`` (released when the
        connection closes, like one it reserved)."""
        if sid in sids:
            raise ValueError(f"this connection holds a shard {sid.split(':', 1)[1]!r} already")
        with self._park_lock:
            parked = self._parked.pop(ticket, None)
            if parked is None:
                raise ValueError("no shard is parked under that ticket (a wrong ticket, or it was not claimed "
                                 f"within {self.timeout:.0f} s and was freed)")
            old, timer = parked
            timer.cancel()
            sh = self.member.shards[sid] = self.member.shards.pop(old)
            sids.add(sid)
        return Range(sh.start, sh.end)

    def _expire(self, ticket: str) -> None:
        with self._park_lock:
            parked = self._parked.pop(ticket, None)
        if parked is None:
            return
        sh = self.member.shards.get(parked[0])
        self.member.release(parked[0])
        log.warning("ring member %s: a shard parked by a prefill (tokens [%s, %s)) was not claimed by its "
                    "coordinator within %.0f s: freed", self.member.name, sh and sh.start, sh and sh.end,
                    self.timeout)

    # ---- the fold along the ring (module doc, "Fold") -------------------------------------
    def _set_chain(self, sid: str, c: Chain, ch: Channel) -> None:
        """``CHAIN``: this member's place in the session's fold; opens the link to the member
        after it (authenticated like any ring connection) when the coordinator names one."""
        if c.prev not in ("none", "coord", "peer"):
            raise ValueError(f"a fold's predecessor is none, coord or peer, not {c.prev!r}")
        if c.prev == "peer" and c.ticket is None:
            raise ValueError("ring Chain: a link from a peer needs the field 'ticket'")
        chain = _Chain(sid, c.index, c.prev, c.prev_worker, ch)
        self._drop_chain(sid)
        with self._chain_lock:
            self._chains[sid] = chain
            if c.prev == "peer":
                chain.ticket = str(c.ticket)
                self._tickets[chain.ticket] = chain
        if c.next:
            worker, host, port, ticket = c.next
            link = RemoteMember(str(worker), str(host), int(port), self.key, self.member.layout, self.timeout,
                                self.shm)
            try:
                link._call(Op.PEER, Peer(str(ticket)))
            except BaseException:
                link.close()
                raise
            chain.next = link

    def _drop_chain(self, sid: str) -> None:
        with self._chain_lock:
            chain = self._chains.pop(sid, None)
            if chain is not None and chain.ticket is not None:
                self._tickets.pop(chain.ticket, None)
        if chain is not None:
            chain.close()

    def _serve_peer(self, ch: Channel, ticket: str) -> None:
        """A predecessor's link (``PEER`` with the ticket the coordinator announced): its states
        go to the session's inbox, or, when the q rows come along the ring too (``STEP`` here),
        the step runs on this thread. Its end tells the step the predecessor is lost."""
        with self._chain_lock:
            chain = self._tickets.pop(ticket, None)
        if chain is None:
            ch.send(Op.ERR, Err("bad_request", "no fold awaits this link"))
            return
        ch.send(Op.OK)
        lost = Err("unavailable", f"{self.member.name}: the link from {chain.prev_worker} broke", chain.prev_worker)
        try:
            while True:
                op, meta, payload = ch.recv()
                if op == Op.STEP:
                    self._step(chain, meta, payload, ch)
                elif op in (Op.STATE, Op.ERR):
                    if op == Op.ERR and meta.get("lost"):
                        lost = Err.parse(meta)   # a member further up is gone: name it, not the messenger
                    chain.inbox.put((op, meta, payload))
                else:
                    raise ConnectionError(f"op {op} on a predecessor's link")
        except (ConnectionError, OSError, struct.error, json.JSONDecodeError):
            pass
        finally:
            chain.inbox.put(None)
            self._broken(chain, lost)

    def _broken(self, chain: _Chain, err: Err) -> None:
        """The link from the predecessor ended while the session is live (its worker died, or
        its own predecessor did): say so down the ring and to the coordinator at once — with the
        q rows passed along the ring no step would start here to report it — and close the link
        to the next member, which does the same."""
        if self._chains.get(chain.sid) is not chain:
            return      # released: its predecessor's link ends with it
        if chain.next is not None:
            try:
                chain.next.ch.send(Op.ERR, err)
            except OSError:
                pass
            chain.close()
        try:
            chain.coord.send(Op.ERR, err)
        except OSError:
            pass

    def _step(self, chain: _Chain, meta: dict, payload: bytearray, src: Channel) -> None:
        """``STEP``: a layer of a folding step. Store the new k, v (the tail), then head group by
        head group: attend this shard's segments, fold them into the predecessor's running state
        (the same left fold in segment order as ``Ring(fold=True)`` in one process) and pass the
        group's state on at once — to the next member, or back to the coordinator (the tail, or
        the coordinator's own member next) — while attending the next group. A failure goes on
        down the ring as one ``ERR`` (``lost``: the member whose link broke) to the coordinator."""
        m, sid = self.member, chain.sid
        t0 = time.perf_counter()
        err: Err | None = None
        try:
            st = Step.parse(meta)
            layer, pos, tail, groups = st.layer, st.pos, st.tail, st.groups
            if not 1 <= groups <= min(m.kernels.cfg.n_kv_heads, SLOTS - 2) or not chain.index <= tail:
                raise ValueError(f"bad fold step: {groups} head groups, member {chain.index} of a tail {tail}")
            qkv = tensor(payload, (-1, m.kernels.qkv_width))
        except (KeyError, ValueError, TypeError) as e:
            err, groups = Err("bad_request", f"{m.name}: {type(e).__name__}: {e}"), 1
        last = err is not None or chain.index == tail or chain.next is None
        out = chain.coord if last else chain.next.ch
        if err is None and st.qpass and not last:   # the q rows go on along the ring first
            try:
                out.send(Op.STEP, meta, payload)
            except OSError:
                return     # the next member is gone: the one after it (or the coordinator) says so
        direct = (chain.prev == "coord") == (src is chain.coord)   # its states come on this connection
        nkv = m.kernels.cfg.n_kv_heads
        try:
            if err is None and chain.index == tail:
                m.store(sid, layer, qkv, pos)
        except (KeyError, ValueError) as e:
            err = Err("bad_request", f"{m.name}: {type(e).__name__}: {e}")
        for g in range(groups):
            if err is None:
                heads = group_heads(nkv, groups, g)
                try:
                    parts = m.attend(sid, layer, qkv, pos, heads)
                    if parts is None:
                        raise ValueError(f"no key of positions < {pos + qkv.shape[0]} in this shard")
                except (KeyError, ValueError) as e:
                    err = Err("bad_request", f"{m.name}: {type(e).__name__}: {e}")
            if err is None and chain.prev != "none":
                w0 = time.perf_counter()
                try:
                    got = src.recv() if direct else chain.inbox.get(timeout=self.fold_wait(chain.index))
                except (queue.Empty, OSError, ConnectionError):
                    got = None
                self.wait_s += time.perf_counter() - w0
                if got is None:
                    err = Err("unavailable", f"{m.name}: the link from {chain.prev_worker} broke", chain.prev_worker)
                elif got[0] == Op.ERR:
                    err = Err.parse(got[1])
                elif got[0] != Op.STATE or got[1].get("g") != g:
                    err = Err("bad_request", f"{m.name}: op {got[0]} where group {g}'s state belongs")
                else:
                    parts = torch.cat([tensor(got[2], got[1]["shape"]), parts], dim=1)
            try:
                if err is None:
                    state = m.kernels.fold(parts, pos, qkv.shape[0], heads)
            except ValueError as e:
                err = Err("bad_request", f"{m.name}: {e}")
            try:
                if err is not None:
                    out.send(Op.ERR, err)
                    return
                out.send(Op.STATE, State(g, list(state.shape)), state.view(torch.uint8).numpy())
            except OSError:
                return
        self.step_s += time.perf_counter() - t0
