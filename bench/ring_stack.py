"""``tandem bench ring --stack``: a ring of cpu-decode workers against one worker, through the stack.

    tandem bench ring --stack [--context 3000] [--max-tokens 64] [--ring-members 2,3] [--coordinator-scatter]
                              [--rounds 2]

Two ``tandem up`` stacks, alive together for the whole run (each its own embedded NATS, the
data-plane key and bus auth on as always), streamed through the official ``openai`` client
(``/v1/completions``, the prompt as token ids, greedy, ``ignore_eos``):

- ``single``: ``--prefill 1 --gpu-decode 0 --cpu-decode 1`` with the default KV budget: one
  cpu-decode worker holds the whole context (strategy ``cpu``);
- ``cpu-ring(N)``, per N of ``--ring-members``: ``--cpu-decode N`` whose workers' budgets
  (``TANDEM_KV_BUDGET_MB_CPU_DECODE``) are sized so that no fewer than N of them hold it: the
  router plans ``cpu-ring(N)``, the prefill loads the other members' ranges itself (all at once,
  parked under a claim ticket) and hands the coordinator its own range, which claims the rest
  and decodes with the ring (members in their own processes, per-step messages on ring
  connections); with ``--coordinator-scatter`` also ``cpu-ring(N) coord`` (the same with
  ``TANDEM_RING_PREFILL_SCATTER=0``: the coordinator receives the whole KV and scatters it).

Hand-off (the prefill's log line of each stream): from the prefill's end (its KV exported) to the
decode worker's ack, the coordinator's ring admitted (its next engine step is the first decode
step): ``hand-off`` ms = ``export`` (the KV out of the prefill's engine) + ``send to ack`` (the
data-plane send, then the DecodeRequest until the decode worker acks it); ``scatter``: the
prefill's ``RESERVE`` + ``LOAD`` + ``PARK`` of the other members, alongside the send (for
``coord``, the coordinator's scatter inside its ack, from its log).

Per stream: TTFT (send -> first token: prefill, hand-off and, for the ring, the scatter) and
decode tok/s = (tokens - 1) / (last - first token); rounds alternate the order, 2 s apart (the
router sees the last stream's KV freed; the client also retries a 429 after its Retry-After). The texts must
be equal (the ring is exact). Prints a Markdown table naming the CPU ISA and the load.
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import sys
import time

from bench.serve import Server
from bench.stack import StackSystem, _progress, prompts_for
from shared.engine.kv_cache import KVLayout
from shared.nats_server import free_port
from shared.strategy import SEG, shard_ranges


SETTLE_S = 2.0   # between streams: 4 heartbeat intervals


class _Stack(StackSystem):
    def __init__(self, name: str, argv: list[str], env: dict, want: dict):
        port = free_port()
        self.name, self.kind, self.model, self.want = name, name, "", want
        self.server = Server(name, [sys.executable, "-m", "services.cli", "up", *argv, "--port", str(port)],
                             dict(env, TANDEM_PORT=str(port)), port)

    def wait_ready(self) -> None:
        import httpx
        self.server.wait_workers(self.want, 300)
        self.model = httpx.get(self.server.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def client(self):
        """As a user's client: a 429 (a ring's KV still in use by the last request, as the router's
        last heartbeats say) is retried after its Retry-After."""
        import httpx
        import openai
        return openai.AsyncOpenAI(base_url=self.server.url + "/v1", api_key="bench", max_retries=5,
                                  http_client=httpx.AsyncClient(timeout=600))


def budget_mb(layout: KVLayout, context: int, members: int) -> int:
    """A cpu-decode budget (MiB) holding the largest shard of a ring of ``members``, but not
    that of a ring of ``members - 1``."""
    need = max(b - a for a, b in shard_ranges(context, members))
    mb = -(-layout.blocks_for(need) * layout.block_bytes // 2**20)
    if members > 1:
        fewer = max(b - a for a, b in shard_ranges(context, members - 1))
        if mb * 2**20 // layout.block_bytes * layout.block_size >= fewer:
            raise ValueError(f"no budget tells a ring of {members} from one of {members - 1} at {context} tokens")
    return mb


def run(args) -> dict:
    from kernels.dispatch import describe
    from shared.engine.loader import load_model
    model = load_model()
    cfg = model.config
    layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16)
    total = args.context + args.max_tokens
    sizes = [int(n) for n in str(args.ring_members).split(",")]
    if any(n < 2 or total // SEG < n for n in sizes):
        raise ValueError("--ring-members must be >= 2, with a segment of 256 tokens each")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_KV_BUDGET_MB_PREFILL="512", TANDEM_HEARTBEAT_INTERVAL="0.5")
    env.pop("TANDEM_NATS_URL", None)
    base = ["--prefill", "1", "--gpu-decode", "0", "--kvpool", "0"]
    stacks = [_Stack("single", base + ["--cpu-decode", "1"], dict(env, TANDEM_KV_BUDGET_MB_CPU_DECODE="512"),
                     {"cpu-decode": 1, "prefill": 1, "router": 1})]
    budgets = {}
    for n in sizes:
        budgets[n] = mb = budget_mb(layout, total, n)
        for coord in ([False, True] if args.coordinator_scatter else [False]):
            stacks.append(_Stack(f"cpu-ring({n})" + (" coord" if coord else ""), base + ["--cpu-decode", str(n)],
                                 dict(env, TANDEM_KV_BUDGET_MB_CPU_DECODE=str(mb),
                                      TANDEM_RING_PREFILL_SCATTER="0" if coord else "1"),
                                 {"cpu-decode": n, "prefill": 1, "router": 1}))
    per: dict[str, list] = {s.name: [] for s in stacks}
    handoffs: dict[str, list] = {s.name: [] for s in stacks}
    mismatches = 0
    try:
        for s in stacks:
            s.wait_ready()
        _progress("warm-up")
        for s in stacks:
            asyncio.run(_one(s, prompts_for(model.tokenizer, 1, 64, "warm")[0], 8))
        load = os.getloadavg()[0]
        for rnd in range(args.rounds):
            prompt = prompts_for(model.tokenizer, 1, args.context, f"ring-r{rnd}")[0]
            texts = {}
            for s in (stacks if rnd % 2 == 0 else stacks[::-1]):
                time.sleep(SETTLE_S)   # the last request's KV is free in the heartbeats the router sees
                seen = len(s.server.log)
                st = asyncio.run(_one(s, prompt, args.max_tokens))
                time.sleep(0.2)        # the log lines of the hand-off reach the pipe
                per[s.name].append(st)
                handoffs[s.name].append(handoff_of(s.server.log[seen:]))
                texts[s.name] = st.text
                _progress(f"round {rnd + 1}/{args.rounds} {s.name}: TTFT {st.ttft * 1e3:.0f} ms, "
                          f"{st.decode_tok_s:.1f} tok/s, hand-off {handoffs[s.name][-1]}")
            mismatches += len(set(texts.values())) > 1
    finally:
        for s in stacks:
            s.close()
    rows = []
    for name, xs in per.items():
        hs = [h for h in handoffs[name] if h is not None]
        rows.append({"system": name, "ttft_ms": 1e3 * statistics.median(x.ttft for x in xs),
                     "decode_tok_s": statistics.median(x.decode_tok_s for x in xs), "streams": len(xs),
                     "handoff_ms": statistics.median(h[0] for h in hs) if hs else None,
                     "scatter_ms": statistics.median(h[1] for h in hs) if hs and hs[0][1] is not None else None,
                     "export_ms": statistics.median(h[2] for h in hs) if hs else None,
                     "ack_ms": statistics.median(h[3] for h in hs) if hs else None})
    for r in rows:
        r["decode_ratio"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
        r["ttft_ratio"] = r["ttft_ms"] / rows[0]["ttft_ms"]
    return {"isa": describe("cpu"), "cpus": os.cpu_count(), "load": load, "context": args.context,
            "max_tokens": args.max_tokens, "budget_mb": budgets, "rounds": args.rounds, "mismatches": mismatches,
            "rows": rows}


_HANDOFF = re.compile(r"hand-off ([\d.]+) ms \(export ([\d.]+) ms, then to the decode worker's ack ([\d.]+) ms")
_SCATTER = re.compile(r"(?:scattered and parked in|tokens of KV scattered in) (\d+) ms")


def handoff_of(lines: list[str]) -> tuple[float, float | None, float, float] | None:
    """(hand-off ms, scatter ms or None, export ms, send to ack ms) from a stream's log lines:
    the prefill's hand-off line, the scatter's (the prefill's, or the coordinator's when it
    scattered)."""
    hand = next((m for ln in lines if (m := _HANDOFF.search(ln))), None)
    scat = next((float(m.group(1)) for ln in lines if (m := _SCATTER.search(ln))), None)
    return None if hand is None else (float(hand.group(1)), scat, float(hand.group(2)), float(hand.group(3)))


async def _one(stack: _Stack, prompt: list[int], max_tokens: int):
    async with stack.client() as client:
        return await stack.one(client, "ring", prompt, max_tokens)


def table(res: dict) -> str:
    budgets = ", ".join(f"cpu-ring({n}) {mb} MiB" for n, mb in res["budget_mb"].items())
    lines = [f"Ring vs one worker through the stack: {res['isa']}; {res['cpus']} CPUs (load {res['load']:.1f} at "
             f"start); prompt {res['context']} tokens, {res['max_tokens']} generated (greedy, ignore_eos), "
             f"{res['rounds']} alternating rounds; ring workers' KV budgets {budgets}", "",
             "| system | streams | TTFT p50 ms | hand-off p50 ms | export ms | send to ack ms | scatter ms | "
             "decode tok/s p50 | TTFT ratio | decode ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ms(v) -> str:
        return "" if v is None else f"{v:.0f}"

    for r in res["rows"]:
        lines.append(f"| {r['system']} | {r['streams']} | {r['ttft_ms']:.0f} | {ms(r['handoff_ms'])} | "
                     f"{ms(r['export_ms'])} | {ms(r['ack_ms'])} | {ms(r['scatter_ms'])} | "
                     f"{r['decode_tok_s']:.1f} | {r['ttft_ratio']:.2f} | {r['decode_ratio']:.2f} |")
    lines.append(f"\n- rounds whose texts differ between the systems: {res['mismatches']}")
    return "\n".join(lines)
