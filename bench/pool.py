"""``tandem bench pool``: the KV pool and the data plane, side by side in one run.

- TTFT cold vs warm: a prompt with a shared prefix (``--prefix`` tokens, default 2,048) computed
  from scratch, then with the prefix loaded from a pool (RAM or disk tier: get, verify, decode,
  load) — the ratio is the figure (target >= 5x);
- codecs on the model's real KV: ratio, encode / decode MB/s, and for the lossy codec the
  perplexity of the tokens after the prefix with the decoded KV vs the exact KV;
- the tiers (``--tiers-only``: just these): put / get MB/s of the directory tier and, with
  ``--redis-url`` (default ``$TANDEM_POOL_REDIS_URL``), the Redis tier — the prefix's entries put
  into a fresh store, then read back by a new pool on the same store (a restarted service:
  index rebuilt, page cache warm), best of 3 — and the warm TTFT with the prefix loaded from each;
- pool lookups/s;
- transfers per path (tcp, tcp+zstd, shm, and rdma where ``nixl`` imports; frames tagged with a data-plane
  key as deployed, and plain tcp once more without one: the authentication's cost), each warmed up and timed
  alternating with a raw-socket transfer, against a raw memcpy
  and a raw socket of the same bytes, GB/s, with the process CPU seconds each took (sender and
  receiver share the process), the wire checksum on one thread, and the raw socket hashing every 1 MiB slice
  on both ends (the ceiling for a path that checksums every byte).
  ``--transfers-only`` runs just these (seconds instead of minutes).
- ``--finish``: only the engine thread's time to copy a finished turn's KV out for the
  write-back, per context (``--finish-contexts``, default 2,048 and 8,000 tokens reused from the
  prefix cache, then 64 new ones and 8 generated): the whole context (what it copied before) and
  what the turn added (the whole pool chunks it reused left out), alternately, medians. Every
  other sequence on the worker waits that long. Seconds.
- ``--restart``: the whole stack instead (``bench_restart``): per prompt length (``--stack-prompts``,
  default 2,112 and 8,000 tokens: 64 tokens after the last whole chunk), the stack's cold TTFT
  (a colocated cpu-decode worker with all ``--threads``, a KV pool on a fresh directory) beside
  llama.cpp's in-process prefill of as many tokens on as many threads, then — the stack stopped
  with SIGTERM right after the reply, a new one started on the same pool directory — the warm
  TTFT with the prefix read from the pool's disk tier (``--warm-runs`` restarts, the median; a
  single first request after a start moves by tens of ms on a shared 2-core machine) — and with
  ``--redis-url`` the same again on the Redis tier alone (no disk tier). Only these rows; minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvpool.codec import LOSSLESS, LOSSY, ChunkShape, Codec, decode_entry
from kvpool.keys import KeyScope, chunk_keys
from kvpool.pool import KVPool, PoolConfig
from shared.transfer.base import Hasher, default_checksum
from bench.cli import at_least

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens (default 2048)")
    p.add_argument("--suffix", type=int, default=64, help="tokens after the prefix (default 64)")
    p.add_argument("--threads", type=at_least(1), default=None, help="engine threads (default: torch's)")
    p.add_argument("--transfer-mb", type=int, default=64, help="payload per transfer, MiB (default 64)")
    p.add_argument("--transfers-only", action="store_true", help="only the data-plane transfers")
    p.add_argument("--tiers-only", action="store_true", help="only the tier rows: TTFT cold vs warm from each "
                   "tier, put / get MB/s of the directory and Redis tiers (lossless codec)")
    p.add_argument("--redis-url", default=os.environ.get("TANDEM_POOL_REDIS_URL"),
                   help="also measure a Redis tier there (default $TANDEM_POOL_REDIS_URL; unset: no Redis rows)")
    p.add_argument("--restart", action="store_true", help="only the stack rows: cold TTFT vs llama.cpp prefill, "
                   "warm TTFT after a full restart (prefix on the pool's disk tier)")
    p.add_argument("--stack-prompts", type=int, nargs="+", default=[2112, 8000],
                   help="--restart: prompt lengths, tokens (default 2112 8000)")
    p.add_argument("--warm-runs", type=int, default=3,
                   help="--restart: full restarts measured warm per prompt and tier, the median reported (default 3)")
    p.add_argument("--finish", action="store_true", help="only the rows of a finished turn's KV copied out "
                   "for the write-back: whole context vs what the turn added")
    p.add_argument("--finish-contexts", type=int, nargs="+", default=[2048, 8000],
                   help="--finish: reused context lengths (default 2048 8000)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")


TRANSFER_REPS = 5   # memcpy / raw socket rows: best of this many (loopback on a shared machine is noisy)
TRANSFER_PAIRS = 15  # per path: transfers each right after a raw-socket one; the ratio is the pairs' median
TRANSFER_WARMUP = 3  # untimed transfers per path first (a service's data plane is long-lived)


def _best(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_ttft_and_codecs(args) -> list[dict]:
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.sampling import SamplingParams
    engine = Engine.from_path(None, EngineConfig(threads=args.threads, kv_cache_bytes=512 << 20))
    ids = _text_tokens(engine.tokenizer, args.prefix + args.suffix)
    layout = engine.layout.to_dict()
    rows = []

    def first_token(prefix=None) -> float:
        engine.blocks = type(engine.blocks)(engine.blocks.num_blocks, engine.blocks.block_size)  # cold cache
        engine.scheduler.blocks = engine.blocks
        t0 = time.perf_counter()
        if prefix is not None:
            toks, kv = prefix()
            engine.load_prefix(toks, kv)
        engine.add("r", ids, SamplingParams(max_tokens=1, temperature=0))
        while True:
            if any(o.finished for o in engine.step()):
                return time.perf_counter() - t0

    # the exact KV of the prefix, as the pool would hold it
    engine.prompt_logits(ids[:args.prefix])
    kv = engine.read_blocks(list(range(args.prefix // engine.layout.block_size)))
    shape = ChunkShape.from_layout(layout)
    chunk = 256 * engine.layout.token_bytes
    cold = min(first_token() for _ in range(2))
    for name in (LOSSLESS,) if args.tiers_only else (LOSSLESS, LOSSY):
        codec = Codec(name)
        scope = KeyScope(engine.model_identity, layout, 256, tenant=name)
        keys = chunk_keys(scope, ids[:args.prefix])
        t_enc = _best(lambda: [codec.encode(k, kv[i * chunk:(i + 1) * chunk], shape) for i, k in enumerate(keys)], 2)
        entries = [codec.encode(k, kv[i * chunk:(i + 1) * chunk], shape) for i, k in enumerate(keys)]
        t_dec = _best(lambda: [decode_entry(e) for e in entries], 2)
        size = sum(len(e) for e in entries)
        if not args.tiers_only:
            row = {"bench": "codec", "codec": name, "ratio": len(kv) / size,
                   "encode_MBps": len(kv) / t_enc / 1e6, "decode_MBps": len(kv) / t_dec / 1e6}
            decoded = b"".join(decode_entry(e) for e in entries)
            tail = engine.prompt_logits(ids, prefix_kv=decoded).float()
            targets = torch.tensor(ids[args.prefix + 1:])
            row["ppl_after_prefix"] = float(torch.exp(torch.nn.functional.cross_entropy(tail[:-1], targets)))
            rows.append(row)
        for tier, cfg in _tier_configs(args, lossless=name == LOSSLESS):
            with cfg as cfg:
                pool = KVPool.from_config(cfg)
                t_put = _timed(lambda: [pool.put(k, e) for k, e in zip(keys, entries)])
                if tier != "ram":   # a new pool on the same store (a restarted service): reads, best of 3
                    pool = KVPool.from_config(cfg)
                    t_get = _best(lambda: [pool.get(k) for k in keys])
                    rows.append({"bench": "tier", "tier": tier, "entries": len(keys), "MB": size / 1e6,
                                 "put_MBps": size / t_put / 1e6, "get_MBps": size / t_get / 1e6})

                def load(pool=pool, keys=keys):
                    return ids[:len(keys) * 256], bytearray(b"".join(decode_entry(pool.get(k), k) for k in keys))

                warm = min(first_token(load) for _ in range(3))
                rows.append({"bench": "ttft", "codec": name, "tier": tier, "prefix": args.prefix,
                             "suffix": args.suffix, "cold_s": cold, "warm_s": warm, "speedup": cold / warm})
                if name == LOSSLESS and tier == "ram" and not args.tiers_only:
                    n = 20000
                    t = _best(lambda: [pool.lookup(keys) for _ in range(n // len(keys))], 1)
                    rows.append({"bench": "lookup", "keys_per_s": n / t, "lookups_per_s": n / len(keys) / t})
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _dir_config():
    with tempfile.TemporaryDirectory() as d:
        yield PoolConfig(ram_bytes=0, disk_dir=d)


@contextlib.contextmanager
def _redis_config(url: str):
    """A Redis tier under a prefix of its own, deleted after."""
    import redis
    cfg = PoolConfig(ram_bytes=0, redis_url=url, redis_prefix=f"tandem-bench:{os.getpid()}:{time.time_ns()}:")
    try:
        yield cfg
    finally:
        client = redis.Redis.from_url(url)
        names = list(client.scan_iter(match=cfg.redis_prefix + "*"))
        if names:
            client.delete(*names)
        client.close()


def _tier_configs(args, lossless: bool):
    """(tier, context manager of its PoolConfig) for the TTFT rows: RAM; with the lossless codec the
    directory tier and, with --redis-url, Redis."""
    out = [("ram", contextlib.nullcontext(PoolConfig(ram_bytes=1 << 30)))]
    if lossless:
        out.append(("disk", _dir_config()))
        if args.redis_url:
            out.append(("redis", _redis_config(args.redis_url)))
    return out


def _text_tokens(tokenizer, n: int) -> list[int]:
    """``n`` tokens of natural English (this repository's own docs) — perplexity needs real text."""
    root = Path(__file__).resolve().parent.parent
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"the docs hold {len(ids)} tokens, {n} are needed (lower --prefix / --suffix)")
    return ids[:n]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _transfers(nbytes: int) -> list[dict]:
    """Each path against a raw memcpy and a raw socket of the same bytes: GB/s is the path's best
    of TRANSFER_PAIRS, ``vs_raw_socket`` the median over those pairs of (raw socket time / path
    time) with each raw-socket transfer run right before the path's — a ratio a noisy machine
    shifts far less than a ratio of two bests (``best_vs_best_raw``, also kept).

    The receiver runs on its own event loop in a second thread — as in a deployment, where it
    is another process — like the raw socket's receiving thread.
    """

    from shared.transfer import TcpKVReceiver, TcpKVSender, nixl
    payload = np.random.default_rng(1).normal(0, 1, nbytes // 2).astype(np.float16).tobytes()
    rows = []
    dst = bytearray(nbytes)
    t = _best(lambda: memoryview(dst).__setitem__(slice(None), payload))  # one memcpy
    rows.append({"bench": "transfer", "path": "memcpy", "GBps": nbytes / t / 1e9})
    c0 = _cpu()
    raw_buf = bytearray(payload)  # written once: its pages exist, as a pooled receive buffer's do
    raw = _raw_socket(payload, buf=raw_buf)
    rows.append({"bench": "transfer", "path": "raw socket", "GBps": nbytes / raw / 1e9, "cpu_s": (_cpu() - c0) / 3})
    algo = default_checksum()   # what the data plane hashes with
    t = _best(lambda: _hash(algo, payload))
    rows.append({"bench": "transfer", "path": f"{algo} (1 thread)", "GBps": nbytes / t / 1e9})
    rows.append({"bench": "transfer", "path": f"raw socket + {algo}",
                 "GBps": nbytes / _raw_socket(payload, buf=raw_buf, algo=algo) / 1e9})
    rx_loop = asyncio.new_event_loop()
    rx_thread = threading.Thread(target=rx_loop.run_forever, name="bench-receiver", daemon=True)
    rx_thread.start()

    def on_rx(coro):
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, rx_loop))

    async def take(rx, tid: str) -> int:
        with await rx.take(tid, 60) as got:
            return got.nbytes

    key = os.urandom(32)   # as deployed: every frame tagged with the data-plane key (TANDEM_DATA_KEY)
    rx = TcpKVReceiver("127.0.0.1", 0, max_bytes=4 * nbytes, key=key)
    tx = TcpKVSender(key=key)
    open_rx = TcpKVReceiver("127.0.0.1", 0, max_bytes=4 * nbytes)   # the same without a key, for comparison
    open_tx = TcpKVSender()
    paths = [(mode, mode, tx, rx) for mode in ("tcp", "tcp+zstd", "shm") + (("rdma",) if nixl.available() else ())]
    paths.append(("tcp (no data key)", "tcp", open_tx, open_rx))
    try:
        await on_rx(open_rx.listen())
        await on_rx(rx.listen())
        for name, mode, tx_, rx_ in paths:
            host, port = rx_.address
            for i in range(TRANSFER_WARMUP):  # steady state: the receiver's buffers and I/O threads exist
                await asyncio.gather(tx_.send(host, port, f"{name}-warm-{i}", payload, mode=mode),
                                     on_rx(take(rx_, f"{name}-warm-{i}")))
            best, cpu, wire, raw_best, ratios = float("inf"), 0.0, 0, float("inf"), []
            for i in range(TRANSFER_PAIRS):  # alternating with the raw socket: drift hits both alike
                raw_t = _raw_socket(payload, reps=1, buf=raw_buf)
                raw_best = min(raw_best, raw_t)
                tid = f"{name}-{i}"
                c0, t0 = _cpu(), time.perf_counter()
                res, _ = await asyncio.gather(tx_.send(host, port, tid, payload, mode=mode), on_rx(take(rx_, tid)))
                dt = time.perf_counter() - t0
                ratios.append(raw_t / dt)
                if dt < best:
                    best, cpu, wire = dt, _cpu() - c0, res.wire_bytes
            rows.append({"bench": "transfer", "path": name, "GBps": nbytes / best / 1e9, "cpu_s": cpu,
                         "wire_ratio": nbytes / wire, "raw_GBps_alongside": nbytes / raw_best / 1e9,
                         "vs_raw_socket": float(np.median(ratios)), "best_vs_best_raw": raw_best / best})
    finally:
        await tx.close()
        await open_tx.close()
        await on_rx(rx.close())
        await on_rx(open_rx.close())
        rx_loop.call_soon_threadsafe(rx_loop.stop)
        rx_thread.join()
        rx_loop.close()
    raw = next(r["GBps"] for r in rows if r["path"] == "raw socket")
    for r in rows:
        r.setdefault("vs_raw_socket", r["GBps"] / raw)  # paths: against the raw runs alongside them
    return rows


def _raw_socket(payload: bytes, reps: int = TRANSFER_REPS, buf: bytearray | None = None,
                algo: str | None = None, segment: int = MiB) -> float:
    """Best of ``reps``: blocking sendall / recv_into over loopback, no framing, into ``buf``
    (pass one already written to: no page faults, like the paths' pooled buffers). With
    ``algo``: in ``segment`` slices, each hashed just before it is sent and just after it lands —
    the ceiling for any path that checksums every byte on both ends, with no framing, pools or
    event loop."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    buf = bytearray(payload) if buf is None else buf
    n, src = len(payload), memoryview(payload)
    seg = segment if algo else n
    digests = []

    def serve():
        for _ in range(reps):
            c, _ = srv.accept()
            view, got, hashed, h = memoryview(buf), 0, 0, Hasher(algo) if algo else None
            while got < n:
                got += c.recv_into(view[got:min(got + seg, n)])
                if h is not None and (got - hashed >= seg or got == n):
                    h.update(view[hashed:got])
                    hashed = got
            if h is not None:
                digests.append(h.digest())
            c.sendall(b"k")
            c.close()

    th = threading.Thread(target=serve)
    th.start()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        h = Hasher(algo) if algo else None
        with socket.create_connection(("127.0.0.1", port)) as s:
            for off in range(0, n, seg):
                if h is not None:
                    h.update(src[off:off + seg])
                s.sendall(src[off:off + seg])
            s.recv(1)
        best = min(best, time.perf_counter() - t0)
        if h is not None:
            digests.append(h.digest())
    th.join()
    srv.close()
    assert len(set(digests)) <= 1, f"raw socket + {algo}: digests differ"
    return best


def _hash(algo: str, data) -> bytes:
    h = Hasher(algo)
    h.update(data)
    return h.digest()




def _print(rows: list[dict]) -> list[dict]:
    for r in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    return rows


RESTART_STACK = ["--prefill", "0", "--gpu-decode", "0", "--cpu-decode", "1"]  # one colocated worker + pool
RESTART_TARGETS = {2112: 20.0, 8000: 50.0}  # issue 20: warm after a restart vs cold, at 2K and 8K


def _stack_ttft(prompt: list[int], pool_env: dict, threads: int) -> tuple[float, int]:
    """A fresh stack on the pool tiers ``pool_env`` names: (TTFT, cached prompt tokens) of
    ``prompt``, streamed; the stack gets SIGTERM as soon as the reply is complete. The warm
    path's stage timings (the worker's log lines) go to stderr."""
    import openai

    from bench.serve import Server, bench_env
    from shared.nats_server import free_port

    port = free_port()
    env = dict(bench_env(threads), TANDEM_PORT=str(port), TANDEM_KV_BUDGET_MB="512", **pool_env)
    server = Server("stack", [sys.executable, "-m", "services.cli", "up", *RESTART_STACK], env, port)
    try:
        server.wait_workers({"cpu-decode": 1, "router": 1})
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="bench", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        t0, first, cached = time.perf_counter(), None, -1
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                               stream_options={"include_usage": True}):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
            if chunk.usage:
                cached = chunk.usage.prompt_tokens_details.cached_tokens if chunk.usage.prompt_tokens_details else 0
    finally:
        rc = server.stop()
    if first is None or rc != 0:
        raise RuntimeError(f"stack run failed (exit {rc}):\n{server.tail()}")
    sys.stderr.writelines(line for line in server.log if "prefix tokens (" in line or "KV blocks in" in line)
    return first, cached


@contextlib.contextmanager
def _stack_pools(args):
    """(tier, the stack's pool environment, entries()) per tier the restart rows use: the disk tier;
    with --redis-url, the Redis tier alone (no disk tier), under a prefix of its own."""
    with tempfile.TemporaryDirectory() as d, _redis_config(args.redis_url) if args.redis_url else \
            contextlib.nullcontext() as rcfg:
        out = [("disk", {"TANDEM_POOL_DIR": d}, lambda: sum(f.endswith(".kvp") for _, _, fs in os.walk(d) for f in fs))]
        if rcfg is not None:
            import redis
            client = redis.Redis.from_url(args.redis_url)
            out.append(("redis", {"TANDEM_POOL_DIR": "", "TANDEM_POOL_REDIS_URL": args.redis_url,
                                  "TANDEM_POOL_REDIS_PREFIX": rcfg.redis_prefix},
                        lambda: sum(1 for _ in client.scan_iter(match=rcfg.redis_prefix + "*"))))
        yield out


def bench_restart(args) -> list[dict]:
    """Per prompt length: stack cold TTFT vs llama.cpp in-process prefill; warm TTFT after a full
    restart with the prefix on the pool's disk tier (and, with --redis-url, on its Redis tier alone)."""
    from bench import llamacpp
    from bench.kernels import q4_0_gguf
    from shared.engine.model_files import load_tokenizer

    threads = args.threads or os.cpu_count() or 1
    tokenizer, _ = load_tokenizer(None)
    rows = []
    for n in args.stack_prompts:
        ids = _text_tokens(tokenizer, n)
        pp = llamacpp.run(q4_0_gguf(None), threads, 2, 1, n, 1, 8, 1)["pp"]
        llama = n / pp
        with _stack_pools(args) as pools:
            for tier, env, entries in pools:
                cold, cached_cold = _stack_ttft(ids, env, threads)
                stored = entries()
                warms = [_stack_ttft(ids, env, threads) for _ in range(max(1, args.warm_runs))]
                warm, cached_warm = statistics.median(w for w, _ in warms), min(c for _, c in warms)
                rows.append({"bench": "restart", "tier": tier, "prompt": n, "threads": threads, "stack_cold_s": cold,
                             "llama_cpp_prefill_s": llama, "vs_llama_cpp": llama / cold, "entries": stored,
                             "cached_warm": cached_warm, "warm_after_restart_s": warm,
                             "warm_runs_s": " ".join(f"{w:.3f}" for w, _ in warms), "cold_over_warm": cold / warm,
                             "target": RESTART_TARGETS.get(n, float("nan"))})
                if cached_cold or cached_warm < (n - 1) // 256 * 256:
                    raise RuntimeError(f"{n} tokens, {tier} tier: cached {cached_cold} cold / {cached_warm} warm: "
                                       "not a pool restart run")
    return rows


def bench_finish(args) -> list[dict]:
    """``--finish``: the engine thread's time in ``_report_finished_kv`` (the copy the write-back
    gets) for a turn that reused ``--finish-contexts`` tokens, the whole context copied (skip 0:
    what it copied before 2026-11-29, less a second copy into bytes) and only what the turn added
    (skip = a pool chunk), in turn, 5 times each."""
    from shared.engine.engine import Engine, EngineConfig, run_to_completion
    from shared.engine.sampling import SamplingParams
    chunk = 256
    engine = Engine.from_path(None, EngineConfig(threads=args.threads, kv_cache_bytes=(max(args.finish_contexts)
                                                                                       + 512) * 24 * 1024))
    bs, rows = engine.layout.block_size, []
    times, copied = [], []
    orig = engine._report_finished_kv

    def timed(seq) -> None:
        t0 = time.perf_counter()
        orig(seq)
        times.append(time.perf_counter() - t0)
    engine._report_finished_kv = timed
    engine.finished_kv_align = 1
    engine.finished_kv_hook = lambda rid, toks, kv, tenant, n, ret, start: copied.append(memoryview(kv).nbytes)
    for ctx in args.finish_contexts:
        ctx = ctx // chunk * chunk
        ids = _text_tokens(engine.tokenizer, ctx + 64)
        engine.load_prefix(ids[:ctx], bytes(ctx // bs * engine.layout.block_bytes))  # the reused context
        got: dict[int, list[tuple[float, int]]] = {0: [], chunk: []}
        for i in range(10):
            skip = (0, chunk)[i % 2]
            engine.finished_kv_skip = skip
            out = run_to_completion(engine, {f"f{ctx}-{i}": (ids, SamplingParams(max_tokens=8, temperature=0))})
            assert next(iter(out.values())).num_cached_tokens >= ctx, "the context was not reused"
            got[skip].append((times.pop(), copied.pop()))
        whole, added = (statistics.median(t for t, _ in got[k]) for k in (0, chunk))
        rows.append({"bench": "finish-copy", "context": ctx, "whole_mb": got[0][0][1] / 1e6, "whole_ms": whole * 1e3,
                     "added_mb": got[chunk][0][1] / 1e6, "added_ms": added * 1e3, "ratio": whole / added})
    return rows


def main(args: argparse.Namespace) -> int:
    if args.finish:
        rows = _print(bench_finish(args))
    elif args.restart:
        rows = _print(bench_restart(args))
    else:
        rows = [] if args.tiers_only else _print(asyncio.run(_transfers(args.transfer_mb * MiB)))
        if not args.transfers_only:
            rows += _print(bench_ttft_and_codecs(args))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0
