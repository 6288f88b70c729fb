"""Prefill worker: computes a prompt's KV, streams the first token, hands the KV to decode.

Life cycle of a request: Accepted (engine took the prompt; ack to the gateway) → Prefilling
(chunked, batched with other prompts; a prefix the KV pool holds is loaded instead of
computed) → Parked (first token sampled and published as seq 0;
the KV waits in this engine) → Transferring (exported to bytes, sent over the data plane to
the decode worker's receiver) → Handed off (the decode worker acked the DecodeRequest and
continues from seq 1) → Written back (the prompt's full chunks the pool lacks are stored,
in the background). A request whose first token already ends it finishes here.
"""

from __future__ import annotations

import logging

from shared import metrics, subjects
from shared.engine.engine import parse_kv_blob
from shared.engine.sampling import RequestOutput
from shared.schemas import DecodeRequest, PrefillRequest, TransferEvent, TransferHandle
from shared.settings import Settings
from shared.transfer import make_transport
from services.kvpool import PoolClient
from services.worker import EngineWorker, priority_of, sampling_from

log = logging.getLogger("tandem.prefill")


class PrefillWorker(EngineWorker):
    role = subjects.PREFILL

    def __init__(self, settings: Settings, device: str):
        super().__init__(settings, device)
        self.transport = make_transport(settings.data)
        self.sender = self.transport.sender()
        self.pool: PoolClient | None = None       # set in register() when the pool is enabled
        self.pool_rx = None                        # receives pool entries (not advertised)

    async def register(self) -> None:
        if self.settings.pool.enabled:
            self.pool_rx = self.transport.receiver(self.settings.data.host, self.settings.data.port)
            host, port = await self.pool_rx.listen()
            self.pool = PoolClient(self.bus, self.settings.pool, self.engine.engine, self.worker_id, self.sender,
                                   self.pool_rx, self.settings.data.advertise_host or host, port)
        await self.bus.serve(subjects.worker_prefill(self.worker_id), self.handle, expected=PrefillRequest)

    async def handle(self, req: PrefillRequest) -> None:
        params = sampling_from(req.sampling)
        prio = req.priority if req.priority is not None else priority_of(req.tier)
        prefix = None
        if self.pool is not None:
            have = await self.engine.cached_prefix_tokens(req.prompt_token_ids)
            prefix = await self.pool.fetch_prefix(req.prompt_token_ids, have)
        outputs = await self.admit(req, self.engine.submit(req.request_id, req.prompt_token_ids, params, prio,
                                                           prefill_only=True, prefix=prefix))

        async def hand_off(first: RequestOutput) -> None:
            await self.hand_off(req, first)

        self.spawn(req.request_id, self.stream_outputs(req.request_id, req.stream_subject, outputs, 0, hand_off))

    async def hand_off(self, req: PrefillRequest, first: RequestOutput) -> None:
        blob = await self.engine.export_kv(req.request_id)
        tid = req.request_id
        res = await self.sender.send(req.decode_data_host, req.decode_data_port, tid, blob)
        metrics.transfer(res.path, res.nbytes, res.seconds)
        await self.bus.publish(subjects.transfer(self.worker_id), TransferEvent(
            transfer_id=tid, request_id=req.request_id, nbytes=res.nbytes, seconds=res.seconds, path=res.path,
            wire_bytes=res.wire_bytes, attempts=res.attempts))
        handle = TransferHandle(transfer_id=tid, host=req.decode_data_host, port=req.decode_data_port,
                                nbytes=res.nbytes, checksum=res.checksum, path=res.path,
                                num_tokens=len(req.prompt_token_ids))
        await self.bus.request(req.decode_subject, DecodeRequest(
            request_id=req.request_id, handle=handle, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(first.token_ids), sampling=req.sampling, tier=req.tier,
            stream_subject=req.stream_subject, next_seq=1, session_id=req.session_id))
        log.info("%s handed to %s: %d KV bytes over %s in %.1f ms", req.request_id, req.decode_worker,
                 res.nbytes, res.path, res.seconds * 1e3)
        if self.pool is not None:  # off the critical path: the decode worker already continues
            h, _, kv = parse_kv_blob(blob)
            self.pool.store_later(h["token_ids"][:h["num_computed"]], kv)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        await super().close()
        if self.pool_rx is not None:
            await self.pool_rx.close()
