"""``tandem bench chaos``: a steady load while processes die, and what the clients saw.

    tandem bench chaos                                   # 120 s, 8 clients, a kill every 15 s
    tandem bench chaos --duration 900 --concurrency 16 --kill-every 10 --json chaos.json --plot chaos.png
    tandem bench chaos --duration 1800 --concurrency 16 --kill-every 0 --json soak.json   # the soak
    tandem bench chaos --signal term                     # rolling restarts: each stop a SIGTERM

Starts `tandem up` (embedded NATS, ``--cpu-decode 2``, a prefill worker, a gpu-decode worker, the
router and the KV pool) and keeps ``--concurrency`` clients sending greedy requests through the
official HTTP API with ``ignore_eos`` (so each yields exactly ``--max-tokens`` tokens): the agent
workload's sessions plus a few ~1K-token documents, in a mix of tiers, streamed or not
(``--stream-share``). Every ``--kill-every`` seconds one process of a random role among
``--roles`` (default: prefill, gpu-decode, cpu-decode, kvpool, router and the nats-server; never
the gateway) gets SIGKILL — or, with ``--signal term``, SIGTERM: a graceful stop, as a rolling
update or a scale-down sends (the copy drains, its decodes move to others, ``tandem up`` starts it
again); ``mixed``: either, at random. Every answer is checked against the undisturbed text of its prompt
(taken before the chaos starts) and counted in exactly one class:
- exact: the reference text, ``finish_reason: "length"``;
- clear error: an OpenAI-shaped error (an HTTP error status, or an ``error`` event mid-stream);
- finish outside OpenAI's (e.g. "abort"): an answer a client takes for complete, whatever its text;
- cut short: a proper prefix of the reference with a normal finish; drifted: any other text;
- silent: the connection ended with neither an answer nor an error.
Only exact answers and clear errors are acceptable; the bench exits 1 on anything else. It also
prints resumes, their extra latency, KV tokens reused vs recomputed by them, and per kill the
time until the killed copy is back and until a request is served again (heal). With
``--kill-every 0`` it is the soak: no kills, and the RSS of every service sampled over the run
(flat = no leak). ``--plot PNG`` draws answers per class over time with the kills marked;
``--json FILE`` keeps everything (and the stack's log beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import sys
import time
from pathlib import Path

from bench import report
from bench.cli import at_least
from bench.loadgen import make_jobs, parse_mix
from bench.serve import Server
from shared.nats_server import free_port

ROLES = ("prefill", "gpu-decode", "cpu-decode", "kvpool", "router", "nats")   # what a kill may hit
OPENAI_FINISHES = {"stop", "length", "tool_calls", "content_filter", "function_call"}
CLASSES = ("exact", "error", "abort", "cut_short", "drifted", "silent")   # one per answer (module doc)
BAD = ("abort", "cut_short", "drifted", "silent")                          # never acceptable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=at_least(1, float), default=120.0, help="seconds of load (default 120)")
    p.add_argument("--concurrency", type=at_least(1), default=8, help="clients streaming at once (default 8)")
    p.add_argument("--max-tokens", type=at_least(1), default=48, help="tokens per request (default 48)")
    p.add_argument("--kill-every", type=at_least(0, float), default=15.0,
                   help="seconds between SIGKILLs of a process of a random role (0: none, the soak)")
    p.add_argument("--signal", choices=("kill", "term", "mixed"), default="kill",
                   help="what a kill sends: SIGKILL (default), SIGTERM (a graceful stop: a rolling restart), "
                        "either at random")
    p.add_argument("--roles", default=",".join(ROLES),
                   help=f"roles a kill picks from (default: {','.join(ROLES)}; nats = the embedded nats-server)")
    p.add_argument("--prompts", type=at_least(1), default=12, help="agent-session prompts (references) in the load")
    p.add_argument("--long-prompts", type=at_least(0), default=2, help="~1K-token document prompts in the load")
    p.add_argument("--stream-share", type=float, default=0.5, help="share of requests streamed (default 0.5)")
    p.add_argument("--tiers", default="interactive=1,standard=2,batch=2", help="tier mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(1), default=1, help="TANDEM_THREADS per engine (default 1)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="PNG of requests over time with the kills marked")


# ---- the stack and its processes -------------------------------------------------------------

def _children(root: int) -> dict[int, int]:
    """pid -> parent pid of every process (for walking the stack's tree)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def stack_processes(root: int) -> dict[str, int]:
    """name -> pid of the services (by TANDEM_WORKER_ID) and the nats-server under `tandem up` ``root``."""
    parents = _children(root)
    found = {}
    for pid, ppid in parents.items():
        if ppid != root:
            continue
        try:
            if "(nats-server)" in Path(f"/proc/{pid}/stat").read_text():
                found["nats"] = pid
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        wid = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"TANDEM_WORKER_ID=")), None)
        if wid:
            found[wid] = pid
    return found


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start_stack(threads: int) -> Server:
    port = free_port()
    env = dict(os.environ, TANDEM_PORT=str(port), TANDEM_THREADS=str(threads), TANDEM_KV_BUDGET_MB="128",
               TANDEM_HEARTBEAT_INTERVAL="0.5", PYTHONUNBUFFERED="1")
    env.pop("TANDEM_NATS_URL", None)
    return Server("stack", [sys.executable, "-m", "services.cli", "up", "--cpu-decode", "2"], env, port)


# ---- the load --------------------------------------------------------------------------------

async def one(client, url: str, model: str, job, max_tokens: int, stream: bool = True) -> dict:
    """One request, streamed or not; its text, finish reason, error, latency and resume figures."""
    import orjson
    body = {"model": model, "messages": job.messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "ignore_eos": True}
    t0 = time.monotonic()
    out = {"prompt": job.key, "tier": job.tier, "stream": stream, "start": time.time(), "text": "", "error": "",
           "resumes": 0, "reused": 0, "recomputed": 0, "tokens": 0, "id": "", "finish": None}

    def usage(u: dict | None) -> None:
        if u:
            t = u.get("tandem") or {}
            out.update(tokens=u.get("completion_tokens", 0), resumes=t.get("resumes", 0),
                       reused=t.get("reused_tokens", 0), recomputed=t.get("recomputed_tokens", 0))
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"X-Tandem-SLA": job.tier}, timeout=600) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            elif not stream:
                full = orjson.loads(await r.aread())
                choice = full["choices"][0]
                out.update(id=full.get("id", ""), text=choice["message"].get("content") or "",
                           finish=choice.get("finish_reason"))
                usage(full.get("usage"))
            else:
                done = False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    if not line.startswith("data: {"):
                        continue
                    ev = orjson.loads(line[6:])
                    if "error" in ev:
                        out["error"] = "error event: " + (ev["error"].get("message") or "")
                        break
                    out["id"] = ev.get("id", out["id"])
                    for ch in ev.get("choices", []):
                        out["text"] += ch.get("delta", {}).get("content") or ""
                        out["finish"] = ch.get("finish_reason") or out["finish"]
                    usage(ev.get("usage"))
                if not out["error"] and (not done or out["finish"] is None):
                    out["silent"] = True   # ended without [DONE] or without a finish: neither answer nor error
    except Exception as e:  # a broken connection without an error: silent
        out["error"] = f"connection: {type(e).__name__}: {e}"
        out["silent"] = True
    out["seconds"] = time.monotonic() - t0
    return out


def verdict(r: dict, ref: str) -> str:
    """The class of one answer (CLASSES; the module doc)."""
    if r.get("silent"):
        return "silent"
    if r["error"]:
        return "error"
    if r["finish"] not in OPENAI_FINISHES:
        return "abort"
    if r["text"] == ref and r["finish"] == "length":
        return "exact"
    return "cut_short" if ref.startswith(r["text"]) else "drifted"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def role_of(name: str) -> str:
    """The role of a process of the stack (its worker id, or "nats")."""
    return next((r for r in ROLES if name == r or name.startswith(r + "-")), name)


async def run(args) -> dict:
    import httpx

    rng = random.Random(args.seed)
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    if unknown := set(roles) - set(ROLES):
        raise SystemExit(f"--roles: unknown {sorted(unknown)} (known: {', '.join(ROLES)})")
    stack = start_stack(args.threads)
    try:
        stack.wait_workers({"router": 1, "prefill": 1, "gpu-decode": 1, "cpu-decode": 2}, 600)
        url = stack.url
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.concurrency + 8)) as client:
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
            tiers = parse_mix(args.tiers)
            jobs = [r for job in make_jobs("agent", args.prompts, max_tokens=args.max_tokens, seed=args.seed,
                                           tiers=tiers, turns=4, turn_words=120) for r in job]
            if args.long_prompts:
                jobs += [r for job in make_jobs("long", args.long_prompts, max_tokens=args.max_tokens,
                                                seed=args.seed, tiers=tiers, long_words=700) for r in job]
            for i, j in enumerate(jobs):
                j.key = i
            print(f"references: {len(jobs)} prompts, undisturbed ...", file=sys.stderr)
            refs = {}
            for j in jobs:
                r = await one(client, url, model, j, args.max_tokens)
                if r["error"] or r["finish"] != "length":
                    raise RuntimeError(f"reference run failed: {r['error'] or r['finish']}\n{stack.tail()}")
                refs[j.key] = r["text"]
            results: list[dict] = []
            kills: list[dict] = []
            t_end = time.monotonic() + args.duration
            rss: dict[str, list[tuple[float, float]]] = {}

            async def client_loop(k: int) -> None:
                while time.monotonic() < t_end:
                    job = rng.choice(jobs)
                    r = await one(client, url, model, job, args.max_tokens, stream=rng.random() < args.stream_share)
                    r["end"] = time.time()
                    r["class"] = verdict(r, refs[job.key])
                    if r["class"] in BAD:
                        print(f"chaos: {r['class']}: {r['id'] or '-'} ({'streamed' if r['stream'] else 'unstreamed'}"
                              f", {r['tier']}) finish={r['finish']!r} text={r['text'][:60]!r}", file=sys.stderr)
                    results.append(r)

            async def served_after(t_kill: float) -> float | None:
                """Seconds from the kill until a request that started after it finished exact."""
                while time.monotonic() < t_end + 60:
                    done = [r["end"] for r in results if r["class"] == "exact" and r["start"] > t_kill]
                    if done:
                        return min(done) - t_kill
                    await asyncio.sleep(0.2)
                return None

            def nats_restarts() -> int:
                return sum("embedded nats-server back on" in ln for ln in stack.log)

            async def back_after(name: str, t_kill: float) -> float | None:
                """Seconds until a copy of the killed one (its name, a new worker id) runs again:
                live in the gateway's /health for engines and routers, a process for the pool."""
                # worker ids are <copy name>-<tandem up's pid>[-<restart>]: the same copy, a new id
                base = name.split(f"-{stack.proc.pid}")[0] + f"-{stack.proc.pid}"
                restarts = nats_restarts()
                while time.monotonic() < t_end + 120:
                    if name == "nats":
                        if nats_restarts() > restarts:
                            return time.time() - t_kill
                    elif role_of(name) == "kvpool":
                        if any(n.startswith(base) and n != name for n in stack_processes(stack.proc.pid)):
                            return time.time() - t_kill
                    else:
                        live = stack.health().get("details", {})
                        if any(w.startswith(base) and w != name for role in live.values()
                               for w in role.get("workers", [])):
                            return time.time() - t_kill
                    await asyncio.sleep(0.2)
                return None

            async def chaos() -> None:
                if args.kill_every <= 0:
                    return
                while True:
                    await asyncio.sleep(args.kill_every)
                    if time.monotonic() > t_end - args.kill_every / 2:
                        return
                    procs = stack_processes(stack.proc.pid)
                    by_role: dict[str, list[str]] = {}
                    for n in procs:
                        by_role.setdefault(role_of(n), []).append(n)
                    live = sorted(r for r in roles if by_role.get(r))
                    if not live:
                        continue
                    name = rng.choice(sorted(by_role[rng.choice(live)]))
                    sig = {"kill": "SIGKILL", "term": "SIGTERM"}.get(args.signal) or rng.choice(["SIGKILL", "SIGTERM"])
                    t = time.time()
                    os.kill(procs[name], getattr(signal, sig))
                    print(f"chaos: {sig} to {name} (pid {procs[name]})", file=sys.stderr)
                    kill = {"t": t, "name": name, "role": role_of(name), "signal": sig}
                    kills.append(kill)
                    kill["back_task"] = asyncio.create_task(back_after(name, t))
                    kill["served_task"] = asyncio.create_task(served_after(t))

            async def sample_rss() -> None:
                while time.monotonic() < t_end:
                    for name, pid in stack_processes(stack.proc.pid).items():
                        v = rss_mb(pid)
                        if v is not None:
                            rss.setdefault(re.sub(r"-\d+(-\d+)?$", "", name), []).append((time.time(), v))
                    await asyncio.sleep(max(5.0, args.duration / 60))

            t0 = time.time()
            await asyncio.gather(*(client_loop(k) for k in range(args.concurrency)), chaos(), sample_rss())
            for k in kills:
                k["back_s"] = await k.pop("back_task")
                k["heal_s"] = await k.pop("served_task")
    finally:
        stack.stop()
        if args.json:  # the whole stack's log beside the results, for the failures' story
            Path(args.json).with_suffix(".stack.log").write_text("".join(stack.log))
    return summarize_chaos(args, refs, results, kills, rss, t0)


def summarize_chaos(args, refs: dict, results: list[dict], kills: list[dict], rss: dict, t0: float) -> dict:
    for r in results:
        r.setdefault("class", verdict(r, refs[r["prompt"]]))
    by = {c: [r for r in results if r["class"] == c] for c in CLASSES}
    exact = by["exact"]
    resumed = [r for r in exact if r["resumes"]]
    plain = [r["seconds"] for r in exact if not r["resumes"]]
    base = statistics.median(plain) if plain else float("nan")
    extra = [r["seconds"] - base for r in resumed]
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "requests": len(results), "streamed": sum(1 for r in results if r.get("stream", True)),
        "counts": {c: len(v) for c, v in by.items()}, "resumed": len(resumed),
        "errors": sorted({r["error"][:120] for r in by["error"] + by["silent"]}),
        "bad": [{k: r.get(k) for k in ("class", "id", "stream", "tier", "finish", "text", "start")}
                for r in results if r["class"] in BAD],
        "resumed_extra_s": {"p50": pct(extra, 50), "p99": pct(extra, 99)},
        "median_request_s": base,
        "reused_tokens": sum(r["reused"] for r in resumed), "recomputed_tokens": sum(r["recomputed"] for r in resumed),
        "kills": kills, "rss_mb": {k: v for k, v in rss.items()}, "t0": t0,
        "timeline": [(r["end"] - t0, r["class"], bool(r["resumes"])) for r in results if "end" in r],
    }


def rss_growth(vals: list[float]) -> float:
    """MiB from the warmed-up level (median of the second tenth of the samples) to the end
    (median of the last tenth): about 0 for a service that does not leak."""
    k = max(1, len(vals) // 10)
    return statistics.median(vals[-k:]) - statistics.median(vals[k:2 * k] or vals[:k])


def print_report(res: dict) -> None:
    n, c = res["requests"], res["counts"]
    per_k = f" ({c['error'] / n * 1e3:.2f} per 1,000)" if n else ""
    rows = [
        ("requests (streamed)", f"{n} ({res['streamed']})"), ("exact text", c["exact"]),
        ("... of them resumed after a kill", res["resumed"]),
        ("clear errors (an error status / error event)", f"{c['error']}{per_k}"),
        ("finish_reason outside OpenAI's (\"abort\")", c["abort"]), ("cut short (a prefix, normal finish)", c["cut_short"]),
        ("drifted (not the reference's text)", c["drifted"]), ("silent (neither an answer nor an error)", c["silent"]),
        ("resumed: extra latency p50 / p99 (s)",
         f"{report.fmt(res['resumed_extra_s']['p50'], 2)} / {report.fmt(res['resumed_extra_s']['p99'], 2)}"),
        ("median request (s)", report.fmt(res["median_request_s"], 2)),
        ("KV tokens reused / recomputed by resumes", f"{res['reused_tokens']} / {res['recomputed_tokens']}"),
    ]
    if res["kills"]:
        heal = res["kills"][-1]["heal_s"]
        rows.append(("an exact answer served after the last kill (s)", report.fmt(heal, 1)))
    print("| measure | value |\n|---|---:|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    if res["kills"]:
        roles: dict[str, int] = {}
        for k in res["kills"]:
            roles[k.get("role", role_of(k["name"]))] = roles.get(k.get("role", role_of(k["name"])), 0) + 1
        print("\nkills:", ", ".join(f"{r} ×{m}" for r, m in sorted(roles.items())))
        print("\n| kill | signal | at (s) | copy back after (s) | a request served after (s) |\n"
              "|---|---|---:|---:|---:|")
        for k in res["kills"]:
            print(f"| {k['name']} | {k.get('signal', 'SIGKILL')} | {k['t'] - res['t0']:.1f} | "
                  f"{report.fmt(k['back_s'], 1)} | {report.fmt(k['heal_s'], 1)} |")
    if res["rss_mb"]:
        print("\n| service | RSS first (MiB) | RSS last (MiB) | max | growth after warm-up (MiB) |\n"
              "|---|---:|---:|---:|---:|")
        for name, series in sorted(res["rss_mb"].items()):
            vals = [v for _, v in series]
            print(f"| {name} | {vals[0]:.0f} | {vals[-1]:.0f} | {max(vals):.0f} | {rss_growth(vals):+.1f} |")
    if res["errors"]:
        print("\nerrors seen:", *res["errors"], sep="\n  ")
    for b in res["bad"]:
        print(f"\n{b['class']}: {b['id']} ({'streamed' if b['stream'] else 'unstreamed'}, {b['tier']}) "
              f"finish={b['finish']!r}: {b['text'][:100]!r}")


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    tl = res["timeline"]
    bins = max(10, int(res["config"]["duration"] // 5))
    series = [("exact", lambda c, r: c == "exact" and not r, "tab:green", "exact"),
              ("exact, resumed", lambda c, r: c == "exact" and r, "tab:orange", "exact, resumed"),
              ("error", lambda c, r: c == "error", "tab:blue", "clear error"),
              ("abort", lambda c, r: c == "abort", "tab:red", "finish outside OpenAI's"),
              ("wrong", lambda c, r: c in ("cut_short", "drifted"), "tab:purple", "cut short / drifted"),
              ("silent", lambda c, r: c == "silent", "black", "silent")]
    for _, keep, color, label in series:
        xs = [t for t, c, r in tl if keep(c, r)]
        if xs or label.startswith("exact"):
            ax.hist(xs, bins=bins, range=(0, res["config"]["duration"]), histtype="step", color=color, label=label)
    for k in res["kills"]:
        x = k["t"] - res["t0"]
        ax.axvline(x, color="black", lw=0.6, ls="--")
        ax.text(x, ax.get_ylim()[1] * 0.95, k.get("role", role_of(k["name"])), rotation=90, fontsize=6, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("answers / bin")
    ax.set_title("tandem bench chaos: answers by class over time, kills dashed")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> int:
    res = asyncio.run(run(args))
    print_report(res)
    if args.json:
        report.write_json(args.json, res)
    if args.plot:
        plot(res, args.plot)
    return 1 if any(res["counts"][c] for c in BAD) else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    sys.exit(main(p.parse_args()))
