"""Prefill worker: computes a prompt's KV, streams the first token, hands the KV to decode.

Life cycle of a request: Accepted (engine took the prompt; ack to the gateway) → Prefilling
(chunked, batched with other prompts; a prefix the KV pool holds is loaded instead of
computed) → Parked (first token sampled and published as seq 0;
the KV waits in this engine) → Transferring (exported to bytes, sent over the data plane to
the decode worker's receiver; a ring plan's other members get their ranges from here, all at
once, parked for the coordinator to claim: docs/strategies.md) → Handed off (the decode worker acked the DecodeRequest and
continues from seq 1) → Written back (the prompt's full chunks the pool lacks are stored,
in the background). A request whose first token already ends it finishes here.
"""

from __future__ import annotations

import logging
import time

from shared import subjects
from shared.bus import BusError, RemoteError
from shared.engine.kv_cache import KVBlobHeader
from shared.engine.sampling import RequestOutput
from shared.kv_connector import prompt_tail_end
from shared.ring import RING_ERRORS, RingCapacityError, RingConnector, RingMemberLost
from shared.schemas import PrefillRequest
from shared.transfer import Discarded, TransferError
from services.worker import Aborted, EngineWorker, priority_of, sampling_from

log = logging.getLogger("tandem.prefill")


def dropped_in_hand_off(e: Exception) -> bool:
    """The decode worker dropped the hand-off on purpose: the request was aborted there (its client
    left, or a resume replaced this attempt) while its KV was on the way — the receiver discarded
    the bytes, or its worker answered the DecodeRequest ``not_found``. Not a failure: nobody waits."""
    return isinstance(e, Discarded) or (isinstance(e, RemoteError) and e.code == "not_found")


def lost_in_hand_off(e: Exception, decode_worker: str) -> str:
    """The worker a failed hand-off found gone (``ErrorReply.lost``: the gateway routes the resume
    without it): a ring member that stopped answering (the error names it), or the decode worker
    when it was not reached (its data plane refused or broke the connection; no responder or no
    answer on its decode subject). "" when the decode worker answered with an error: it is there."""
    if isinstance(e, RingMemberLost):
        return e.lost
    if isinstance(e, TransferError) or (isinstance(e, BusError) and not isinstance(e, RemoteError)):
        return decode_worker
    return ""


class PrefillWorker(EngineWorker):
    role = subjects.PREFILL

    async def register(self) -> None:
        self.ring = RingConnector(self.worker_id, self.settings.data, self.kv.peers, self.engine)
        await self.bus.serve(subjects.worker_prefill(self.worker_id), self.handle, expected=PrefillRequest)

    async def handle(self, req: PrefillRequest) -> None:
        self.refuse_if_draining("not_found", f"request {req.request_id}")
        params = sampling_from(req.sampling)
        # the KV goes to the decode worker's data plane only (a forbidden error before any work otherwise)
        await self.kv.peers.check(req.decode_data_host, req.decode_data_port, req.decode_worker,
                                  f"the KV of {req.request_id}")
        prio = req.priority if req.priority is not None else priority_of(req.tier)
        resume = req.resume
        outputs_so_far = resume.output_token_ids if resume else []
        prefix = await self.kv.fetch_prefix(req.prompt_token_ids + outputs_so_far, req.tenant)
        attempt = resume.attempt if resume else 0
        outputs = await self.admit(req, self.engine.submit(
            req.request_id, req.prompt_token_ids, params, prio, prefill_only=True, prefix=prefix,
            resume_token_ids=outputs_so_far, emitted_chars=resume.emitted_chars if resume else 0,
            tenant=req.tenant), attempt)
        first_seq = resume.next_seq if resume else 0

        async def hand_off(first: RequestOutput) -> None:
            await self.hand_off(req, first_seq + 1, attempt)

        self.spawn(req.request_id, self.stream_outputs(req.request_id, req.stream_subject, outputs, first_seq,
                                                       hand_off, attempt, offset=len(outputs_so_far)))

    async def hand_off(self, req: PrefillRequest, next_seq: int, attempt: int) -> None:
        t0 = time.monotonic()
        # the prompt's chunks and tail go to the pool whatever happens next: a retry, a resume or the
        # same prompt again finds them (and the receiver's write-back leaves them out)
        blob = await self.engine.export_kv(req.request_id, written_back=self.kv.pool is not None)
        exported = time.monotonic()
        h, kv = KVBlobHeader.parse(blob)
        self.kv.store_later(h.token_ids[:h.num_computed], kv, h.tenant,
                            prompt_tail_end(h.num_prompt_tokens))
        claim, scatter = None, None
        try:
            if req.ring and self.settings.data.ring_prefill_scatter:   # the other members' ranges from here
                blob, claim, scatter = await self.ring.scatter(req.ring, req.decode_worker, h, kv,
                                                               f"{req.request_id}#{attempt}")
            sent = time.monotonic()
            _, res = await self.kv.hand_off(blob, subject=req.decode_subject, host=req.decode_data_host,
                                            port=req.decode_data_port, transfer_id=f"{req.request_id}-{attempt}",
                                            tier=req.tier, stream_subject=req.stream_subject, next_seq=next_seq,
                                            session_id=req.session_id, attempt=attempt, origin=req.origin,
                                            ring=req.ring, claim=claim, alongside=scatter)
        except (TransferError, BusError, *RING_ERRORS) as e:
            if dropped_in_hand_off(e) or self.is_aborted(req.request_id, attempt):
                raise Aborted(f"{req.request_id} aborted during its hand-off to {req.decode_worker} ({e})") from None
            if getattr(e, "code", "") == "overloaded" or isinstance(e, RingCapacityError):
                # a ring member (or the decode worker) had no room for it: nobody is lost, the gateway
                # routes it again once there is room (two choices of one request planned onto one ring)
                # (a decode worker that is stopping refuses so too, naming itself: routed without it)
                raise BusError("overloaded", f"hand-off to {req.decode_worker} refused: {e}",
                               retry_after=1.0, sender_ok=True, lost=getattr(e, "lost", "")) from None
            # the gateway resumes the request (a ring's members keep nothing): without the worker it
            # did not reach (ErrorReply.lost), or — a live peer refused it — with every worker
            lost = lost_in_hand_off(e, req.decode_worker)
            raise BusError("unavailable", f"hand-off to {req.decode_worker} failed: {e}", lost=lost,
                           sender_ok=not lost) from None
        self.hand_over(req.request_id, req.decode_worker)
        done = time.monotonic()
        scattered = ""
        if scatter is not None:
            links, seconds = scatter.result()
            scattered = (f"; ring of {len(req.ring)} (links {links}), ranges {claim.ranges}: the other members' "
                         f"ranges scattered and parked in {seconds * 1e3:.0f} ms, alongside the send")
        log.info("%s handed to %s: %d KV bytes over %s in %.1f ms%s; hand-off %.1f ms (export %.1f ms, then to "
                 "the decode worker's ack %.1f ms)", req.request_id, req.decode_worker, res.nbytes, res.path,
                 res.seconds * 1e3, scattered, (done - t0) * 1e3, (exported - t0) * 1e3, (done - sent) * 1e3)
