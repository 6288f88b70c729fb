"""``tandem bench migration``: moving a decoding request's KV vs recomputing it.

Per context length and run: a request is prefilled up to its first token (prefix cache off:
that is the recompute figure), then moved = ``export_kv`` + a real data-plane transfer on
loopback (the path the sender picks: shm on one host; its first send, which picks the path,
is not timed) + ``import_kv`` of the bytes received. Medians of ``--repeat`` runs; the ratio
is recompute / move.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from bench.report import fmt
from bench.cli import at_least


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="256,1024,2048", help="context lengths in tokens (default 256,1024,2048)")
    p.add_argument("--threads", type=at_least(1), default=None, help="engine threads (default: torch's)")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure, the median is shown (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")


def _tokens(tokenizer, n: int) -> list[int]:
    """``n`` tokens of English text (this repository's docs)."""
    root = Path(__file__).resolve().parent.parent
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((root / "docs").glob("*.md")))
    ids = tokenizer.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


async def bench(contexts: list[int], threads: int | None, repeat: int) -> list[dict]:
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.sampling import SamplingParams
    from shared.settings import DataPlaneSettings
    from shared.transfer import make_transport

    bs = 16
    engine = Engine.from_path(None, EngineConfig(threads=threads, block_size=bs, enable_prefix_caching=False,
                                                 num_kv_blocks=2 * (max(contexts) // bs + 2)))
    transport = make_transport(DataPlaneSettings())
    sender, rx = transport.sender(), transport.receiver()
    host, port = await rx.listen()
    rows = []
    try:
        await sender.send(host, port, "warmup", bytes(1 << 20))  # picks the path to this peer: not timed
        (await rx.take("warmup")).release()
        for n in contexts:
            ids = _tokens(engine.tokenizer, n)
            recompute_s, export_s, send_s, import_s, total_s = [], [], [], [], []
            for i in range(repeat):
                rid = f"m{n}-{i}"
                t0 = time.perf_counter()
                engine.add(rid, ids, SamplingParams(max_tokens=8, temperature=0))
                while not any(o.token_ids for o in engine.step()):
                    pass  # prefilled up to the first token: decoding from here
                t1 = time.perf_counter()
                blob = engine.export_kv(rid)
                t2 = time.perf_counter()
                res = await sender.send(host, port, rid, blob)
                with await rx.take(rid) as payload:
                    data = bytes(payload.data)
                t3 = time.perf_counter()
                engine.import_kv(rid, data)
                t4 = time.perf_counter()
                recompute_s.append(t1 - t0)
                export_s.append(t2 - t1)
                send_s.append(t3 - t2)
                import_s.append(t4 - t3)
                total_s.append(t4 - t1)
                engine.abort(rid)
                engine.step()
            move, recompute = statistics.median(total_s), statistics.median(recompute_s)
            rows.append({"bench": "migration", "context_tokens": n, "kv_MiB": len(blob) / 2**20, "path": res.path,
                         "export_ms": 1e3 * statistics.median(export_s), "send_ms": 1e3 * statistics.median(send_s),
                         "import_ms": 1e3 * statistics.median(import_s), "move_ms": 1e3 * move,
                         "move_ms_per_1k_tokens": 1e6 * move / n, "recompute_ms": 1e3 * recompute,
                         "recompute_ms_per_1k_tokens": 1e6 * recompute / n, "ratio": recompute / move})
    finally:
        await sender.close()
        await rx.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| context tokens | KV MiB | path | export ms | send ms | import ms | move ms | move ms / 1k tok "
             "| recompute ms | recompute ms / 1k tok | recompute / move |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context_tokens']} | {fmt(r['kv_MiB'])} | {r['path']} | {fmt(r['export_ms'])} "
                     f"| {fmt(r['send_ms'])} | {fmt(r['import_ms'])} | {fmt(r['move_ms'])} "
                     f"| {fmt(r['move_ms_per_1k_tokens'])} | {fmt(r['recompute_ms'])} "
                     f"| {fmt(r['recompute_ms_per_1k_tokens'])} | {fmt(r['ratio'])}x |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    if not contexts or min(contexts) < 1 or args.repeat < 1:
        raise SystemExit("--contexts needs positive token counts and --repeat >= 1")
    rows = asyncio.run(bench(contexts, args.threads, args.repeat))
    print(table(rows), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0
