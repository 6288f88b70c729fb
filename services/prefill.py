"""Prefill worker: computes a prompt's KV, streams the first token, hands the KV to decode.

Life cycle of a request: Accepted (engine took the prompt; ack to the gateway) → Prefilling
(chunked, batched with other prompts) → Parked (first token sampled and published as seq 0;
the KV waits in this engine) → Transferring (exported to bytes, sent over the data plane to
the decode worker's receiver) → Handed off (the decode worker acked the DecodeRequest and
continues from seq 1). A request whose first token already ends it finishes here.
"""

from __future__ import annotations

import logging

from shared import subjects
from shared.engine.sampling import RequestOutput
from shared.schemas import DecodeRequest, PrefillRequest, TransferEvent, TransferHandle
from shared.settings import Settings
from shared.transfer.tcp import TcpTransport
from services.worker import EngineWorker, priority_of, sampling_from

log = logging.getLogger("tandem.prefill")


class PrefillWorker(EngineWorker):
    role = subjects.PREFILL

    def __init__(self, settings: Settings, device: str):
        super().__init__(settings, device)
        self.sender = TcpTransport.from_settings(settings.data).sender()

    async def register(self) -> None:
        await self.bus.serve(subjects.worker_prefill(self.worker_id), self.handle, expected=PrefillRequest)

    async def handle(self, req: PrefillRequest) -> None:
        params = sampling_from(req.sampling)
        prio = req.priority if req.priority is not None else priority_of(req.tier)
        outputs = await self.admit(self.engine.submit(req.request_id, req.prompt_token_ids, params, prio,
                                                      prefill_only=True))

        async def hand_off(first: RequestOutput) -> None:
            await self.hand_off(req, first)

        self.spawn(req.request_id, self.stream_outputs(req.request_id, req.stream_subject, outputs, 0, hand_off))

    async def hand_off(self, req: PrefillRequest, first: RequestOutput) -> None:
        blob = await self.engine.export_kv(req.request_id)
        tid = req.request_id
        res = await self.sender.send(req.decode_data_host, req.decode_data_port, tid, blob)
        await self.bus.publish(subjects.transfer(self.worker_id), TransferEvent(
            transfer_id=tid, request_id=req.request_id, nbytes=res.nbytes, seconds=res.seconds, path=res.path))
        handle = TransferHandle(transfer_id=tid, host=req.decode_data_host, port=req.decode_data_port,
                                nbytes=res.nbytes, checksum=res.checksum, path=res.path,
                                num_tokens=len(req.prompt_token_ids))
        await self.bus.request(req.decode_subject, DecodeRequest(
            request_id=req.request_id, handle=handle, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(first.token_ids), sampling=req.sampling, tier=req.tier,
            stream_subject=req.stream_subject, next_seq=1, session_id=req.session_id))
        log.info("%s handed to %s: %d KV bytes in %.1f ms", req.request_id, req.decode_worker,
                 res.nbytes, res.seconds * 1e3)
