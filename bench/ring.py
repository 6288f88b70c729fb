"""``tandem bench ring``: ring decode (members in this process) vs a single worker, per context.

Per context length: a single worker's fused decode step over its paged KV, then rings of
``--members`` members (for N > 1 both with every segment's state to the coordinator and folded
along the ring) (``shared/ring/session.py``) decoding the same positions; each step split
into the members' attention (store + attend, the members one after another in this process),
the coordinator's merge + o-proj + FFN, and the rest (embed, q|k|v, head), with the bytes a step
would put on the wire (q|k|v rows out to each member with keys, segment states back). The KV is
random fp16 (no prefill of 8K tokens here): a step's time does not depend on the values, and
exactness is the tests' job (tests/integration/test_ring.py).

``--links``: the per-step cost of the ring connections: a ring of 2 whose second member is in
another process (a ``RingServer``, as a cpu-decode worker runs it, data-plane key on) reached
over loopback TCP or through the connection's shared-memory region, against the same ring with
both members in this process (no messages); per-segment states, the payloads ``Ring.step`` sends.

``--procs``: the ring across processes, as cpu-decode workers run it: the coordinator (this
process, with its own member 0, like the worker a plan names first) and members 1..N-1 each in a
process of its own (a ``RingServer`` over a ``LocalMember``, data-plane key on, shared memory or
``--tcp``), 1 kernel thread per process by default, so a ring of N attends on N cores at once.
Per context and ring size, one session per variant — every segment's state back, or the fold
along the ring (member to member over their own links) unpipelined or by kv head, with the q
rows broadcast by the coordinator or passed along the ring — the variants taking turns step by
step (the machine's load falls on all alike), against a single worker's fused step on 1 thread
and on all. A step's time is split from the coordinator's side: compute (its kernels, its own
member's attention and fold included), transfer (sending and reading messages, their tags
included) and wait (blocked until a member's message arrives).

Then the seed's compute/transfer model per head group (docs/strategies.md): the attention time
of one kv head's keys on a member (measured here per key; modelled for a 2-socket EPYC) against
the bytes of that head group's q and partial states at 10 and 100 Gbps.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.report import fmt
from bench.cli import at_least

# a 2-socket EPYC (Zen 4, 2 x 64 cores, 12 DDR5-4800 channels per socket) for the model:
EPYC_MEM_BW = 2 * 460e9         # bytes/s, all cores reading the KV
EPYC_FLOPS = 2 * 64 * 2.4e9 * 32  # f32 FMA lanes x 2 flops, all cores (peak)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="4096,8000", help="context lengths in tokens (default 4096,8000)")
    p.add_argument("--members", default="1,2,3", help="ring sizes (default 1,2,3)")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per figure (default 8)")
    p.add_argument("--model-contexts", default="8192,32768,131072,262144",
                   help="contexts of the compute/transfer model (default 8192,32768,131072,262144)")
    p.add_argument("--threads", type=at_least(1), default=None, help="kernel threads (default: torch's)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    p.add_argument("--links", action="store_true",
                   help="the ring connections' per-step cost: a member in another process over TCP vs shm")
    p.add_argument("--procs", action="store_true",
                   help="the ring across processes: members 1..N-1 in processes of their own (fold, pipelining, "
                        "q broadcast vs along the ring)")
    p.add_argument("--tcp", action="store_true", help="--procs: loopback TCP instead of shared memory")
    p.add_argument("--stack", action="store_true",
                   help="instead: a ring of cpu-decode workers against one worker through two `tandem up` stacks "
                        "(bench/ring_stack.py)")
    p.add_argument("--context", type=int, default=3000, help="--stack: prompt tokens (default 3000)")
    p.add_argument("--max-tokens", type=int, default=64, help="--stack: tokens generated (default 64)")
    p.add_argument("--ring-members", default="3",
                   help="--stack: ring sizes, comma-separated (default 3): a stack per size")
    p.add_argument("--coordinator-scatter", action="store_true",
                   help="--stack: also, per ring size, a stack whose coordinator receives the whole KV and "
                        "scatters it (TANDEM_RING_PREFILL_SCATTER=0), against the prefill scattering it")
    p.add_argument("--rounds", type=at_least(1), default=2, help="--stack: rounds, order alternating (default 2)")


def _bench(contexts: list[int], members: list[int], steps: int, threads: int | None) -> tuple[list[dict], dict]:
    import torch

    from kernels import cpu
    from kernels.cpu_ring import RingKernels
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.kv_cache import KV_DTYPE
    from shared.engine.model import AttnChunk, StepContext
    from shared.ring.session import LocalMember, Ring, StepTimes
    from shared.strategy import shard_ranges

    top = max(contexts) + steps + 1
    engine = Engine.from_path(None, EngineConfig(threads=threads, enable_prefix_caching=False,
                                                 num_kv_blocks=-(-top // 16) + 1))
    k = RingKernels.of(engine.model)
    if k is None:
        raise SystemExit("the fused CPU step is not available here: no ring")
    layout, bs, cfg = engine.layout, engine.layout.block_size, engine.model_config
    gen = torch.Generator().manual_seed(0)
    rows, per_key = [], []
    for n in contexts:
        nb = layout.blocks_for(n + steps)
        kv = torch.randn(nb, *layout.block_shape, generator=gen).to(KV_DTYPE)
        table = torch.arange(nb)
        ids = torch.randint(0, cfg.vocab_size, (n + steps + 1,), generator=gen).tolist()
        with torch.inference_mode():
            engine.kv[:nb] = kv
            t0 = time.perf_counter()
            for p in range(n, n + steps):
                pos = torch.tensor([p])
                engine.model.forward(torch.tensor([ids[p]]), StepContext(
                    pos, table[pos // bs], pos % bs, [AttnChunk(p, 1, 0, table)], torch.tensor([0])), engine.kv)
            single = (time.perf_counter() - t0) / steps
        rows.append({"context": n, "members": 0, "step_ms": 1e3 * single, "tok_s": 1 / single})
        raw = kv[:layout.blocks_for(n)].view(torch.uint8).numpy().tobytes()
        for m, fold in [(m, f) for m in members for f in ((False, True) if m > 1 else (False,))]:
            shard = max(b - a for a, b in shard_ranges(n + steps + 1, m))
            ring = Ring(k, [LocalMember(k, layout, layout.blocks_for(shard) * layout.block_bytes, f"m{i}")
                            for i in range(m)], fold=fold)
            ring.admit("s", ids[:n + 1], n, raw, n + steps + 1)
            ring.step("s")            # warm: the members' buffers
            ring.append("s", ids[n + 1])
            ring.times = StepTimes()
            for p in range(n + 1, n + steps):
                ring.step("s")
                ring.append("s", ids[p + 1])
            t = ring.times
            step = t.total / t.steps
            rows.append({"context": n, "members": m, "fold": fold, "step_ms": 1e3 * step, "tok_s": 1 / step,
                         "attend_ms": 1e3 * t.attend / t.steps, "merge_ffn_ms": 1e3 * t.merge_ffn / t.steps,
                         "rest_ms": 1e3 * (t.total - t.attend - t.merge_ffn) / t.steps,
                         "overhead_vs_single": step / single,
                         "bytes_out": t.bytes_out // t.steps, "bytes_back": t.bytes_back // t.steps,
                         "bytes_ring": t.bytes_ring // t.steps})
            if m == 1:
                per_key.append((n, t.attend / t.steps / (cfg.n_layers * cfg.n_kv_heads)))
            ring.release("s")
    # seconds of attention per (layer, kv head, key) on this machine: the slope between the
    # smallest and largest context of a ring of 1 (without its fixed per-call cost), else the mean
    (n0, a0), (n1, a1) = min(per_key, default=(1, 0.0)), max(per_key, default=(1, 0.0))
    slope = (a1 - a0) / (n1 - n0) if n1 > n0 and a1 > a0 else a1 / n1
    machine = {"isa": cpu.isa(), "threads": cpu.get_num_threads(), "s_per_key_head": slope,
               "group": cfg.n_heads // cfg.n_kv_heads, "head_dim": cfg.head_dim}
    return rows, machine


def _member_process(conn, threads: int | None, kv_bytes: int, key: bytes, shm: bool = True) -> None:
    """``--links``: a member in its own process (the bundled model's kernels), served on a ring
    port until the parent closes the pipe."""
    from kernels import cpu
    from kernels.cpu_ring import RingKernels
    from shared.engine.engine import Engine, EngineConfig
    from shared.ring.session import LocalMember
    from shared.ring import RingServer
    if threads:
        cpu.set_num_threads(threads)
    engine = Engine.from_path(None, EngineConfig(threads=threads, enable_prefix_caching=False, num_kv_blocks=1))
    k = RingKernels.of(engine.model)
    server = RingServer(LocalMember(k, engine.layout, kv_bytes, "remote"), "127.0.0.1", 0, key, shm=shm)
    conn.send(server.start()[1])
    try:
        conn.recv()
    except EOFError:   # the parent is done
        pass
    server.close()


def _links(contexts: list[int], steps: int, threads: int | None) -> tuple[list[dict], str]:
    """Per context: a ring of 2 in this process, then with member 1 in another process over TCP
    and over shm; ms per step, alternating the links per round."""
    import multiprocessing

    import torch

    from kernels import cpu
    from kernels.cpu_ring import RingKernels
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.kv_cache import KV_DTYPE
    from shared.ring.session import LocalMember, Ring
    from shared.ring import RemoteMember
    from shared.strategy import shard_ranges

    engine = Engine.from_path(None, EngineConfig(threads=threads, enable_prefix_caching=False, num_kv_blocks=1))
    k = RingKernels.of(engine.model)
    if k is None:
        raise SystemExit("the fused CPU step is not available here: no ring")
    layout, cfg, key = engine.layout, engine.model_config, b"bench-key"
    budget = layout.blocks_for(max(contexts) + steps + 1) * layout.block_bytes
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_member_process, args=(child, threads, budget, key), daemon=True)
    proc.start()
    port = parent.recv()
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for n in contexts:
            raw = torch.randn(layout.blocks_for(n), *layout.block_shape, generator=gen).to(KV_DTYPE)
            raw = raw.view(torch.uint8).numpy().tobytes()
            ids = torch.randint(0, cfg.vocab_size, (n + steps + 2,), generator=gen).tolist()
            rings = {"in process": [LocalMember(k, layout, budget, "m1")]}
            for link in ("tcp", "shm"):
                rings[link] = [RemoteMember("remote", "127.0.0.1", port, key, layout, shm=link == "shm")]
                assert rings[link][0].link == link
            times: dict[str, list[float]] = {name: [] for name in rings}
            scatter = {}
            for i, (name, other) in enumerate(rings.items()):
                ring = Ring(k, [LocalMember(k, layout, budget, "m0"), *other])
                t0 = time.perf_counter()
                ring.admit(f"s{i}", ids[:n + 1], n, raw, n + steps + 2)
                scatter[name] = time.perf_counter() - t0
                rings[name] = ring
            for step in range(steps + 1):      # the first step warms each ring up
                order = list(rings.items())
                for name, ring in (order if step % 2 else order[::-1]):
                    sid = f"s{list(rings).index(name)}"
                    t0 = time.perf_counter()
                    ring.step(sid)
                    if step:
                        times[name].append(time.perf_counter() - t0)
                    ring.append(sid, ids[n + 1 + step])
            base = sorted(times["in process"])[len(times["in process"]) // 2]
            for name, ring in rings.items():
                med = sorted(times[name])[len(times[name]) // 2]
                t = ring.times
                rows.append({"context": n, "link": name, "scatter_ms": 1e3 * scatter[name], "step_ms": 1e3 * med, "extra_ms": 1e3 * (med - base),
                             "vs_in_process": med / base, "bytes_out": t.bytes_out // t.steps,
                             "bytes_back": t.bytes_back // t.steps, "ranges": shard_ranges(n + steps + 2, 2)})
                ring.release(f"s{list(rings).index(name)}")
                ring.close()
    finally:
        parent.close()
        proc.join(10)
    return rows, f"isa={cpu.isa()} threads={cpu.get_num_threads()} (each process)"


PROC_VARIANTS = [   # (name, fold, groups (0: one per kv head), qpass)
    ("per segment", False, 1, False),
    ("fold, q broadcast", True, 1, False),
    ("fold by head, q broadcast", True, 0, False),
    ("fold, q along the ring", True, 1, True),
    ("fold by head, q along the ring", True, 0, True),
]


def _procs(contexts: list[int], members: list[int], steps: int, threads: int | None, shm: bool
           ) -> tuple[list[dict], str]:
    """``--procs``: per context, the single worker (1 thread and ``threads`` or all), then per
    ring size the variants, their steps interleaved; members 1.. in processes of their own."""
    import multiprocessing
    import os

    import torch

    from kernels import cpu
    from kernels.cpu_ring import RingKernels
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.kv_cache import KV_DTYPE
    from shared.engine.model import AttnChunk, StepContext
    from shared.ring.session import LocalMember, Ring, StepTimes
    from shared.ring import RemoteMember
    from shared.strategy import shard_ranges

    threads = threads or 1
    cores = os.cpu_count() or 1
    top = max(contexts) + steps + 2
    cpu.set_num_threads(threads)
    engine = Engine.from_path(None, EngineConfig(threads=threads, enable_prefix_caching=False,
                                                 num_kv_blocks=-(-top // 16) + 1))
    k = RingKernels.of(engine.model)
    if k is None:
        raise SystemExit("the fused CPU step is not available here: no ring")
    layout, bs, cfg, key = engine.layout, engine.layout.block_size, engine.model_config, b"bench-key"
    nvar = len(PROC_VARIANTS)
    shard = max(b - a for a, b in shard_ranges(top, min(members)))
    budget = nvar * (layout.blocks_for(shard) + 1) * layout.block_bytes
    ctx = multiprocessing.get_context("spawn")
    procs, pipes, ports = [], [], []
    for _ in range(max(members) - 1):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_member_process, args=(child, threads, budget, key, shm), daemon=True)
        proc.start()
        procs.append(proc)
        pipes.append(parent)
    ports = [p.recv() for p in pipes]
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for n in contexts:
            nb = layout.blocks_for(n + steps + 2)
            kv = torch.randn(nb, *layout.block_shape, generator=gen).to(KV_DTYPE)
            ids = torch.randint(0, cfg.vocab_size, (n + steps + 2,), generator=gen).tolist()
            table = torch.arange(nb)
            single = {}
            for nt in sorted({1, threads, cores}):
                cpu.set_num_threads(nt)
                with torch.inference_mode():
                    engine.kv[:nb] = kv
                    times = []
                    for p in range(n, n + steps + 1):
                        pos = torch.tensor([p])
                        t0 = time.perf_counter()
                        engine.model.forward(torch.tensor([ids[p]]), StepContext(
                            pos, table[pos // bs], pos % bs, [AttnChunk(p, 1, 0, table)], torch.tensor([0])),
                            engine.kv)
                        times.append(time.perf_counter() - t0)
                single[nt] = sorted(times[1:])[steps // 2]
                rows.append({"context": n, "members": 0, "threads": nt, "step_ms": 1e3 * single[nt],
                             "tok_s": 1 / single[nt]})
            cpu.set_num_threads(threads)
            raw = kv[:layout.blocks_for(n)].view(torch.uint8).numpy().tobytes()
            for m in members:
                local = LocalMember(k, layout, budget, "m0")
                rings = []
                for name, fold, groups, qpass in PROC_VARIANTS:
                    remote = [RemoteMember(f"m{i + 1}", "127.0.0.1", ports[i], key, layout, shm=shm)
                              for i in range(m - 1)]
                    rings.append(Ring(k, [local, *remote], fold=fold, groups=groups or cfg.n_kv_heads, qpass=qpass))
                for v, ring in enumerate(rings):
                    ring.admit(f"s{v}", ids[:n + 1], n, raw, n + steps + 2)
                step_times: list[list[float]] = [[] for _ in rings]
                for step in range(steps + 1):   # the variants take turns; the first step warms each up
                    order = list(enumerate(rings)) if step % 2 else list(enumerate(rings))[::-1]
                    for v, ring in order:
                        if step == 1:
                            ring.times = StepTimes()
                        t0 = time.perf_counter()
                        ring.step(f"s{v}")
                        if step:
                            step_times[v].append(time.perf_counter() - t0)
                        ring.append(f"s{v}", ids[n + 1 + step])
                for v, ring in enumerate(rings):
                    name, fold, groups, qpass = PROC_VARIANTS[v]
                    t, med = ring.times, sorted(step_times[v])[len(step_times[v]) // 2]
                    rows.append({"context": n, "members": m, "variant": name, "groups": ring.groups,
                                 "step_ms": 1e3 * med, "tok_s": 1 / med,
                                 "mean_ms": 1e3 * t.total / t.steps,
                                 "compute_ms": 1e3 * (t.total - t.wait - t.transfer) / t.steps,
                                 "transfer_ms": 1e3 * t.transfer / t.steps, "wait_ms": 1e3 * t.wait / t.steps,
                                 "vs_single_1": med / single[1], "vs_single_all": med / single[cores],
                                 "bytes_out": t.bytes_out // t.steps, "bytes_back": t.bytes_back // t.steps,
                                 "bytes_ring": t.bytes_ring // t.steps,
                                 "links": sorted({getattr(x, "link", "local") for x in ring.members})})
                    ring.release(f"s{v}")
                    ring.close()
    finally:
        for p in pipes:
            p.close()
        for proc in procs:
            proc.join(10)
    return rows, (f"isa={cpu.isa()} kernel threads={threads} per process, {cores} cores, "
                  f"links {'shm' if shm else 'tcp'}")


def procs_table(rows: list[dict]) -> str:
    lines = ["| context | members | variant | step ms (median) | tok/s | compute ms | transfer ms | wait ms "
             "| vs single 1 thread | vs single all cores | bytes out / step | bytes back / step "
             "| bytes member to member / step |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["members"] == 0:
            lines.append(f"| {r['context']} | single, {r['threads']} thread{'s' if r['threads'] > 1 else ''} | "
                         f"| {fmt(r['step_ms'])} | {fmt(r['tok_s'])} | | | | | | | | |")
        else:
            lines.append(f"| {r['context']} | {r['members']} | {r['variant']} | {fmt(r['step_ms'])} "
                         f"| {fmt(r['tok_s'])} | {fmt(r['compute_ms'])} | {fmt(r['transfer_ms'])} "
                         f"| {fmt(r['wait_ms'])} | {fmt(r['vs_single_1'], 2)}x | {fmt(r['vs_single_all'], 2)}x "
                         f"| {r['bytes_out']} | {r['bytes_back']} | {r['bytes_ring']} |")
    return "\n".join(lines)


def links_table(rows: list[dict]) -> str:
    lines = ["| context | member 1 | scatter ms | step ms (median) | + ms vs in process | ratio | bytes out / step "
             "| bytes back / step |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['link']} | {fmt(r['scatter_ms'])} | {fmt(r['step_ms'])} "
                     f"| {fmt(r['extra_ms'], 2)} "
                     f"| {fmt(r['vs_in_process'], 2)}x | {r['bytes_out']} | {r['bytes_back']} |")
    return "\n".join(lines)


def margin_rows(machine: dict, contexts: list[int], members: list[int]) -> list[dict]:
    """The seed's model: per head group, attention time on a member vs its transfer time, for the
    bytes of this design (q out; one state per segment back: exact) and of one state per member
    back (what an order-free merge, or the ring-pass fold of docs/strategies.md, sends)."""
    from shared.strategy import SEG, shard_ranges

    out = []
    shapes = [("bundled (group %d, hd %d)" % (machine["group"], machine["head_dim"]), machine["group"], machine["head_dim"]),
              ("70B-class GQA (group 8, hd 128)", 8, 128)]
    for name, g, hd in shapes:
        for n in contexts:
            for m in (x for x in members if x > 1):
                a, b = shard_ranges(n, m)[0]
                keys, nseg = b - a, -(-(b - a) // SEG)
                q_bytes, state = g * hd * 4, ((g + 7) // 8 * 8) * (hd + 2) * 4
                here = keys * machine["s_per_key_head"] * (g * hd) / (machine["group"] * machine["head_dim"])
                epyc = keys * max(4 * g * hd / EPYC_FLOPS, 2 * hd * 2 / EPYC_MEM_BW)
                for gbps in (10, 100):
                    for scheme, back in (("per segment", nseg * state), ("per member", state)):
                        wire = (q_bytes + back) * 8 / (gbps * 1e9)
                        out.append({"model": name, "context": n, "members": m, "gbps": gbps, "scheme": scheme,
                                    "bytes": q_bytes + back, "wire_us": 1e6 * wire,
                                    "here_us": 1e6 * here, "here_margin": here / wire,
                                    "epyc_us": 1e6 * epyc, "epyc_margin": epyc / wire})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| context | members | states | step ms | tok/s | attend ms | merge+FFN ms | rest ms | vs single "
             "| bytes out | bytes back | bytes member to member |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["members"] == 0:
            lines.append(f"| {r['context']} | single | | {fmt(r['step_ms'])} | {fmt(r['tok_s'])} | | | | 1.0x | | | |")
        else:
            lines.append(f"| {r['context']} | {r['members']} | {'folded' if r['fold'] else 'per segment'} "
                         f"| {fmt(r['step_ms'])} | {fmt(r['tok_s'])} "
                         f"| {fmt(r['attend_ms'])} | {fmt(r['merge_ffn_ms'])} | {fmt(r['rest_ms'])} "
                         f"| {fmt(r['overhead_vs_single'], 2)}x | {r['bytes_out']} | {r['bytes_back']} "
                         f"| {r['bytes_ring']} |")
    return "\n".join(lines)


def margin_table(rows: list[dict]) -> str:
    lines = ["| model | context | members | Gbps | states back | bytes / head group | wire µs | attention µs here "
             "| margin here | attention µs EPYC | margin EPYC |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['context']} | {r['members']} | {r['gbps']} | {r['scheme']} | {r['bytes']} "
                     f"| {fmt(r['wire_us'], 2)} | {fmt(r['here_us'], 2)} | {fmt(r['here_margin'], 2)}x "
                     f"| {fmt(r['epyc_us'], 2)} | {fmt(r['epyc_margin'], 2)}x |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.stack:
        from bench import ring_stack
        res = ring_stack.run(args)
        print(ring_stack.table(res), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(res, f, indent=2)
        return 0
    contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    if args.procs:
        members = [int(x) for x in args.members.split(",") if x.strip()]
        if not members or min(members) < 1 or args.steps < 2 or max(contexts) + args.steps + 2 > 8192:
            raise SystemExit("--members >= 1, --steps >= 2, context + steps + 2 <= 8192")
        rows, machine = _procs(contexts, members, args.steps, args.threads, not args.tcp)
        print(machine, flush=True)
        print(procs_table(rows), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"machine": machine, "procs": rows}, f, indent=2)
        return 0
    if args.links:
        rows, machine = _links(contexts, args.steps, args.threads)
        print(machine, flush=True)
        print(links_table(rows), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"machine": machine, "links": rows}, f, indent=2)
        return 0
    members = [int(x) for x in args.members.split(",") if x.strip()]
    if not contexts or not members or min(members) < 1 or args.steps < 2 or max(contexts) + args.steps >= 8192:
        raise SystemExit("--contexts and --members need positive values, --steps >= 2, context + steps < 8192")
    rows, machine = _bench(contexts, members, args.steps, args.threads)
    margins = margin_rows(machine, [int(x) for x in args.model_contexts.split(",") if x.strip()], members)
    print(f"isa={machine['isa']} threads={machine['threads']} "
          f"attention {1e9 * machine['s_per_key_head']:.2f} ns per (layer, kv head, key)"
          f"{' (slope between contexts)' if len(contexts) > 1 else ''}", flush=True)
    print(table(rows), flush=True)
    print(margin_table(margins), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine, "steps": rows, "margin": margins}, f, indent=2)
    return 0
