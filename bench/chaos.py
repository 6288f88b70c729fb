"""``tandem bench chaos``: a steady load while processes die, and what the clients saw.

    tandem bench chaos                                   # 120 s, 8 clients, a kill every 15 s, NATS once
    tandem bench chaos --duration 1800 --concurrency 16 --kill-every 0 --json soak.json   # the soak

Starts `tandem up` (embedded NATS, ``--cpu-decode 2``, a prefill worker, a gpu-decode worker and
the KV pool: every kind of worker a kill can hit) and keeps ``--concurrency`` clients streaming
greedy requests of the agent workload in a mix of tiers (bench/loadgen.py), each through the
official HTTP API with ``ignore_eos`` so it yields exactly ``--max-tokens`` tokens. Every
``--kill-every`` seconds a random engine worker (prefill, gpu-decode, cpu-decode) gets SIGKILL;
the embedded nats-server gets one once, halfway. Every response is checked against the
undisturbed text of its prompt (taken before the chaos starts): a stream whose text differs
repeated or skipped tokens. It prints requests completed / resumed / failed, streams with
duplicated or missing tokens (should be 0), the extra latency of resumed requests over the
others (p50, p99), tokens of KV reused vs recomputed by the resumes, and per kill the time until
the killed copy is back and until a request is served again (heal). With ``--kill-every 0`` it is
the soak: no kills, and the RSS of every service sampled over the run (flat = no leak).
``--plot PNG`` draws requests over time with the kills marked; ``--json FILE`` keeps everything.
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
from bench.loadgen import make_jobs, parse_mix
from bench.serve import Server
from shared.nats_server import free_port

ENGINE_ROLES = ("prefill", "gpu-decode", "cpu-decode")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    p.add_argument("--concurrency", type=int, default=8, help="clients streaming at once (default 8)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--kill-every", type=float, default=15.0,
                   help="seconds between SIGKILLs of a random engine worker (0: none, the soak)")
    p.add_argument("--no-nats-kill", action="store_true", help="do not kill the embedded nats-server")
    p.add_argument("--prompts", type=int, default=12, help="distinct prompts (references) in the load")
    p.add_argument("--tiers", default="interactive=1,standard=2,batch=2", help="tier mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="TANDEM_THREADS per engine (default 1)")
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

async def one(client, url: str, model: str, job, max_tokens: int) -> dict:
    """Stream one request; its text, outcome, latency and resume figures."""
    import orjson
    body = {"model": model, "messages": job.messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    out = {"prompt": job.key, "tier": job.tier, "start": time.time(), "text": "", "ok": False, "error": "",
           "resumes": 0, "reused": 0, "recomputed": 0, "tokens": 0, "id": "", "finish": None}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"X-Tandem-SLA": job.tier}, timeout=600) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = orjson.loads(line[6:])
                if "error" in ev:
                    out["error"] = ev["error"].get("message", "error event")
                    break
                out["id"] = ev.get("id", out["id"])
                for ch in ev.get("choices", []):
                    out["text"] += ch.get("delta", {}).get("content") or ""
                    out["finish"] = ch.get("finish_reason") or out["finish"]
                    out["ok"] = out["ok"] or ch.get("finish_reason") == "length"
                if ev.get("usage"):
                    out["tokens"] = ev["usage"].get("completion_tokens", 0)
                    t = ev["usage"].get("tandem") or {}
                    out.update(resumes=t.get("resumes", 0), reused=t.get("reused_tokens", 0),
                               recomputed=t.get("recomputed_tokens", 0))
    except Exception as e:  # a broken connection without an error event: counted as silent loss
        out["error"] = f"connection: {type(e).__name__}: {e}"
        out["silent"] = True
    if not out["ok"] and not out["error"]:  # ended, but not as asked (ignore_eos: always "length")
        out["error"] = f"ended with finish_reason={out['finish']!r} after {out['tokens']} tokens"
        out["silent"] = True
    out["seconds"] = time.monotonic() - t0
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def run(args) -> dict:
    import httpx

    rng = random.Random(args.seed)
    stack = start_stack(args.threads)
    try:
        stack.wait_workers({"router": 1, "prefill": 1, "gpu-decode": 1, "cpu-decode": 2}, 600)
        url = stack.url
        async with httpx.AsyncClient() as client:
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
            jobs = [r for job in make_jobs("agent", args.prompts, max_tokens=args.max_tokens, seed=args.seed,
                                           tiers=parse_mix(args.tiers), turns=4, turn_words=120) for r in job]
            for i, j in enumerate(jobs):
                j.key = i
            print(f"references: {len(jobs)} prompts, undisturbed ...", file=sys.stderr)
            refs = {}
            for j in jobs:
                r = await one(client, url, model, j, args.max_tokens)
                if not r["ok"]:
                    raise RuntimeError(f"reference run failed: {r['error']}\n{stack.tail()}")
                refs[j.key] = r["text"]
            results: list[dict] = []
            kills: list[dict] = []
            t_end = time.monotonic() + args.duration
            rss: dict[str, list[tuple[float, float]]] = {}

            async def client_loop(k: int) -> None:
                while time.monotonic() < t_end:
                    r = await one(client, url, model, rng.choice(jobs), args.max_tokens)
                    r["end"] = time.time()
                    results.append(r)

            async def served_after(t_kill: float) -> float | None:
                """Seconds from the kill until a request that started after it finished."""
                while time.monotonic() < t_end + 60:
                    done = [r["end"] for r in results if r["ok"] and r["start"] > t_kill]
                    if done:
                        return min(done) - t_kill
                    await asyncio.sleep(0.2)
                return None

            async def back_after(name: str, t_kill: float) -> float | None:
                """Seconds until a copy of the killed one (its name, a new worker id) runs again."""
                # worker ids are <copy name>-<tandem up's pid>[-<restart>]: the same copy, a new id
                base = name.split(f"-{stack.proc.pid}")[0] + f"-{stack.proc.pid}"
                while time.monotonic() < t_end + 120:
                    if name == "nats":
                        if "embedded nats-server back on" in "".join(stack.log[-400:]):
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
                nats_at = time.monotonic() + args.duration / 2 if not args.no_nats_kill else None
                while True:
                    await asyncio.sleep(args.kill_every)
                    if time.monotonic() > t_end - args.kill_every / 2:
                        return
                    procs = stack_processes(stack.proc.pid)
                    if nats_at is not None and time.monotonic() >= nats_at and "nats" in procs:
                        name, nats_at = "nats", None
                    else:
                        engines = [n for n in procs if n.split("-")[0] in ("prefill",)
                                   or n.startswith(("gpu-decode", "cpu-decode"))]
                        if not engines:
                            continue
                        name = rng.choice(sorted(engines))
                    t = time.time()
                    os.kill(procs[name], signal.SIGKILL)
                    print(f"chaos: killed {name} (pid {procs[name]})", file=sys.stderr)
                    kill = {"t": t, "name": name}
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
    ok = [r for r in results if r["ok"]]
    wrong = [r for r in ok if r["text"] != refs[r["prompt"]]]
    failed = [r for r in results if not r["ok"]]
    silent = [r for r in failed if r.get("silent")]
    resumed = [r for r in ok if r["resumes"]]
    plain = [r["seconds"] for r in ok if not r["resumes"]]
    base = statistics.median(plain) if plain else float("nan")
    extra = [r["seconds"] - base for r in resumed]
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "requests": len(results), "completed": len(ok), "resumed": len(resumed), "failed": len(failed),
        "failed_silently": len(silent), "wrong_text": len(wrong),
        "errors": sorted({r["error"][:120] for r in failed}),
        "resumed_extra_s": {"p50": pct(extra, 50), "p99": pct(extra, 99)},
        "median_request_s": base,
        "reused_tokens": sum(r["reused"] for r in resumed), "recomputed_tokens": sum(r["recomputed"] for r in resumed),
        "kills": kills, "rss_mb": {k: v for k, v in rss.items()}, "t0": t0,
        "timeline": [(r["end"] - t0, r["ok"], bool(r["resumes"])) for r in results if "end" in r],
    }


def rss_growth(vals: list[float]) -> float:
    """MiB from the warmed-up level (median of the second tenth of the samples) to the end
    (median of the last tenth): about 0 for a service that does not leak."""
    k = max(1, len(vals) // 10)
    return statistics.median(vals[-k:]) - statistics.median(vals[k:2 * k] or vals[:k])


def print_report(res: dict) -> None:
    rows = [
        ("requests", res["requests"]), ("completed (exact text)", res["completed"] - res["wrong_text"]),
        ("resumed after a kill", res["resumed"]), ("failed with an error event / status", res["failed"]),
        ("failed silently (no error)", res["failed_silently"]),
        ("duplicated or missing tokens (text differs)", res["wrong_text"]),
        ("resumed: extra latency p50 / p99 (s)",
         f"{report.fmt(res['resumed_extra_s']['p50'], 2)} / {report.fmt(res['resumed_extra_s']['p99'], 2)}"),
        ("median request (s)", report.fmt(res["median_request_s"], 2)),
        ("KV tokens reused / recomputed by resumes", f"{res['reused_tokens']} / {res['recomputed_tokens']}"),
    ]
    print("| measure | value |\n|---|---:|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    if res["kills"]:
        print("\n| kill | at (s) | copy back after (s) | a request served after (s) |\n|---|---:|---:|---:|")
        for k in res["kills"]:
            print(f"| {k['name']} | {k['t'] - res['t0']:.1f} | {report.fmt(k['back_s'], 1)} | "
                  f"{report.fmt(k['heal_s'], 1)} |")
    if res["rss_mb"]:
        print("\n| service | RSS first (MiB) | RSS last (MiB) | max | growth after warm-up (MiB) |\n"
              "|---|---:|---:|---:|---:|")
        for name, series in sorted(res["rss_mb"].items()):
            vals = [v for _, v in series]
            print(f"| {name} | {vals[0]:.0f} | {vals[-1]:.0f} | {max(vals):.0f} | {rss_growth(vals):+.1f} |")
    if res["errors"]:
        print("\nerrors seen:", *res["errors"], sep="\n  ")


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    tl = res["timeline"]
    for ok, resumed, color, label in ((True, False, "tab:green", "completed"), (True, True, "tab:orange", "resumed"),
                                      (False, False, "tab:red", "failed")):
        xs = [t for t, o, r in tl if o == ok and (r == resumed or not ok)]
        ax.hist(xs, bins=max(10, int(res["config"]["duration"] // 5)), histtype="step", color=color, label=label)
    for k in res["kills"]:
        x = k["t"] - res["t0"]
        ax.axvline(x, color="black", lw=0.8, ls="--")
        ax.text(x, ax.get_ylim()[1] * 0.95, k["name"].split("-")[0], rotation=90, fontsize=7, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests finished / bin")
    ax.set_title("tandem bench chaos: requests over time, kills dashed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> int:
    res = asyncio.run(run(args))
    print_report(res)
    if args.json:
        report.write_json(args.json, res)
    if args.plot:
        plot(res, args.plot)
    bad = res["failed_silently"] + res["wrong_text"]
    return 1 if bad else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    sys.exit(main(p.parse_args()))
