"""The router's prefix index: apply rate, overlap lookups, replay and snapshot times.

    python -m bench.prefix_index [--holders 10000] [--docs 1000] [--events 100000] [--json FILE]

- apply: ``--holders`` holders each store the chunk-key chains of ``--per-holder`` random
  documents (``--chunks`` keys each, random lengths), one KVEvent per document; events/s and
  keys/s of ``PrefixIndex.apply`` (events built beforehand), and with ``schemas.decode`` of
  the wire bytes included (what the feed does per message); rates over this process's CPU
  time (``time.process_time``), so a busy machine slows them less than wall-clock rates;
- overlap: lookups/s of ``overlap`` on random documents' full chains against that index;
- replay: ``--events`` KVEvents (4 keys each, from 100 holders) published into a private
  nats-server's JetStream stream, then the seconds a fresh ``IndexFeed`` takes to start (no
  snapshot: the whole stream), and to start from a snapshot of the same index (no replay);
  snapshot bytes and write seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from services.prefix_index import IndexFeed, PrefixIndex
from shared import schemas, subjects
from shared.bus import Bus
from shared.nats_server import EmbeddedNats
from shared.schemas import KVEvent


def _key(rng: random.Random) -> str:
    return f"{rng.getrandbits(256):064x}"


def bench_memory(holders: int, docs: int, chunks: int, per_holder: int, lookups: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    chains = [[_key(rng) for _ in range(chunks)] for _ in range(docs)]
    events = []
    for h in range(holders):
        for seq, d in enumerate(rng.sample(range(docs), per_holder), 1):
            events.append(KVEvent(holder=f"w{h}", role=subjects.CPU_DECODE, epoch=1, seq=seq,
                                  stored=chains[d][:rng.randint(1, chunks)]))
    nkeys = sum(len(e.stored) for e in events)
    ix = PrefixIndex()
    t0 = time.process_time()
    for e in events:
        ix.apply(e)
    apply_s = time.process_time() - t0

    wire = [schemas.encode(e) for e in events[:50_000]]
    ix2 = PrefixIndex()
    t0 = time.process_time()
    for data in wire:
        ix2.apply(schemas.decode(data, KVEvent))
    decode_s = time.process_time() - t0

    queries = [chains[rng.randrange(docs)] for _ in range(lookups)]
    t0 = time.process_time()
    hits = 0
    for q in queries:
        hits += len(ix.overlap(q))
    overlap_s = time.process_time() - t0
    return {"holders": holders, "events": len(events), "keys_applied": nkeys, "distinct_keys": len(ix),
            "apply_events_per_s": round(len(events) / apply_s), "apply_keys_per_s": round(nkeys / apply_s),
            "decode_apply_events_per_s": round(len(wire) / decode_s),
            "overlap_lookups_per_s": round(lookups / overlap_s), "lookup_chunks": chunks,
            "holders_per_lookup": round(hits / lookups, 1)}


async def bench_replay(n_events: int, seed: int = 1) -> dict:
    rng = random.Random(seed)
    async with EmbeddedNats() as url:
        bus = await Bus.connect(url=url, name="bench-pub")
        js = bus.nc.jetstream()
        setup = IndexFeed(bus, PrefixIndex())          # creates the stream and the bucket
        await setup.start()
        await setup.close()
        seqs: dict[str, int] = {}
        t0 = time.perf_counter()
        for i in range(n_events):
            h = f"w{rng.randrange(100)}"
            seqs[h] = seqs.get(h, 0) + 1
            evicted = [] if i < 1000 else [_key(rng)]
            ev = KVEvent(holder=h, role=subjects.CPU_DECODE, epoch=1, seq=seqs[h],
                         stored=[_key(rng) for _ in range(4)], evicted=evicted)
            await bus.nc.publish(subjects.kv_events(h), schemas.encode(ev))
            if i % 5000 == 4999:
                await bus.flush(10)
        await bus.flush(10)
        publish_s = time.perf_counter() - t0
        for _ in range(100):  # the stream has stored everything
            if (await js.stream_info("TANDEM_KVEVENTS")).state.last_seq >= n_events:
                break
            await asyncio.sleep(0.1)

        reader = await Bus.connect(url=url, name="bench-router")
        cold = IndexFeed(reader, PrefixIndex(), catch_up_timeout=300, snapshot_every=3600, snapshot_events=10**9)
        t0 = time.perf_counter()
        await cold.start()
        replay_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        await cold.save()
        save_s = time.perf_counter() - t0
        head = (await cold._head())[1]
        await cold.close()

        warm_ix = PrefixIndex()
        warm = IndexFeed(reader, warm_ix, catch_up_timeout=300, snapshot_every=3600, snapshot_events=10**9)
        t0 = time.perf_counter()
        await warm.start()
        restore_s = time.perf_counter() - t0
        assert warm.replayed == 0 and warm_ix.where == cold.index.where
        await warm.close()
        await reader.close()
        await bus.close()
    return {"events": n_events, "publish_s": round(publish_s, 2), "replay_s": round(replay_s, 2),
            "replay_events_per_s": round(cold.replayed / replay_s), "replayed": cold.replayed,
            "keys": len(cold.index), "snapshot_bytes": head["bytes"], "snapshot_parts": head["parts"],
            "snapshot_write_s": round(save_s, 2), "start_from_snapshot_s": round(restore_s, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--holders", type=int, default=10_000)
    p.add_argument("--docs", type=int, default=1000, help="distinct documents (key chains)")
    p.add_argument("--chunks", type=int, default=32, help="chunk keys per document (32: 8k tokens)")
    p.add_argument("--per-holder", type=int, default=10, help="documents each holder stores")
    p.add_argument("--lookups", type=int, default=20_000)
    p.add_argument("--events", type=int, default=100_000, help="events to replay")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    a = p.parse_args(argv)
    out = {"memory": bench_memory(a.holders, a.docs, a.chunks, a.per_holder, a.lookups),
           "replay": asyncio.run(bench_replay(a.events))}
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
