"""Decode workers: continuous-batching decode on CUDA (gpu-decode) or CPU (cpu-decode).

Both run the same engine and the same code; only the device differs. A decode worker takes
requests two ways:
- DecodeRequest: the KV of a prefilled prompt arrives over the data plane (Receiving →
  Importing → Decoding, streaming from ``next_seq``);
- GenerateRequest: the worker runs the prompt itself (the router chose no separate prefill).
A finished session's KV (its full pool chunks) is written back to the KV pool in the
background, so the session's next turn can start on any worker.
When no CUDA device exists, gpu-decode says so in its log and runs on the CPU, so the whole
topology runs on any machine.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from shared import subjects
from shared.schemas import DecodeRequest, GenerateRequest
from shared.settings import Settings
from shared.transfer import make_transport
from services.kvpool import PoolClient
from services.worker import EngineWorker, priority_of, sampling_from

log = logging.getLogger("tandem.decode")


class DecodeWorker(EngineWorker):
    def __init__(self, settings: Settings, role: str):
        self.role = role
        device = settings.worker.device or ("cuda" if role == subjects.GPU_DECODE else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("%s: no CUDA device visible to torch; running on the CPU instead", role)
            device = "cpu"
        super().__init__(settings, device)
        self.transport = make_transport(settings.data)
        self.receiver = self.transport.receiver(settings.data.host, settings.data.port)
        self.pool: PoolClient | None = None   # set in register() when the pool is enabled

    async def register(self) -> None:
        host, port = await self.receiver.listen()
        self.data_host = self.settings.data.advertise_host or host
        self.data_port = port
        if self.settings.pool.enabled:
            self.pool = PoolClient(self.bus, self.settings.pool, self.engine.engine, self.worker_id,
                                   self.transport.sender(), self.receiver, self.data_host, port)
            loop = asyncio.get_running_loop()
            self.engine.engine.finished_kv_align = self.settings.pool.chunk_tokens
            self.engine.engine.finished_kv_hook = lambda rid, tokens, kv: loop.call_soon_threadsafe(
                self.pool.store_later, tokens, kv)  # called on the engine thread
        await self.bus.serve(subjects.worker_decode(self.worker_id), self.handle_decode, expected=DecodeRequest)
        await self.bus.serve(subjects.worker_generate(self.worker_id), self.handle_generate,
                             expected=GenerateRequest)

    async def handle_decode(self, req: DecodeRequest) -> None:
        payload = await self.receiver.take(req.handle.transfer_id, timeout=self.settings.data.timeout)
        try:
            blob = bytes(payload.data)  # the engine copies it into its KV cache; the buffer goes back
        finally:
            payload.release()
        outputs = await self.admit(req, self.engine.submit_kv(req.request_id, blob, priority_of(req.tier)))
        self.spawn(req.request_id, self.stream_outputs(req.request_id, req.stream_subject, outputs, req.next_seq))

    async def handle_generate(self, req: GenerateRequest) -> None:
        params = sampling_from(req.sampling)
        outputs = await self.admit(req, self.engine.submit(req.request_id, req.prompt_token_ids, params,
                                                      priority_of(req.tier)))
        self.spawn(req.request_id, self.stream_outputs(req.request_id, req.stream_subject, outputs, 0))

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        await super().close()
        await self.receiver.close()
