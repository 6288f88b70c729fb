"""``tandem bench stack``: the stack against the engine it runs, side by side in one run.

    tandem bench stack [--concurrency 1 16] [--max-tokens 256] [--rounds 3] [--stacks minimal default]

Systems, all alive in one process tree for the whole run:

- ``engine``: the in-process engine in this process (``AsyncEngine(Engine)`` configured exactly
  as a cpu-decode worker, ``services.worker.engine_config``, from the same environment), its
  outputs consumed by a coroutine: the ceiling the stack is held to;
- ``stack-minimal``: ``tandem up --prefill 0 --gpu-decode 0 --kvpool 0 --cpu-decode 1``: NATS,
  router, one cpu-decode worker (it prefills and decodes), gateway: just what a stream needs;
- ``stack-default``: ``tandem up`` as it starts with no flags (prefill, gpu-decode on the CPU
  when there is no GPU, cpu-decode, KV pool, router, gateway).

The stacks are streamed through the official ``openai`` client (``/v1/completions``,
``stream=True``, the prompt as token ids so that every system gets the same tokens, greedy,
``ignore_eos``). Each load level (``--concurrency``: that many streams at once, one request
each) runs ``--rounds`` times on every system, the order reversed every other round so that
load drift on a shared machine hits all alike; every (round, stream) gets its own prompt, the
same on every system, and the generated texts must agree (greedy output is exact).

Per stream: TTFT = first token (engine: first output; stack: first content chunk) − send;
decode tok/s = (tokens − 1) / (last − first token). Per level: aggregate tok/s = all tokens /
wall (first send to last token), pooled over rounds. Ratios are stack / engine; the TTFT
overhead is the difference of the medians. Prints a Markdown table naming the CPU ISA.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from bench.serve import Server
from shared.nats_server import free_port
from shared.os_priority import engine_threads
from bench import report
from bench.cli import at_least

STACKS = {  # name -> `tandem up` arguments
    "minimal": ["--prefill", "0", "--gpu-decode", "0", "--kvpool", "0", "--cpu-decode", "1"],
    "default": [],
}
TARGETS = {"c1_decode": 0.95, "aggregate": 0.90, "ttft_overhead_ms": 15.0}  # issue 15's acceptance
PROMPT_TEXT = ("A lighthouse keeper kept a log of every ship that passed the rocks, the weather, the state of "
               "the lamp and the small events of a life lived alone at the edge of the sea. ")


@dataclass
class Stream:
    ttft: float                # seconds, send -> first token
    tokens: int                # completion tokens
    decode_tok_s: float        # (tokens - 1) / (last - first token)
    t_send: float              # perf_counter at send
    t_last: float              # perf_counter of the last token
    text: str = field(default="", repr=False)


_progress = report.progress("bench stack")


def _stream(t_send: float, times: list[float], tokens: int, text: str) -> Stream:
    if not times:
        raise RuntimeError("a stream ended without a token")
    span = times[-1] - times[0]
    rate = (tokens - 1) / span if tokens > 1 and span > 0 else float("nan")
    return Stream(times[0] - t_send, tokens, rate, t_send, times[-1], text)


# ---- the systems -----------------------------------------------------------------------------

class EngineSystem:
    """The in-process engine, built as a cpu-decode worker builds its own."""

    name = "engine"

    def __init__(self, threads: int):
        from services.worker import engine_config
        from shared import subjects
        from shared.engine.async_engine import AsyncEngine
        from shared.engine.engine import Engine
        from shared.settings import Settings

        settings = Settings.from_env(dict(os.environ, TANDEM_THREADS=str(threads)))
        self.engine = AsyncEngine(Engine.from_path(settings.worker.model,
                                                   engine_config(settings, "cpu", subjects.CPU_DECODE)))
        self.tokenizer = self.engine.tokenizer

    async def one(self, rid: str, prompt: list[int], max_tokens: int) -> Stream:
        from shared.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        times, parts, tokens = [], [], 0
        t_send = time.perf_counter()
        async for out in await self.engine.submit(rid, prompt, params):
            if out.token_ids:
                times.append(time.perf_counter())
                tokens += len(out.token_ids)
            parts.append(out.text)
        return _stream(t_send, times, tokens, "".join(parts))

    def close(self) -> None:
        asyncio.run(self.engine.close())


class StackSystem:
    """A ``tandem up`` in its own process group, streamed through the openai client."""

    def __init__(self, kind: str, env: dict):
        self.name = f"stack-{kind}"
        port = free_port()
        argv = [sys.executable, "-m", "services.cli", "up", *STACKS[kind], "--port", str(port)]
        self.server = Server(self.name, argv, dict(env, TANDEM_PORT=str(port)), port)
        self.kind = kind
        self.model = ""

    def wait_ready(self) -> None:
        want = {"cpu-decode": 1, "router": 1}
        if self.kind == "default":
            want.update({"prefill": 1, "gpu-decode": 1})
        self.server.wait_workers(want)
        import httpx

        self.model = httpx.get(self.server.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def client(self):
        import httpx
        import openai

        return openai.AsyncOpenAI(base_url=self.server.url + "/v1", api_key="bench", max_retries=0,
                                  http_client=httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)))

    async def one(self, client, rid: str, prompt: list[int], max_tokens: int) -> Stream:
        times, parts, tokens = [], [], 0
        t_send = time.perf_counter()
        stream = await client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
                parts.append(chunk.choices[0].text)
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return _stream(t_send, times, tokens, "".join(parts))

    def close(self) -> None:
        rc = self.server.stop()
        if rc not in (0, -15):
            _progress(f"{self.name} exited with {rc}:\n{self.server.tail()}")


async def run_level(system, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list[Stream], float]:
    """All ``prompts`` at once on ``system``: the streams and the wall (first send to last token)."""
    t0 = time.perf_counter()
    if isinstance(system, EngineSystem):
        streams = await asyncio.gather(*(system.one(f"{tag}-{i}", p, max_tokens) for i, p in enumerate(prompts)))
    else:
        async with system.client() as client:
            streams = await asyncio.gather(*(system.one(client, f"{tag}-{i}", p, max_tokens)
                                             for i, p in enumerate(prompts)))
    return list(streams), max(s.t_last for s in streams) - t0


# ---- the run ---------------------------------------------------------------------------------

def prompts_for(tokenizer, n: int, length: int, salt: str) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, different from each other (no prefix-cache hits)."""
    out = []
    for i in range(n):
        ids = tokenizer.encode(f"[{salt}-{i}] " + PROMPT_TEXT * (length // 20 + 2))[:length]
        out.append(ids)
    return out


def summarize(streams: list[Stream], walls: list[float]) -> dict:
    ttft = sorted(s.ttft * 1e3 for s in streams)
    rates = [s.decode_tok_s for s in streams]
    return {"streams": len(streams), "tokens": sum(s.tokens for s in streams),
            "ttft_p50_ms": statistics.median(ttft), "ttft_p90_ms": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "decode_tok_s_p50": statistics.median(rates), "decode_tok_s_min": min(rates),
            "aggregate_tok_s": sum(s.tokens for s in streams) / sum(walls)}


def run(args: argparse.Namespace) -> dict:
    from kernels.dispatch import describe

    if min(args.concurrency) < 1 or args.max_tokens < 2 or args.rounds < 1 or args.prompt_tokens < 1:
        raise ValueError("--concurrency and --rounds must be >= 1, --max-tokens >= 2, --prompt-tokens >= 1")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TANDEM_NATS_URL", None)  # each stack gets its own embedded NATS
    if args.threads:
        env["TANDEM_THREADS"] = str(args.threads)
    # the in-process engine gets the threads `tandem up` gives a cpu-decode worker (like for like)
    threads = args.threads or engine_threads("cpu-decode", len(os.sched_getaffinity(0)))
    stacks = [StackSystem(kind, env) for kind in args.stacks]
    systems: list = []
    try:
        _progress(f"starting {', '.join(s.name for s in stacks)}; loading the in-process engine")
        systems.append(EngineSystem(threads))
        isa = describe("cpu")
        for s in stacks:
            s.wait_ready()
            systems.append(s)
        tok = systems[0].tokenizer
        _progress("warm-up")
        for s in systems:
            for c in sorted(set(args.concurrency)):
                asyncio.run(run_level(s, prompts_for(tok, c, args.prompt_tokens, f"warm{c}"), 16, f"warm-{s.name}-{c}"))
        load = os.getloadavg()[0]
        results: dict[tuple[str, int], dict] = {}
        mismatches = 0
        for c in args.concurrency:
            per: dict[str, tuple[list[Stream], list[float]]] = {s.name: ([], []) for s in systems}
            for rnd in range(args.rounds):
                prompts = prompts_for(tok, c, args.prompt_tokens, f"r{rnd}c{c}")
                texts = {}
                for s in (systems if rnd % 2 == 0 else systems[::-1]):
                    streams, wall = asyncio.run(run_level(s, prompts, args.max_tokens, f"{s.name}-c{c}-r{rnd}"))
                    per[s.name][0].extend(streams)
                    per[s.name][1].append(wall)
                    texts[s.name] = [x.text for x in streams]
                    _progress(f"c={c} round {rnd + 1}/{args.rounds} {s.name}: "
                              f"{statistics.median(x.decode_tok_s for x in streams):.1f} tok/s per stream, "
                              f"{sum(x.tokens for x in streams) / wall:.1f} aggregate")
                ref = texts["engine"]
                for name, t in texts.items():
                    bad = sum(a != b for a, b in zip(ref, t))
                    if bad:
                        mismatches += bad
                        _progress(f"c={c} round {rnd + 1}: {bad} stream(s) of {name} differ from the engine's text")
            for name, (streams, walls) in per.items():
                results[(name, c)] = {"system": name, "concurrency": c, **summarize(streams, walls)}
    finally:
        for s in systems[1:] or stacks:
            s.close()
        if systems:
            systems[0].close()
    rows = list(results.values())
    for r in rows:
        base = results[("engine", r["concurrency"])]
        r["decode_ratio"] = r["decode_tok_s_p50"] / base["decode_tok_s_p50"]
        r["aggregate_ratio"] = r["aggregate_tok_s"] / base["aggregate_tok_s"]
        r["ttft_overhead_ms"] = r["ttft_p50_ms"] - base["ttft_p50_ms"]
    return {"isa": isa, "cpus": os.cpu_count(), "loadavg_1m_at_start": load,
            "threads": args.threads or f"default (cpu-decode: {threads})",
            "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
            "text_mismatches": mismatches, "rows": rows}


def table(res: dict) -> str:
    lines = [f"Stack vs in-process engine: {res['isa']}; {res['cpus']} CPUs (load {res['loadavg_1m_at_start']:.1f} "
             f"at start); prompt {res['prompt_tokens']} tokens, {res['max_tokens']} generated (greedy, ignore_eos), "
             f"{res['rounds']} alternating rounds; TANDEM_THREADS {res['threads']}", "",
             "| system | c | streams | TTFT p50 ms | TTFT p90 ms | decode tok/s per stream (p50) | min | "
             "aggregate tok/s | decode ratio | aggregate ratio | TTFT overhead ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['system']} | {r['concurrency']} | {r['streams']} | {r['ttft_p50_ms']:.1f} | "
                     f"{r['ttft_p90_ms']:.1f} | {r['decode_tok_s_p50']:.1f} | {r['decode_tok_s_min']:.1f} | "
                     f"{r['aggregate_tok_s']:.1f} | {r['decode_ratio']:.3f} | {r['aggregate_ratio']:.3f} | "
                     f"{r['ttft_overhead_ms']:+.1f} |")
    lines.append("")
    for r in res["rows"]:
        if r["system"] == "engine":
            continue
        checks = []
        if r["concurrency"] == 1:
            checks.append(f"decode {r['decode_ratio']:.3f} (target >= {TARGETS['c1_decode']}: "
                          f"{'met' if r['decode_ratio'] >= TARGETS['c1_decode'] else 'NOT met'})")
            checks.append(f"TTFT overhead {r['ttft_overhead_ms']:+.1f} ms (target <= {TARGETS['ttft_overhead_ms']:g}: "
                          f"{'met' if r['ttft_overhead_ms'] <= TARGETS['ttft_overhead_ms'] else 'NOT met'})")
        else:
            checks.append(f"aggregate {r['aggregate_ratio']:.3f} (target >= {TARGETS['aggregate']}: "
                          f"{'met' if r['aggregate_ratio'] >= TARGETS['aggregate'] else 'NOT met'})")
        lines.append(f"- {r['system']} c={r['concurrency']}: " + "; ".join(checks))
    lines.append(f"- generated texts differing from the engine's: {res['text_mismatches']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="streams at once (default 1 16)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per stream (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens (default 32)")
    p.add_argument("--rounds", type=at_least(1), default=3, help="rounds per level, order reversed every other (default 3)")
    p.add_argument("--stacks", nargs="+", choices=list(STACKS), default=list(STACKS),
                   help="which stacks to hold against the engine (default: minimal default)")
    p.add_argument("--threads", type=at_least(0), default=0,
                   help="TANDEM_THREADS for every engine, in-process and stack (default: unset, the engine's own)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    try:
        res = run(args)
    except (ValueError, RuntimeError, TimeoutError) as e:
        sys.stderr.write(f"bench stack: {e}\n")
        return 1
    report.emit(res, table, args.json)
    return 1 if res["text_mismatches"] else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="bench.stack", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
