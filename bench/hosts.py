"""``tandem bench hosts``: N hosts on one machine, one NATS cluster, and their faults.

    sudo tandem bench hosts [--hosts 3] [--streams 4] [--max-tokens 64] [--json FILE]

Needs root (``ip netns``). Each "host" is a network namespace with its own address and machine id
(as in bench/two_hosts.py), all on one bridge that lives in a namespace of its own (nothing is
added to the machine's own network). Each host runs one nats-server of a cluster
(shared/nats_cluster.py: routes authenticated with the route credential, the role users) and a
share of the services; every service lists every server (``TANDEM_NATS_URL``) and moves to
another when its own dies. Tandem's streams and buckets are R3 (the auto setting).

    host A 10.219.0.1: nats-a, gateway, router-a, prefill-a, kvpool-a
    host B 10.219.0.2: nats-b, router-b, decode-b          (a cpu-decode worker)
    host C 10.219.0.3: nats-c, router-c, decode-c

Requests go through the official ``openai`` client from inside host A; the prompt's KV goes from
prefill on A to a decode worker on B or C over TCP. The phases:

1. **reference**: one greedy completion (the reference text), one stored Response;
2. **NATS server killed**: ``--streams`` concurrent streams; once each has tokens, kill -9 host B's
   nats-server. Every stream must end with the reference text; then the time until a new request
   is served (the acceptance: within 5 s); the stored Response and the prefix index (a router's
   IndexFeed restored from JetStream) read back with a server gone; nats-b restarted (it rejoins);
3. **host C lost**: streams again; kill -9 every process of host C (nats-c, router-c, decode-c):
   its streams resume on host B, every text the reference; a new request served. The routers place
   the streams (the client cannot): while none runs on decode-c, one more is started (up to
   ``--streams`` more), so that the kill takes at least one; the check counts the streams decode-c
   held at the kill (the gateway's log line once a worker took one) and their resumes, by request id;
4. **host C back**: its processes restarted (nats-c with its store and name); requests until the
   routers send work to decode-c again.

Prints one line per phase and the JSON of the run; exit 1 when a check failed (a check that could
not be made, such as no stream on decode-c at the kill, is null and said so, not a failure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import report
from bench.two_hosts import Hosts, _ip

ROOT = Path(__file__).resolve().parent.parent
NAMES = "abcdefgh"
NATS_PORT, ROUTE_PORT, MONITOR_PORT, GATEWAY_PORT = 4222, 6222, 8222, 8000


def addr(i: int) -> str:
    return f"10.219.0.{i + 1}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=3, help="hosts (network namespaces), one NATS server each; >= 3")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams while a fault happens (default 4; "
                   "losing a host, up to as many more while none is on it)")
    p.add_argument("--prompt", type=int, default=600, help="prompt tokens (default 600: two pool chunks)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request (default 64)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")
    p.add_argument("--logs", metavar="DIR", help="keep every service's log in DIR (default: deleted with the run)")


_progress = report.progress("hosts")

# the gateway's log line once a worker took a request (services/gateway/nats_backend.py logs the
# plan's reason then): "[rid] rid: standard -> cpu-decode decode-b (least loaded); prefill on ...",
# "round-robin -> decode-b (turn 0 of 2)", "... (attempt 1)" for a resume
PLACED = re.compile(r"\] (\S+): \S+ -> (?:[\w-]+-decode )?(\S+) \(")
RESUMING = re.compile(r"\] (\S+): .*; resuming at token \d+")


def placements(log: str) -> dict[str, str]:
    """Request id -> the decode worker that last took it (its plan's), from the gateway's log."""
    return {m[1]: m[2] for m in PLACED.finditer(log)}


def resumes(log: str) -> dict[str, int]:
    """Request id -> how often the gateway resumed it, from the gateway's log."""
    out: dict[str, int] = {}
    for m in RESUMING.finditer(log):
        out[m[1]] = out.get(m[1], 0) + 1
    return out


def lost_streams(at_kill: list[dict], log: str, worker: str) -> dict:
    """Of a fault phase's streams (the client's ``at_kill``: each one's id, the worker that held it
    and whether it had ended), those ``worker`` held at the kill, and how many of them the gateway
    resumed (``log``: its log written after the kill). Only the streams' own ids count: a request
    sent after the kill, planned on ``worker`` by a router that had not yet missed it, is not one."""
    on = [s["id"] for s in at_kill if s["worker"] == worker and not s["done"]]
    again = resumes(log)
    return {"on_lost_host": len(on), "resumed": sum(1 for rid in on if again.get(rid)),
            "not_resumed": [rid for rid in on if not again.get(rid)]}


def streams_resumed(phase: dict) -> bool | None:
    """The check of a host's loss: every stream it held resumed elsewhere; None (not made) when it
    held none at the kill."""
    if not phase["on_lost_host"]:
        return None
    return phase["resumed"] == phase["on_lost_host"]


class ClusterHosts(Hosts):
    """N network namespaces on one bridge (in a namespace of its own); service processes inside."""

    def __init__(self, n: int, workdir: str):
        super().__init__(workdir)
        tag = f"tdmh{os.getpid() % 100000}"
        self.ns = {NAMES[i]: f"{tag}{NAMES[i]}" for i in range(n)}
        self.switch = f"{tag}s"

    def __enter__(self) -> "ClusterHosts":
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, (h, ns) in enumerate(self.ns.items()):
                _ip("netns", "add", ns)
                etc = Path("/etc/netns") / ns    # `ip netns exec` mounts these over /etc
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "machine-id").write_text(secrets.token_hex(16) + "\n")
                host_end, port_end = ns + "v", ns + "p"
                _ip("link", "add", host_end, "type", "veth", "peer", "name", port_end)
                _ip("link", "set", host_end, "netns", ns)
                _ip("link", "set", port_end, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port_end, "master", "br0")
                _ip("-n", self.switch, "link", "set", port_end, "up")
                _ip("-n", ns, "addr", "add", f"{addr(i)}/24", "dev", host_end)
                _ip("-n", ns, "link", "set", host_end, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def host_procs(self, host: str) -> list[str]:
        return [name for name in self.procs if name.endswith(f"-{host}")]

    def kill_host(self, host: str) -> list[int]:
        """kill -9 every process of ``host``; their pids."""
        pids = []
        for name in self.host_procs(host):
            p = self.procs.pop(name)
            pids.append(p.pid)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        return pids

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)


def run(n_hosts: int = 3, streams: int = 4, prompt_tokens: int = 600, max_tokens: int = 64,
        keep_logs: str | None = None) -> dict:
    """The four phases (module doc); what each client saw, and the checks."""
    from bench.pool import _text_tokens
    from shared import bus_auth
    from shared.engine.model_files import load_tokenizer
    from shared.nats_cluster import cluster_config

    if n_hosts < 3:
        raise ValueError("--hosts: at least 3 (a cluster that survives a server's loss)")
    tokenizer, _ = load_tokenizer(None)
    prompt = _text_tokens(tokenizer, prompt_tokens)
    hs = [NAMES[i] for i in range(n_hosts)]
    decoders = hs[1:]
    res: dict = {"hosts": {h: addr(i) for i, h in enumerate(hs)}, "streams": streams, "prompt_tokens": prompt_tokens,
                 "max_tokens": max_tokens, "checks": {}}
    with tempfile.TemporaryDirectory(prefix="tandem-hosts-") as work, ClusterHosts(n_hosts, keep_logs or work) as hosts:
        (Path(work) / "prompt.json").write_text(json.dumps(prompt))
        creds_file = os.path.join(work, "nats.creds")
        creds = bus_auth.ensure_creds(creds_file)
        routes = [f"{addr(i)}:{ROUTE_PORT}" for i in range(n_hosts)]
        gateway = f"http://{addr(0)}:{GATEWAY_PORT}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        base.update(PYTHONUNBUFFERED="1", TANDEM_HEARTBEAT_INTERVAL="0.5", TANDEM_THREADS="1",
                    TANDEM_NATS_URL=",".join(f"nats://{addr(i)}:{NATS_PORT}" for i in range(n_hosts)),
                    TANDEM_NATS_CREDS_FILE=creds_file, TANDEM_POOL_KEY=secrets.token_hex(32),
                    TANDEM_DATA_KEY=secrets.token_hex(32), TANDEM_KV_BUDGET_MB="512")
        nats_bin = str(Path(sys.executable).parent / "nats-server")

        def nats(i: int) -> None:
            h = hs[i]
            conf = Path(work) / f"nats-{h}.conf"
            bus_auth.write_private(str(conf), json.dumps(cluster_config(creds, routes, listen=f"{addr(i)}:{ROUTE_PORT}")),
                                   replace=True)
            hosts.start(h, f"nats-{h}", [nats_bin, "-c", str(conf), "-a", addr(i), "-p", str(NATS_PORT), "-n", f"nats-{h}",
                                         "-sd", os.path.join(work, f"js-{h}"), "-m", str(MONITOR_PORT)], base)

        def serve(h: str, name: str, role: str, **env) -> None:
            i = hs.index(h)
            hosts.start(h, name, [sys.executable, "-m", "services.cli", "serve", role],
                        dict(base, TANDEM_WORKER_ID=name, TANDEM_DATA_HOST=addr(i),
                             TANDEM_POOL_DIR=os.path.join(work, f"pool-{h}"), **env))

        def start_host(h: str) -> None:
            serve(h, f"router-{h}", "router")
            serve(h, f"decode-{h}", "cpu-decode")

        def client(phase: str, **kw) -> dict:
            out = hosts.run("a", [sys.executable, "-m", "bench.hosts", "client", phase, "--gateway", gateway,
                                  "--prompt-file", os.path.join(work, "prompt.json"), "--max-tokens", str(max_tokens),
                                  "--args", json.dumps(kw)], base, timeout=900)
            return json.loads(out.strip().splitlines()[-1])

        def wait_cluster() -> None:
            urls = [f"http://{addr(i)}:{MONITOR_PORT}/healthz?js-enabled-only=true" for i in range(n_hosts)
                    if f"nats-{hs[i]}" in hosts.procs]
            client("healthz", urls=urls)

        def gateway_log() -> str:
            return hosts.logs["gateway-a"].read_text(errors="replace")

        try:
            _progress(f"{n_hosts} hosts {res['hosts']}; starting a {n_hosts}-server NATS cluster and the services")
            t0 = time.monotonic()
            for i in range(n_hosts):
                nats(i)
            wait_cluster()
            serve("a", "router-a", "router")
            serve("a", "gateway-a", "gateway", TANDEM_HOST=addr(0), TANDEM_PORT=str(GATEWAY_PORT))
            serve("a", "kvpool-a", "kvpool", TANDEM_POOL_SHARED_DIR=os.path.join(work, "pool-shared"))
            serve("a", "prefill-a", "prefill")
            for h in decoders:
                start_host(h)
            want = {"router": sorted(f"router-{h}" for h in hs), "prefill": ["prefill-a"],
                    "cpu-decode": sorted(f"decode-{h}" for h in decoders)}
            client("ready", want=want)
            res["startup_s"] = round(time.monotonic() - t0, 1)
            ref = client("reference")
            res["reference"] = ref
            _progress(f"reference: {ref['text']!r} (TTFT {ref['ttft_s'] * 1000:.0f} ms); stored response {ref['response_id']}")

            # 2. one host's NATS server killed while streams run
            victim = "b"
            pid = hosts.procs[f"nats-{victim}"].pid
            nk = client("fault", streams=streams, kill=[pid], reference=ref["text"], log=str(hosts.logs["gateway-a"]))
            again = resumes(gateway_log()[nk["log_at_kill"]:])
            nk["resumed"] = sum(1 for s in nk["at_kill"] if again.get(s["id"]))
            hosts.procs.pop(f"nats-{victim}").wait()
            back = client("readback", response_id=ref["response_id"], reference=ref["response_text"])
            nk["readback"] = back
            res["nats_killed"] = nk
            _progress(f"nats-{victim} killed mid-stream: {nk['same']}/{len(nk['texts'])} streams the reference text "
                      f"({nk['resumed']} resumed), "
                      f"a new request served {nk['recovery_s']:.2f} s after the kill; stored response read back: "
                      f"{back['response_ok']}, prefix index: {back['index_keys']} keys ({back['index_mode']})")
            t1 = time.monotonic()
            nats(hs.index(victim))
            wait_cluster()
            nk["rejoined_s"] = round(time.monotonic() - t1, 1)
            _progress(f"nats-{victim} restarted: the cluster healthy again {nk['rejoined_s']} s later")

            # 3. every process of host C killed while streams run
            lost = hs[2]
            pids = [hosts.procs[name].pid for name in hosts.host_procs(lost)]
            hk = client("fault", streams=streams, kill=pids, reference=ref["text"], log=str(hosts.logs["gateway-a"]),
                        watch=f"decode-{lost}", extra=streams)
            hosts.kill_host(lost)
            hk.update(lost_streams(hk["at_kill"], gateway_log()[hk["log_at_kill"]:], f"decode-{lost}"))
            res["host_killed"] = hk
            n = len(hk["texts"])
            on = (f"{hk['on_lost_host']} of {n} streams were on decode-{lost}, {hk['resumed']} of them resumed "
                  f"elsewhere" if hk["on_lost_host"] else
                  f"no stream was on decode-{lost} at the kill ({n} started): the resume was not tested")
            _progress(f"host {lost.upper()} killed (every process): {on}; {hk['same']}/{n} the reference text, "
                      f"a new request served {hk['recovery_s']:.2f} s after the kill")

            # 4. host C back: it rejoins and takes work
            t2 = time.monotonic()
            nats(hs.index(lost))
            wait_cluster()
            start_host(lost)
            client("ready", want=want)
            g0 = len(gateway_log())
            again = client("spread", requests=2 * streams, concurrency=streams, reference=ref["text"])
            again["routed_to_rejoined"] = sum(w == f"decode-{lost}" for w in placements(gateway_log()[g0:]).values())
            again["rejoined_s"] = round(time.monotonic() - t2, 1)
            res["host_back"] = again
            _progress(f"host {lost.upper()} restarted: ready in {again['rejoined_s']} s; {again['routed_to_rejoined']} of "
                      f"{2 * streams} requests went to decode-{lost}; {again['same']} the reference text")
        except BaseException:
            for name in hosts.procs:
                _progress(f"--- {name} ---\n{hosts.tail(name)}")
            raise
        res["kv_over_tcp"] = sorted({m for n in hosts.logs if n == "prefill-a"
                                     for m in re.findall(r"handed to (decode-\w+): \d+ KV bytes over (tcp\S*)",
                                                         hosts.logs[n].read_text(errors="replace"))})
        res["replicas"] = sorted(set(re.findall(r"JetStream (.+?) created with (\d) replica", "".join(
            hosts.logs[n].read_text(errors="replace") for n in hosts.logs if not n.startswith("nats-")))))
    c = res["checks"]
    c["nats_kill_streams_reference"] = res["nats_killed"]["same"] == len(res["nats_killed"]["texts"])
    c["nats_kill_served_within_5s"] = res["nats_killed"]["recovery_s"] <= 5.0
    c["readback_after_server_loss"] = res["nats_killed"]["readback"]["response_ok"] and \
        res["nats_killed"]["readback"]["index_keys"] > 0
    c["host_kill_streams_reference"] = res["host_killed"]["same"] == len(res["host_killed"]["texts"])
    c["host_kill_streams_resumed"] = streams_resumed(res["host_killed"])
    c["host_back_takes_work"] = res["host_back"]["routed_to_rejoined"] > 0 and res["host_back"]["same"] == 2 * streams
    c["streams_r3"] = bool(res["replicas"]) and all(r == "3" for _, r in res["replicas"])
    c["kv_over_tcp"] = bool(res["kv_over_tcp"])
    return res


# ---- the client, run inside host A -----------------------------------------------------------

async def _client(phase: str, args) -> dict:
    import httpx
    import openai

    kw = json.loads(args.args)
    if phase == "healthz":
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient(timeout=2) as http:
            for url in kw["urls"]:
                while True:
                    try:
                        if (await http.get(url)).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{url}: not healthy in 120 s")
                    await asyncio.sleep(0.3)
        return {}
    if phase == "ready":
        deadline = time.monotonic() + 600
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                try:
                    details = (await http.get(args.gateway + "/health")).json().get("details", {})
                    if all(sorted(details.get(r, {}).get("workers", [])) == ids for r, ids in kw["want"].items()):
                        return {}
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers {kw['want']} not live in 600 s")
                await asyncio.sleep(0.3)
    if phase == "readback":
        return await _readback(kw, args)

    prompt = json.loads(Path(args.prompt_file).read_text())
    client = openai.AsyncOpenAI(base_url=args.gateway + "/v1", api_key="hosts", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id

    async def complete(tokens_seen: list | None = None, meta: dict | None = None) -> dict:
        t0, first, text = time.perf_counter(), None, ""
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                 temperature=0, stream=True)
        async for chunk in stream:
            if meta is not None:
                meta["id"] = chunk.id     # the gateway's request id
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter() - t0
                text += chunk.choices[0].text
                if tokens_seen is not None:
                    tokens_seen.append(1)
        return {"text": text, "ttft_s": first or -1.0, "seconds": time.perf_counter() - t0}

    if phase == "reference":
        out = await complete()
        stored = await client.responses.create(model=model, input="Name a colour of the sea.", max_output_tokens=12,
                                               temperature=0, store=True)
        out.update(response_id=stored.id, response_text=stored.output_text)
        return out
    if phase == "spread":
        sem = asyncio.Semaphore(kw["concurrency"])

        async def one() -> str:
            async with sem:
                return (await complete())["text"]
        texts = await asyncio.gather(*(one() for _ in range(kw["requests"])))
        return {"same": sum(t == kw["reference"] for t in texts)}
    if phase == "fault":       # streams; once each has tokens, kill; then the time to a new request served
        # log: the gateway's log (where each stream went); watch: a decode worker: while no stream
        # runs there, one more is started (at most ``extra`` more) before the kill
        watch, log_file = kw.get("watch"), kw.get("log")
        log_at_kill = 0
        seen: list[list] = []
        metas: list[dict] = []
        tasks: list[asyncio.Task] = []
        deadline = time.monotonic() + 300

        async def start(k: int) -> None:   # k more streams; back once each has tokens (or one ended)
            for _ in range(k):
                seen.append([])
                metas.append({})
                tasks.append(asyncio.create_task(complete(seen[-1], metas[-1])))
            new = range(len(tasks) - k, len(tasks))
            while not all(len(seen[i]) >= 2 for i in new):
                if time.monotonic() > deadline or any(tasks[i].done() for i in new):
                    break
                await asyncio.sleep(0.02)

        def held() -> list[dict]:   # each stream's id, the worker that took it, whether it ended
            nonlocal log_at_kill
            text = Path(log_file).read_text(errors="replace") if log_file else ""
            log_at_kill, placed = len(text), placements(text)
            return [{"id": m.get("id", ""), "worker": placed.get(m.get("id", ""), ""), "done": t.done(),
                     "tokens": len(s)} for m, t, s in zip(metas, tasks, seen)]

        await start(kw["streams"])
        while watch and len(tasks) < kw["streams"] + kw.get("extra", 0) and \
                not any(h["worker"] == watch and not h["done"] for h in held()):
            await start(1)
        at_kill = held()
        t_kill = time.monotonic()
        for pid in kw["kill"]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        recovery = None
        while recovery is None and time.monotonic() - t_kill < 120:
            try:
                await asyncio.wait_for(complete(), 60)
                recovery = time.monotonic() - t_kill
            except Exception:
                await asyncio.sleep(0.1)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        texts = [r["text"] if isinstance(r, dict) else f"ERROR {type(r).__name__}: {r}" for r in results]
        return {"tokens_at_kill": [h["tokens"] for h in at_kill], "at_kill": at_kill, "log_at_kill": log_at_kill,
                "texts": texts, "same": sum(t == kw["reference"] for t in texts),
                "recovery_s": round(recovery if recovery is not None else 1e9, 2)}
    raise ValueError(f"unknown phase {phase}")


async def _readback(kw: dict, args) -> dict:
    """The stored Response (the gateway) and the prefix index (a router's feed) with a server gone."""
    import openai

    from services.prefix_index import IndexFeed, PrefixIndex
    from shared.bus import Bus
    from shared.settings import Settings

    client = openai.AsyncOpenAI(base_url=args.gateway + "/v1", api_key="hosts", max_retries=0, timeout=60)
    got, t0 = None, time.monotonic()
    while got is None and time.monotonic() - t0 < 30:
        try:
            got = await client.responses.retrieve(kw["response_id"])
        except openai.APIError:
            await asyncio.sleep(0.5)
    bus = await Bus.connect(Settings.from_env(), name="hosts-readback", role="router")
    feed = IndexFeed(bus, PrefixIndex(), snapshot_every=3600, snapshot_events=10**9)
    try:
        await feed.start()
        return {"response_ok": got is not None and got.output_text == kw["reference"],
                "response_s": round(time.monotonic() - t0, 2), "index_mode": feed.mode,
                "index_keys": len(feed.index), "index_replayed": feed.replayed}
    finally:
        await feed.close()
        await bus.close()


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        _progress("needs root: it creates network namespaces (ip netns)")
        return 2
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    res = run(args.hosts, args.streams, args.prompt, args.max_tokens, keep_logs=args.logs)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    failed = [k for k, ok in res["checks"].items() if ok is False]
    untested = [k for k, ok in res["checks"].items() if ok is None]
    _progress(("all checks passed" if not failed else f"FAILED: {', '.join(failed)}") +
              (f" (not made: {', '.join(untested)})" if untested else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        parser = argparse.ArgumentParser(prog="python -m bench.hosts client")
        parser.add_argument("phase")
        parser.add_argument("--gateway", required=True)
        parser.add_argument("--prompt-file", required=True)
        parser.add_argument("--max-tokens", type=int, required=True)
        parser.add_argument("--args", default="{}")
        a = parser.parse_args(sys.argv[2:])
        print(json.dumps(asyncio.run(_client(a.phase, a))))
    else:
        parser = argparse.ArgumentParser(prog="python -m bench.hosts")
        add_arguments(parser)
        sys.exit(main(parser.parse_args()))
