"""``tandem bench two-hosts``: two hosts on one machine — prefill on one, decode on the other.

    sudo tandem bench two-hosts [--prompt 1100] [--max-tokens 24] [--json FILE]

Needs root (``ip netns``). Two network namespaces joined by a veth pair, each address inside its
namespace only, are the two "hosts"; each has its own ``/etc/machine-id`` (``ip netns exec``
bind-mounts ``/etc/netns/<ns>/machine-id``), so the data plane's hello (``shared/transfer/link.py``)
sees two hosts, as it would two machines, and its link detection reads the veth's reported speed
from the namespace's sysfs. Every service runs as ``tandem serve ROLE`` inside ``ip netns exec``;
NATS (a nats-server bound to host A's address) is reached by both. Traffic stays inside the two
namespaces and their loopbacks; everything is torn down on the way out, also on failure.

    host A (10.217.0.1)                              host B (10.217.0.2)
    nats-server, router, gateway, kvpool, prefill  ── veth ──  cpu-decode

Three phases, one prompt (``--prompt`` tokens, greedy, ``--max-tokens``), each request sent by the
official ``openai`` client from inside host A (``client``, below), which also collects every
``TransferEvent`` (``tandem.transfer.>``) and the pool's ``KVEvent``s while the request runs:

1. **single host**: one colocated cpu-decode worker on host A, pool off — the reference text;
2. **two hosts**: prefill on A, cpu-decode on B, the KV pool on A: the prompt's KV goes A → B over
   the data plane (the path must be TCP, not shm), the prefill worker writes the prompt's chunks
   to the pool, the decode worker the finished sequence's;
3. **the other host warm**: prefill on A stopped, the decode worker on B restarted (an empty
   engine): it prefills itself and gets the prefix from the pool on A — a warm hit (cached
   tokens), the entries over TCP.

The text must be the same in all three. Prints one line per phase and the JSON of the run.
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

ROOT = Path(__file__).resolve().parent.parent
ADDR = {"a": "10.217.0.1", "b": "10.217.0.2"}
NATS_PORT, GATEWAY_PORT = 4222, 8000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", type=int, default=1100, help="prompt tokens (default 1100: 4 pool chunks)")
    p.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per request (default 24)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")


_progress = report.progress("two-hosts")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Two network namespaces "a" and "b" on a veth pair; service processes inside them."""

    def __init__(self, workdir: str):
        tag = f"tdm{os.getpid() % 100000}"
        self.ns = {"a": f"{tag}a", "b": f"{tag}b"}
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def __enter__(self) -> "Hosts":
        try:
            for h, ns in self.ns.items():
                _ip("netns", "add", ns)
                etc = Path("/etc/netns") / ns    # `ip netns exec` mounts these over /etc
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "machine-id").write_text(secrets.token_hex(16) + "\n")
            va, vb = self.ns["a"] + "v", self.ns["b"] + "v"
            _ip("link", "add", va, "type", "veth", "peer", "name", vb)
            for h, dev in (("a", va), ("b", vb)):
                _ip("link", "set", dev, "netns", self.ns[h])
                _ip("-n", self.ns[h], "addr", "add", f"{ADDR[h]}/24", "dev", dev)
                _ip("-n", self.ns[h], "link", "set", dev, "up")
                _ip("-n", self.ns[h], "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def start(self, host: str, name: str, argv: list[str], env: dict) -> None:
        log = Path(self.workdir) / f"{name}.log"
        self.logs[name] = log
        with open(log, "ab") as out:
            self.procs[name] = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], env=env, cwd=ROOT,
                                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def stop(self, name: str, timeout: float = 60) -> int:
        p = self.procs.pop(name)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return p.returncode

    def wait_log(self, name: str, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.logs[name].read_text(errors="replace"):
                return
            if self.procs[name].poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"{name}: no {text!r} in its log:\n{self.tail(name)}")

    def tail(self, name: str, n: int = 30) -> str:
        return "".join(self.logs[name].read_text(errors="replace").splitlines(True)[-n:])

    def run(self, host: str, argv: list[str], env: dict, timeout: float) -> str:
        res = subprocess.run(["ip", "netns", "exec", self.ns[host], *argv], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=timeout)
        if res.returncode:
            raise RuntimeError(f"{' '.join(argv[:4])} failed ({res.returncode}):\n{res.stderr[-4000:]}")
        return res.stdout

    def __exit__(self, *exc) -> None:
        for name in list(self.procs):
            try:
                self.stop(name, timeout=20)
            except OSError:
                pass
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)   # takes its veth end along
            subprocess.run(["rm", "-rf", str(Path("/etc/netns") / ns)], capture_output=True)


def run(prompt_tokens: int = 1100, max_tokens: int = 24, keep_logs: str | None = None) -> dict:
    """The three phases (module doc); returns what each client saw plus the service logs' tails."""
    from bench.pool import _text_tokens
    from shared.engine.model_files import load_tokenizer

    tokenizer, _ = load_tokenizer(None)
    prompt = _text_tokens(tokenizer, prompt_tokens)
    chunks = prompt_tokens // 256
    with tempfile.TemporaryDirectory(prefix="tandem-two-hosts-") as work, Hosts(keep_logs or work) as hosts:
        (Path(work) / "prompt.json").write_text(json.dumps(prompt))
        nats_url = f"nats://{ADDR['a']}:{NATS_PORT}"
        gateway = f"http://{ADDR['a']}:{GATEWAY_PORT}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        base.update(PYTHONUNBUFFERED="1", TANDEM_NATS_URL=nats_url, TANDEM_HEARTBEAT_INTERVAL="0.5",
                    TANDEM_THREADS="1", TANDEM_POOL_KEY=secrets.token_hex(32), TANDEM_KV_BUDGET_MB="512",
                    TANDEM_POOL_DIR=os.path.join(work, "pool"), TANDEM_POOL_RAM_MB="0",
                    TANDEM_NATS_STORE_DIR=os.path.join(work, "js"))
        nats_bin = str(Path(sys.executable).parent / "nats-server")
        hosts.start("a", "nats", [nats_bin, "-a", ADDR["a"], "-p", str(NATS_PORT), "-js", "-sd",
                                  os.path.join(work, "js")], base)
        hosts.wait_log("nats", "Server is ready")

        def serve(host: str, name: str, role: str, **env) -> None:
            hosts.start(host, name, [sys.executable, "-m", "services.cli", "serve", role],
                        dict(base, TANDEM_WORKER_ID=name, TANDEM_DATA_HOST=ADDR[host], **env))

        def client(phase: str, want: dict[str, list[str]], pool_chunks: int = 0) -> dict:
            out = hosts.run("a", [sys.executable, "-m", "bench.two_hosts", "client", "--gateway", gateway,
                                  "--want", json.dumps(want), "--prompt-file", os.path.join(work, "prompt.json"),
                                  "--max-tokens", str(max_tokens), "--pool-chunks", str(pool_chunks)],
                            base, timeout=900)
            res = json.loads(out.strip().splitlines()[-1])
            paths = sorted({f"{t['reporter']}: {t['path']}" for t in res["transfers"]})
            _progress(f"{phase}: cached {res['cached']}, TTFT {res['ttft_s'] * 1000:.0f} ms, transfers {paths}")
            return res

        try:
            _progress(f"namespaces {hosts.ns['a']} ({ADDR['a']}) and {hosts.ns['b']} ({ADDR['b']}); "
                      f"{prompt_tokens}-token prompt")
            serve("a", "router-a", "router")
            serve("a", "gateway-a", "gateway", TANDEM_HOST=ADDR["a"], TANDEM_PORT=str(GATEWAY_PORT))
            serve("a", "decode-a", "cpu-decode", TANDEM_POOL="0")
            single = client("single host", {"router": ["router-a"], "cpu-decode": ["decode-a"]})
            hosts.stop("decode-a")
            serve("a", "kvpool-a", "kvpool")
            serve("a", "prefill-a", "prefill")
            # host B does not see host A's disk (two real hosts would not): its pool reads go over the network
            serve("b", "decode-b", "cpu-decode", TANDEM_POOL_LOCAL_READ="0")
            split = client("two hosts", {"prefill": ["prefill-a"], "cpu-decode": ["decode-b"]}, pool_chunks=chunks)
            hosts.stop("prefill-a")
            hosts.stop("decode-b")
            serve("b", "decode-b2", "cpu-decode", TANDEM_POOL_LOCAL_READ="0")
            warm = client("other host warm", {"prefill": [], "cpu-decode": ["decode-b2"]})
        except BaseException:
            for name in hosts.procs:
                _progress(f"--- {name} ---\n{hosts.tail(name)}")
            raise
        links = [dict(service=name, **_link(line)) for name in ("prefill-a", "decode-b", "decode-b2", "kvpool-a")
                 if name in hosts.logs for line in hosts.logs[name].read_text(errors="replace").splitlines()
                 if "data plane link to" in line]
    return {"prompt_tokens": prompt_tokens, "chunks": chunks, "single": single, "two_hosts": split,
            "other_host_warm": warm, "links": links, "addresses": ADDR}


def _link(line: str) -> dict:
    """A sender's ``data plane link to HOST:PORT: Link(same_host=…, gbps=…, source='…')`` log line."""
    m = re.search(r"link to ([\d.]+):\d+: Link\(same_host=(\w+), gbps=([\w.]+), source='(\w+)'\)", line)
    if m is None:
        raise ValueError(f"not a link line: {line}")
    return {"peer": m[1], "same_host": m[2] == "True", "gbps": None if m[3] == "None" else float(m[3]),
            "source": m[4]}


# ---- the client, run inside host A -----------------------------------------------------------

async def _client(args) -> dict:
    import httpx
    import openai

    from shared import schemas, subjects
    from shared.bus import Bus
    from shared.schemas import KVEvent, TransferEvent
    from shared.settings import Settings

    want = json.loads(args.want)
    deadline = time.monotonic() + 300
    async with httpx.AsyncClient(timeout=5) as http:
        while True:       # exactly the wanted workers of each named role are live
            try:
                details = (await http.get(args.gateway + "/health")).json().get("details", {})
                if all(sorted(details.get(r, {}).get("workers", [])) == sorted(ids) for r, ids in want.items()):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {want} not live in 300 s")
            await asyncio.sleep(0.3)
    bus = await Bus.connect(Settings.from_env(), name="two-hosts-client")
    transfers, pool_stored = [], set()

    async def on_transfer(msg) -> None:
        ev = schemas.decode(msg.data, TransferEvent)
        transfers.append({"reporter": msg.subject.rsplit(".", 1)[-1], "path": ev.path, "nbytes": ev.nbytes,
                          "wire_bytes": ev.wire_bytes, "ok": ev.ok, "attempts": ev.attempts, "seconds": ev.seconds})

    async def on_kv_event(msg) -> None:
        ev = schemas.decode(msg.data, KVEvent)
        if ev.role == subjects.KVPOOL:
            pool_stored.update(ev.stored)

    await bus.nc.subscribe(subjects.TRANSFER_ALL, cb=on_transfer)
    await bus.nc.subscribe(subjects.KV_EVENTS_ALL, cb=on_kv_event)
    await bus.flush()
    prompt = json.loads(Path(args.prompt_file).read_text())
    client = openai.AsyncOpenAI(base_url=args.gateway + "/v1", api_key="two-hosts", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    t0, first, text, cached = time.perf_counter(), None, "", -1
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter() - t0
            text += chunk.choices[0].text
        if chunk.usage:
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens if details else 0
    deadline = time.monotonic() + 120
    while len(pool_stored) < args.pool_chunks and time.monotonic() < deadline:
        await asyncio.sleep(0.2)    # the write-backs run after the reply
    await asyncio.sleep(1.0)        # the transfer events of the reply's last steps
    await bus.close()
    return {"text": text, "cached": cached, "ttft_s": first or -1.0, "transfers": transfers,
            "pool_stored": len(pool_stored)}


def _client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", required=True)
    p.add_argument("--want", required=True, help="JSON: role -> the worker ids that must be live (exactly)")
    p.add_argument("--prompt-file", required=True, help="JSON list of prompt token ids")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--pool-chunks", type=int, default=0, help="after the reply, wait until the pool stored this many")


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        _progress("needs root: it creates network namespaces (ip netns)")
        return 2
    res = run(args.prompt, args.max_tokens)
    texts = {res[p]["text"] for p in ("single", "two_hosts", "other_host_warm")}
    res["same_text"] = len(texts) == 1
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["same_text"] else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        parser = argparse.ArgumentParser(prog="python -m bench.two_hosts client")
        _client_arguments(parser)
        print(json.dumps(asyncio.run(_client(parser.parse_args(sys.argv[2:])))))
    else:
        parser = argparse.ArgumentParser(prog="python -m bench.two_hosts")
        add_arguments(parser)
        sys.exit(main(parser.parse_args()))
