"""Decode workers: continuous-batching decode on CUDA (gpu-decode) or CPU (cpu-decode).

Both run the same engine and the same code; only the device differs. A decode worker takes
requests two ways:
- DecodeRequest: the KV of a prefilled prompt arrives over the data plane (Receiving →
  Importing → Decoding, streaming from ``next_seq``);
- GenerateRequest: the worker runs the prompt itself (the router chose no separate prefill).
A finished session's KV (its full pool chunks) is written back to the KV pool in the
background, so the session's next turn can start on any worker.
A running request can move to another decode worker mid-generation, or spread onto a ring of
cpu-decode workers (MigrateRequest, see ``handle_migrate``): parked at a step boundary, its KV and sampler state go over the data
plane, the target continues the same stream at the next seq; if the move fails it goes on here.
When no CUDA device exists, gpu-decode says so in its log and runs on the CPU, so the whole
topology runs on any machine.

Ring decode (the ``cpu-ring(N)`` strategy, docs/strategies.md): a cpu-decode worker hosts shards
of ring sessions in its engine's KV cache and serves them on its ring port
(``shared/ring/``, driven by its ``RingConnector``); a DecodeRequest carrying a ring makes this worker the
coordinator: it claims the members' shards the prefill scattered and parked (``DecodeRequest.claim``;
the blob holds its own range only), or — a session spread from a running worker — scatters the
blob's block ranges over the members itself (Scattering), then decodes the request with the ring (each engine step runs one ring step of it: q|k|v out, segment states
back, on the data plane). A member lost mid-stream ends the request with a coded
"unavailable" error naming it (``ErrorReply.lost``): the gateway resumes it without that worker.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from kernels.cpu_ring import RingKernels
from shared import metrics, subjects
from shared.bus import BusError, RemoteError
from shared.engine.kv_cache import KVBlobHeader
from shared.ring import RingConnector
from shared.schemas import ERROR_STATUS, DecodeRequest, GenerateRequest, MigrateReply, MigrateRequest
from shared.settings import Settings
from shared.tier import Tier
from shared.transfer import TransferError
from services.worker import EngineWorker, Request, State, priority_of, sampling_from

log = logging.getLogger("tandem.decode")


class DecodeWorker(EngineWorker):
    writes_back = True

    def __init__(self, settings: Settings, role: str):
        self.role = role
        device = settings.worker.device or ("cuda" if role == subjects.GPU_DECODE else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("%s: no CUDA device visible to torch; running on the CPU instead", role)
            device = "cpu"
        super().__init__(settings, device)
        self.ring: RingConnector | None = None

    async def register(self) -> None:
        self.ring = RingConnector(self.worker_id, self.settings.data, self.kv.peers, self.engine,
                                  self.settings.worker.step_deadline_s)
        if self.role == subjects.CPU_DECODE and RingKernels.of(self.engine.engine.model) is not None:
            self.ring_port = self.ring.host()   # this worker's cache hosts ring members' shards
        await self.bus.serve(subjects.worker_decode(self.worker_id), self.handle_decode, expected=DecodeRequest)
        await self.bus.serve(subjects.worker_generate(self.worker_id), self.handle_generate,
                             expected=GenerateRequest)
        await self.bus.serve(subjects.worker_migrate(self.worker_id), self.handle_migrate, expected=MigrateRequest)

    async def handle_decode(self, req: DecodeRequest) -> None:
        if self.is_aborted(req.request_id, req.attempt):  # aborted while its KV was on the way
            self.kv.discard(req.handle.transfer_id)
            raise BusError("not_found", f"request {req.request_id} was aborted")
        if self.draining:
            self.kv.discard(req.handle.transfer_id)
            self.refuse_if_draining("overloaded", f"the KV of {req.request_id}")
        blob = await self.kv.receive(req.handle)
        if req.ring:   # this worker coordinates the ring (the prefill may have scattered the others' ranges)
            submit = self.ring.coordinate(req.ring, blob, f"{req.request_id}#{req.attempt}", req.claim,
                                          priority_of(req.tier))
        else:
            submit = self.engine.submit_kv(req.request_id, blob, priority_of(req.tier), at_cap=req.at_cap)
        outputs = await self.admit(req, submit, req.attempt)
        self.spawn(req.request_id, self.stream_outputs(req.request_id, req.stream_subject, outputs, req.next_seq,
                                                       attempt=req.attempt, offset=len(req.output_token_ids)))

    async def handle_generate(self, req: GenerateRequest) -> None:
        """Run the prompt here; a prefix the KV pool holds (a session's earlier turns, written
        back by whichever worker ran them) is loaded instead of computed. With ``req.resume`` the
        request continues where its client is (its worker was lost)."""
        self.refuse_if_draining("not_found", f"request {req.request_id}")
        params = sampling_from(req.sampling)
        resume = req.resume
        outputs_so_far = resume.output_token_ids if resume else []
        prefix = await self.kv.fetch_prefix(req.prompt_token_ids + outputs_so_far, req.tenant)
        attempt = resume.attempt if resume else 0
        outputs = await self.admit(req, self.engine.submit(
            req.request_id, req.prompt_token_ids, params, priority_of(req.tier), prefix=prefix,
            resume_token_ids=outputs_so_far, emitted_chars=resume.emitted_chars if resume else 0,
            tenant=req.tenant), attempt)
        self.spawn(req.request_id, self.stream_outputs(req.request_id, req.stream_subject, outputs,
                                                       resume.next_seq if resume else 0, attempt=attempt,
                                                       offset=len(outputs_so_far)))

    async def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        await super().close()

    async def handle_migrate(self, req: MigrateRequest) -> MigrateReply:
        """Move a decoding request to ``req.target_worker``; the reply says where its stream goes on.
        Coded errors: not_found (not here), forbidden (the target address is not the data plane of
        ``req.target_worker``, live: nothing moves), unavailable (not between decode steps yet, or
        already moving: retry), or the failed step's code (the request then goes on here) — overloaded
        when every sequence slot of the target is taken (two router copies each planned its last
        one), unless this worker is stopping: an evacuation goes past the target's cap, a slower
        stream beating one cut and resumed. A target that is this worker re-tiers the request in
        place (``_retier``)."""
        rid = req.request_id
        rec = self.requests.get(rid)
        if rec is None or not rec.live or rec.task is None:
            raise BusError("not_found", f"{self.worker_id} holds no request {rid!r}")
        if rec.state in (State.MOVING, State.HELD):
            raise BusError("unavailable", f"request {rid} is already moving; retry")
        if req.target_worker == self.worker_id:   # its session's tier changed, its pool did not
            return await self._retier(req, rec)
        await self.kv.peers.check(req.target_data_host, req.target_data_port, req.target_worker, f"the KV of {rid}")
        if any(p.worker == self.worker_id for p in req.ring):   # its blocks here are held until the move ends
            raise BusError("bad_request", f"{self.worker_id} cannot be a member of the ring {rid} spreads onto")
        if req.ring and req.ring[0].worker != req.target_worker:
            raise BusError("bad_request", f"the target {req.target_worker} must be the ring's first member")
        rec.state = State.MOVING
        try:
            return await self._move(req, rec, rec.task)
        finally:   # moved (handed_to says where), aborted meanwhile, or going on here (_stay)
            if rec.state in (State.MOVING, State.HELD):
                rec.state = State.RUNNING if rec.task is not None else State.DONE

    async def _retier(self, req: MigrateRequest, rec: Request) -> MigrateReply:
        """A "move" onto this worker: the request runs at ``req.tier`` from its next step, here
        (its priority in the engine's queue and preemption, its heartbeat's tier)."""
        try:
            await self.engine.set_priority(req.request_id, Tier.parse(req.tier).priority)
        except KeyError:
            raise BusError("not_found", f"request {req.request_id} is no longer in {self.worker_id}'s engine") from None
        rec.tier = req.tier
        log.info("%s runs at tier %s here from now on (%s)", req.request_id, req.tier, req.reason)
        return MigrateReply(request_id=req.request_id, source=self.worker_id, target=self.worker_id, next_seq=0,
                            num_tokens=0, nbytes=0, seconds=0.0, path="in place")

    async def _move(self, req: MigrateRequest, held: Request, task: asyncio.Task) -> MigrateReply:
        rid, target = req.request_id, req.target_worker
        target_role = self.kv.peers.roles.get(target, "unknown")   # metric labels
        started = time.monotonic()
        try:
            blob = await self.engine.export_for_move(rid)
        except KeyError:
            raise BusError("not_found", f"request {rid} is no longer in {self.worker_id}'s engine") from None
        except ValueError as e:
            raise BusError("unavailable", f"{e}: not decoding yet (waiting, prefilling or swapped out); "
                                          "retry") from None
        await asyncio.wait([task])  # the stream publishes every output from before the export, then ends
        next_seq = None if task.cancelled() else task.result()
        if next_seq is None or self.is_aborted(rid, held.attempt):  # aborted (or its stream failed) meanwhile
            await self.engine.end_move(rid, moved=True)
            raise BusError("not_found", f"request {rid} ended while moving")
        tid = f"{rid}-{self.worker_id}-{next_seq}"
        try:
            h, res = await self.kv.hand_off(blob, subject=subjects.worker_decode(target), host=req.target_data_host,
                                            port=req.target_data_port, transfer_id=tid, tier=req.tier,
                                            stream_subject=held.stream_subject, next_seq=next_seq,
                                            session_id=held.session_id or None, attempt=held.attempt,
                                            origin=held.origin, ring=req.ring,
                                            at_cap="run" if self.draining else "refuse")
        except Exception as e:
            metrics.migration(self.role, target_role, "failed")
            if not _refused(e):
                # no answer (a bus outage): the target may have taken it, and two workers must never
                # stream one attempt (their chunks would interleave: a drifted text). It is dropped
                # here; Where points at the target: the gateway finds it there, or resumes it.
                await self.engine.end_move(rid, moved=True)
                self.hand_over(rid, target)
                log.warning("%s: no answer from %s to the move (%s); left to it, or to a resume", rid, target, e)
                raise BusError("timeout", f"moving {rid} to {target}: no answer ({e}); {self.worker_id} "
                                          "dropped it, the gateway finds it or resumes it") from None
            offset = len(KVBlobHeader.parse(blob)[0].output_token_ids)
            if not await self._stay(rid, held, next_seq, offset):  # never lost: it goes on here
                raise BusError("not_found", f"request {rid} was aborted while moving") from None
            code = getattr(e, "code", "unavailable")
            log.warning("%s stays on %s: moving it to %s failed: %s", rid, self.worker_id, target, e)
            raise BusError(code if code in ERROR_STATUS else "unavailable",
                           f"moving {rid} to {target} failed ({e}); it goes on at {self.worker_id}") from None
        await self.engine.end_move(rid, moved=True)
        self.hand_over(rid, target)
        seconds = time.monotonic() - started
        metrics.migration(self.role, target_role, "ok", seconds)
        log.info("%s moved %s -> %s (%s) at seq %d: %d tokens, %d KV bytes over %s in %.1f ms%s", rid,
                 self.worker_id, target, target_role, next_seq, h.num_computed, res.nbytes, res.path,
                 seconds * 1e3, f" ({req.reason})" if req.reason else "")
        return MigrateReply(request_id=rid, source=self.worker_id, target=target, next_seq=next_seq,
                            num_tokens=h.num_computed, nbytes=res.nbytes, seconds=seconds, path=res.path)

    async def _stay(self, rid: str, held: Request, next_seq: int, offset: int) -> bool:
        """A failed move: the parked request decodes on here from ``next_seq`` (``offset`` output
        tokens before it); False if it was aborted meanwhile (then it is dropped)."""
        if self.is_aborted(rid, held.attempt):
            await self.engine.end_move(rid, moved=True)
            return False
        outputs = await self.engine.end_move(rid, moved=False)
        if outputs is None:
            return False
        self.spawn(rid, self.stream_outputs(rid, held.stream_subject, outputs, next_seq, attempt=held.attempt,
                                            offset=offset))
        return True


def _refused(e: Exception) -> bool:
    """A failed hand-off the target certainly did not take: the KV never got there, the target
    answered an error, or nobody listens on its subject (a timeout is none of these)."""
    if isinstance(e, RemoteError) or isinstance(e, TransferError):
        return True
    return isinstance(e, BusError) and e.code == "unavailable"

