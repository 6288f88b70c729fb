"""``tandem bench tenants``: one API key's flood beside another key's single request, with the
engine's queue shared fairly between keys and in one arrival-order queue, side by side in one run.

    tandem bench tenants [--flood 48] [--flood-tokens 64] [--rounds 3] [--max-seqs 8]

Two stacks, alive together for the whole run: ``tandem up --prefill 0 --gpu-decode 0 --kvpool 0
--cpu-decode 1`` (one engine: the queue the keys share) with two API keys of the standard tier,
``TANDEM_MAX_SEQS`` sequence slots (small, so that a modest flood queues: the effect is the same
at any cap) and ``TANDEM_FAIR_TENANTS`` 1 (``fair``) or 0 (``fifo``). Each round, on each stack
in turn (the order reversed every other round): key A sends ``--flood`` chats at once
(``--flood-tokens`` out each, greedy, ``ignore_eos``), and 1 s later — the flood queued — key B
sends one short chat (8 tokens out); the round records B's TTFT and the flood's wall time. B's
TTFT alone (no flood) is measured once per stack first. Prints a Markdown table naming the CPU
ISA, and the ratios fifo / fair.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from bench import report
from bench.cli import at_least
from bench.serve import Server, bench_env
from shared.nats_server import free_port

KEYS = {"A": "bench-tenant-a", "B": "bench-tenant-b"}
STACK = ["--prefill", "0", "--gpu-decode", "0", "--kvpool", "0", "--cpu-decode", "1"]
MODEL = "SmolLM2-135M-Instruct"   # the bundled model (run() reads the stacks' own name)
_progress = report.progress("bench tenants")


def start(fair: bool, args: argparse.Namespace) -> Server:
    port = free_port()
    env = dict(bench_env(args.threads), TANDEM_PORT=str(port), TANDEM_MAX_SEQS=str(args.max_seqs),
               TANDEM_FAIR_TENANTS="1" if fair else "0",
               TANDEM_API_KEYS=",".join(f"{k}=standard" for k in KEYS.values()))
    if not args.threads:
        env.pop("TANDEM_THREADS")   # as `tandem up` picks them
    return Server("fair" if fair else "fifo", [sys.executable, "-m", "services.cli", "up", *STACK, "--port", str(port)],
                  env, port)


async def _chat(url: str, key: str, content: str, max_tokens: int) -> tuple[float, float, int]:
    """One streamed chat: (TTFT, seconds to its end, completion tokens)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=900)
    t0 = time.monotonic()
    ttft, tokens = None, 0
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.monotonic() - t0
            tokens += 1
    await client.close()
    if ttft is None:
        raise RuntimeError("a stream ended without content")
    return ttft, time.monotonic() - t0, tokens


async def _round(url: str, tag: str, args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    flood = [asyncio.create_task(_chat(url, KEYS["A"], f"[{tag}.{i}] Tell me about harbour number {i}.",
                                       args.flood_tokens)) for i in range(args.flood)]
    await asyncio.sleep(1.0)
    b_ttft, _, _ = await _chat(url, KEYS["B"], f"[{tag}] What is the capital of France?", 8)
    done = await asyncio.gather(*flood)
    wall = time.monotonic() - t0
    return {"b_ttft": b_ttft, "flood_wall": wall, "flood_tokens": sum(t for _, _, t in done),
            "flood_ttft_median": statistics.median(t for t, _, _ in done)}


def run(args: argparse.Namespace) -> dict:
    servers = {"fair": start(True, args), "fifo": start(False, args)}
    out: dict = {"config": vars(args), "systems": {}}
    try:
        global MODEL
        for s in servers.values():
            s.wait_workers({"cpu-decode": 1, "router": 1})
        import httpx
        MODEL = httpx.get(servers["fair"].url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['A']}"},
                          timeout=10).json()["data"][0]["id"]
        for name, s in servers.items():
            alone = [asyncio.run(_chat(s.url, KEYS["B"], f"[alone {i}] What is the capital of France?", 8))[0]
                     for i in range(3)]
            out["systems"][name] = {"b_alone": statistics.median(alone), "rounds": []}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                got = asyncio.run(_round(servers[name].url, f"{r}{name}", args))
                out["systems"][name]["rounds"].append(got)
                _progress(f"round {r + 1} {name}: B's TTFT {got['b_ttft']:.2f} s beside the flood "
                          f"(flood {got['flood_wall']:.1f} s)")
    finally:
        for s in servers.values():
            s.stop()
    for name, sys_ in out["systems"].items():
        rs = sys_["rounds"]
        sys_["b_ttft"] = statistics.median(x["b_ttft"] for x in rs)
        sys_["flood_tok_s"] = sum(x["flood_tokens"] for x in rs) / sum(x["flood_wall"] for x in rs)
        sys_["flood_ttft_median"] = statistics.median(x["flood_ttft_median"] for x in rs)
    return out


def table(res: dict) -> str:
    from kernels.cpu import isa

    c, sy = res["config"], res["systems"]
    lines = [f"tenants: key A floods {c['flood']} chats of {c['flood_tokens']} tokens, key B sends one 1 s later; "
             f"one cpu-decode engine, {c['max_seqs']} sequence slots, {c['rounds']} rounds; ISA {isa()}", "",
             "| queue | B's TTFT alone (s) | B's TTFT beside A's flood, median (s) | A's flood tok/s | "
             "A's TTFT median (s) |", "|---|---:|---:|---:|---:|"]
    for name, x in sy.items():
        lines.append(f"| {name} | {x['b_alone']:.2f} | {x['b_ttft']:.2f} | {x['flood_tok_s']:.1f} | "
                     f"{x['flood_ttft_median']:.2f} |")
    lines += ["", f"B's TTFT beside the flood, fifo / fair: {sy['fifo']['b_ttft'] / sy['fair']['b_ttft']:.1f}x; "
                  f"the flood's throughput, fair / fifo: {sy['fair']['flood_tok_s'] / sy['fifo']['flood_tok_s']:.2f}"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flood", type=at_least(1), default=48, help="key A's chats sent at once (default 48)")
    p.add_argument("--flood-tokens", type=at_least(1), default=64, help="tokens out per flood chat (default 64)")
    p.add_argument("--rounds", type=at_least(1), default=3, help="rounds per stack, order reversed every other (default 3)")
    p.add_argument("--max-seqs", type=at_least(1), default=8, help="TANDEM_MAX_SEQS of the engine (default 8)")
    p.add_argument("--threads", type=at_least(0), default=0, help="TANDEM_THREADS (default: unset, the engine's own)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    import openai

    try:
        res = run(args)
    except (ValueError, RuntimeError, TimeoutError, ConnectionError, openai.APIError) as e:
        sys.stderr.write(f"bench tenants: {e}\n")
        return 1
    report.emit(res, table, args.json)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="bench.tenants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
