"""LMCache on this CPU-only machine: ``LMCacheEngine`` with a Tandem dense-KV connector.

Not a dependency of Tandem (docs/kvpool.md, "LMCache"). Reproduce in an isolated directory:

    pip install --no-deps --target /tmp/lmc/site lmcache==0.5.6   # + the ~20 modules its import needs
    LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 PYTHONHASHSEED=0 PYTHONPATH=/tmp/lmc/site \\
        python -m bench.lmcache_trial store      # store 1,024 tokens, lookup, retrieve (exact?)
    ... python -m bench.lmcache_trial restart    # a new process on the same local_disk directory

Prints store / retrieve seconds, lookup hits and whether the retrieved KV is bit-exact.
"""

from __future__ import annotations

import os
import sys
import time

import torch

L, H, D, CHUNK = 30, 3, 64, 256   # SmolLM2-135M's KV shape, Tandem's pool chunk


def run(phase: str, disk: str = "/tmp/lmc/trial/disk/") -> None:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    class TandemConnector(GPUConnectorInterface):
        """Dense KV of one sequence: ``kvcaches`` = tensor [L, 2, T, H, D] float16."""

        def from_gpu(self, memory_obj, start, end, **kw):
            memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end].reshape(memory_obj.tensor.shape))

        def to_gpu(self, memory_obj, start, end, **kw):
            dst = kw["kvcaches"][:, :, start:end]
            dst.copy_(memory_obj.tensor.reshape(dst.shape))

        def batched_from_gpu(self, memory_objs, starts, ends, **kw):
            for m, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(m, s, e, **kw)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kw):
            for m, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(m, s, e, **kw)

        def get_shape(self, num_tokens):
            return torch.Size([L, 2, num_tokens, H, D])

    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=1.0,
                                            local_disk=f"file://{disk}", max_local_disk_size=1.0)
    meta = LMCacheMetadata(model_name="smollm2", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float16, kv_shape=(L, 2, CHUNK, H, D))
    engine = LMCacheEngineBuilder.get_or_create("tandem", cfg, meta, TandemConnector(), None, None)
    engine.post_init()
    try:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 40000, (1024,), generator=g)
        kv = torch.randn(L, 2, 1024, H, D, generator=g).half()
        if phase == "store":
            t0 = time.perf_counter()
            engine.store(tokens, kvcaches=kv)
            print(f"store {time.perf_counter() - t0:.3f}s")
            time.sleep(2)
        print(f"lookup: {engine.lookup(tokens)} of 1024 tokens")
        out = torch.zeros_like(kv)
        t0 = time.perf_counter()
        n = int(engine.retrieve(tokens, kvcaches=out).sum())
        print(f"retrieve {time.perf_counter() - t0:.3f}s: {n} tokens, exact {torch.equal(out[:, :, :n], kv[:, :, :n])}")
    finally:
        LMCacheEngineBuilder.destroy("tandem")  # the process hangs at exit otherwise


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "store")
