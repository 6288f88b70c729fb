"""Load generator for any OpenAI-compatible server: workloads, closed and open loops, statistics.

Workloads (``make_jobs``) are lists of *jobs*; a job is one or more requests sent one after the
other (an agent session's turns), each request with its SLA tier (``X-Tandem-SLA``) and, for
sessions, ``X-Tandem-Session``:

- ``chat``: a short question, a short reply;
- ``agent``: sessions of ``turns`` requests sharing one long system prompt; each turn adds an
  assistant reply and a tool result (``turn_words`` words) to the context, which grows to
  thousands of tokens (the history is synthetic, so every run sends the same prompts);
- ``long``: a RAG-like prompt, a ``long_words``-word document and a question, a short reply.

Loops (``run_jobs``): ``closed`` — N streams, each sends its next job when its last ended;
``open`` — jobs arrive as a Poisson process of ``rate`` jobs/s (seeded), whatever is in flight.

Per request (``request_metrics``, pure): TTFT = first content chunk − send; TPOT = (last − first
content chunk) / (completion tokens − 1); ITL = gaps between content chunks. ``summarize``
(pure): p50 / p90 / p99 by linear interpolation between order statistics (numpy's default),
throughput = output tokens / wall time, goodput = requests that met their tier's SLO
(TTFT and TPOT) per second, overall and per tier.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from shared.tier import TIERS

WORKLOADS = ("chat", "agent", "long", "structured")
# the SLO each tier is held to by default: (TTFT ms, TPOT ms)
DEFAULT_SLOS = {"interactive": (1000.0, 100.0), "standard": (5000.0, 250.0), "batch": (60000.0, 1000.0)}
QUANTILES = (50, 90, 99)

QUESTIONS = [
    "What is the capital of France?",
    "Tell me a short story about a cat.",
    "Explain what a neural network is.",
    "List three colours of the rainbow.",
    "How do plants make their food?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
]
_WORDS = ("the system reads a file and writes the result to a table while the agent checks each "
          "step of its plan against the log of earlier calls so that errors in the build or the "
          "tests are found early and fixed before the next release of the service goes out to "
          "users who wait for an answer about their data the model the cache and the network").split()


# ---- statistics (pure) ---------------------------------------------------------------------

def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) of ``values`` by linear interpolation between order
    statistics (numpy's default "linear" method). NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RequestResult:
    ok: bool
    tokens: int = 0                 # completion tokens (usage chunk; else content chunks)
    ttft: float = math.nan          # seconds
    tpot: float = math.nan          # seconds per output token after the first
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    latency: float = math.nan       # send -> end of stream
    error: str | None = None
    tier: str = "standard"          # the SLA tier it was sent with
    prompt_tokens: int = 0          # from the usage chunk
    cached_tokens: int = 0          # of those, served from a prefix cache (usage.prompt_tokens_details)
    start: float = 0.0              # send time, seconds after the run began


def request_metrics(t_send: float, chunk_times: list[float], t_end: float, tokens: int | None) -> RequestResult:
    """Metrics of one streamed request from its content-chunk arrival times (pure)."""
    if not chunk_times:
        return RequestResult(ok=False, error="no content received", latency=t_end - t_send)
    n = tokens if tokens else len(chunk_times)
    tpot = (chunk_times[-1] - chunk_times[0]) / (n - 1) if n > 1 else math.nan
    return RequestResult(ok=True, tokens=n, ttft=chunk_times[0] - t_send, tpot=tpot,
                         itl=[b - a for a, b in itertools.pairwise(chunk_times)], latency=t_end - t_send)


def meets_slo(r: RequestResult, slos: dict[str, tuple[float, float]]) -> bool:
    """Finished, TTFT within its tier's bound and TPOT (when defined) within its bound."""
    ttft_ms, tpot_ms = slos.get(r.tier, DEFAULT_SLOS["standard"])
    return r.ok and r.ttft * 1e3 <= ttft_ms and (math.isnan(r.tpot) or r.tpot * 1e3 <= tpot_ms)


def _stats(results: list[RequestResult], wall_s: float, slos: dict) -> dict:
    ok = [r for r in results if r.ok]
    out: dict = {"requests": len(results), "errors": len(results) - len(ok), "wall_s": wall_s,
                 "output_tokens": sum(r.tokens for r in ok)}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if not math.isnan(r.tpot)],
              "itl": [x for r in ok for x in r.itl], "latency": [r.latency for r in ok]}
    for name, xs in series.items():
        for q in QUANTILES:
            out[f"{name}_p{q}_ms"] = percentile(xs, q) * 1e3
    good = [r for r in results if meets_slo(r, slos)]
    rate = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: math.nan)
    out["throughput_tok_s"] = rate(out["output_tokens"])
    out["throughput_req_s"] = rate(len(ok))
    out["goodput_req_s"] = rate(len(good))
    out["goodput_tok_s"] = rate(sum(r.tokens for r in good))
    out["slo_met"] = len(good) / len(results) if results else math.nan
    return out


def summarize(results: list[RequestResult], wall_s: float, slos: dict | None = None) -> dict:
    """p50/p90/p99 of TTFT, TPOT, ITL and latency (ms), throughput and goodput, overall and
    (``per_tier``) for each tier present (pure)."""
    slos = {**DEFAULT_SLOS, **(slos or {})}
    out = _stats(results, wall_s, slos)
    tiers = sorted({r.tier for r in results}, key=lambda t: TIERS.index(t) if t in TIERS else 99)
    out["per_tier"] = {t: _stats([r for r in results if r.tier == t], wall_s, slos) for t in tiers}
    return out


# ---- workloads ------------------------------------------------------------------------------

@dataclass
class Request:
    messages: list[dict]            # the chat messages sent
    max_tokens: int
    tier: str = "standard"
    session: str | None = None      # X-Tandem-Session (agent sessions)
    response_format: dict | None = None  # structured output (the "structured" workload)


# the "structured" workload: the chat questions, answered as JSON of this schema (grammar-constrained)
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 1200},
    "facts": {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 8},
    "confidence": {"type": "number"}}, "required": ["answer", "facts", "confidence"], "additionalProperties": False}


def parse_mix(spec: str) -> dict[str, float]:
    """``interactive=1,standard=3`` (or one tier name) -> normalized weights per tier."""
    weights: dict[str, float] = {}
    for part in spec.split(","):
        name, _, w = part.strip().partition("=")
        if name not in TIERS:
            raise ValueError(f"--tiers: unknown tier {name!r} (one of {', '.join(TIERS)})")
        try:
            weights[name] = float(w) if w else 1.0
        except ValueError:
            raise ValueError(f"--tiers: bad weight {w!r} for {name}") from None
        if weights[name] < 0:
            raise ValueError(f"--tiers: weight of {name} must be >= 0")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("--tiers: the weights must not all be 0")
    return {k: v / total for k, v in weights.items()}


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def make_jobs(workload: str, num_requests: int, *, max_tokens: int, tiers: dict[str, float] | None = None,
              seed: int = 0, turns: int = 6, turn_words: int = 250, long_words: int = 1500) -> list[list[Request]]:
    """Jobs totalling ``num_requests`` requests (the last agent session may be shorter)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r} (one of {', '.join(WORKLOADS)})")
    if num_requests < 1 or max_tokens < 1 or turns < 1:
        raise ValueError("num_requests, max_tokens and turns must be >= 1")
    rng = random.Random(seed)
    mix = tiers or {"standard": 1.0}
    names, weights = list(mix), list(mix.values())
    tier = lambda: rng.choices(names, weights)[0]  # noqa: E731
    if workload in ("chat", "structured"):
        rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": STRUCTURED_SCHEMA, "strict": True}}
        return [[Request([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], max_tokens, tier(),
                         response_format=rf if workload == "structured" else None)]
                for i in range(num_requests)]
    if workload == "long":
        return [[Request([{"role": "user", "content": f"Document:\n{_text(rng, long_words)}\n\nQuestion: "
                                                      f"{QUESTIONS[i % len(QUESTIONS)]}"}], max_tokens, tier())]
                for i in range(num_requests)]
    system = {"role": "system", "content": "You are a coding agent. Tools: read_file, run_tests, search. "
                                           + _text(random.Random(-1), 300)}  # one prompt for every session
    jobs = []
    for s in itertools.count():
        left = num_requests - sum(len(j) for j in jobs)
        if left <= 0:
            return jobs
        t, sid, history, job = tier(), f"agent-{seed}-{s}", [system], []
        for k in range(min(turns, left)):
            if k:
                history = history + [{"role": "assistant", "content": _text(rng, 40)}]
            history = history + [{"role": "user", "content": f"Tool result {k}:\n{_text(rng, turn_words)}"}]
            job.append(Request(history, max_tokens, t, sid))
        jobs.append(job)


# ---- running ------------------------------------------------------------------------------

class Progress:
    """A progress bar on stderr: redrawn in place on a terminal; into a file or pipe, one line
    per tenth of the work."""

    def __init__(self, total: int, label: str, width: int = 30, stream=None):
        self.total, self.label, self.width = total, label, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = self.errors = 0
        self.t0 = time.perf_counter()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        total = max(1, self.total)
        if not self.tty and self.done != total and 10 * self.done // total == 10 * (self.done - 1) // total:
            return
        filled = self.width * self.done // total
        rate = self.done / max(1e-9, time.perf_counter() - self.t0)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{rate:.1f} req/s" + (f" {self.errors} failed" if self.errors else ""))
        self.stream.write("\r" + line if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


async def send(client, url: str, model: str, req: Request, t_run: float = 0.0) -> RequestResult:
    """Stream one chat completion; every failure is a result, never an exception."""
    body = {"model": model, "messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if req.response_format is not None:
        body["response_format"] = req.response_format
    headers = {"X-Tandem-SLA": req.tier}
    if req.session:
        headers["X-Tandem-Session"] = req.session
    chunk_times: list[float] = []
    tokens, prompt_tokens, cached_tokens = None, 0, 0
    t_send = time.perf_counter()
    meta = {"tier": req.tier, "start": t_send - t_run}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {text}", **meta)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                d = json.loads(data)
                if "error" in d:
                    return RequestResult(ok=False, error=str(d["error"])[:200], **meta)
                if any((ch.get("delta") or {}).get("content") for ch in d.get("choices") or ()):
                    chunk_times.append(now)
                if d.get("usage"):
                    tokens = d["usage"].get("completion_tokens")
                    prompt_tokens = d["usage"].get("prompt_tokens") or 0
                    cached_tokens = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}", **meta)
    r = request_metrics(t_send, chunk_times, time.perf_counter(), tokens)
    r.tier, r.start, r.prompt_tokens, r.cached_tokens = req.tier, meta["start"], prompt_tokens, cached_tokens
    return r


def client_for(connections: int):
    """The load's HTTP client; with ``OPENAI_API_KEY`` set (as the openai client reads it) every
    request carries it as its bearer token — a gateway that wants a key (TANDEM_API_KEY[S])."""
    import httpx

    key = os.environ.get("OPENAI_API_KEY")
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                             limits=httpx.Limits(max_connections=connections + 4),
                             headers={"Authorization": f"Bearer {key}"} if key else None)


async def served_model(client, url: str) -> str:
    """The first model ``url`` serves (ConnectionError naming the URL when nothing answers there)."""
    import httpx
    try:
        r = await client.get(url + "/v1/models")
    except httpx.TransportError as e:
        raise ConnectionError(f"no OpenAI-compatible server answers at {url}: {e or type(e).__name__}") from None
    if r.status_code in (401, 403):
        raise ConnectionError(f"the server at {url} refused the request ({r.status_code}): it wants an API key — "
                              "set OPENAI_API_KEY")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_jobs(url: str, jobs: list[list[Request]], *, mode: str = "closed", concurrency: int = 1,
                   rate: float = 1.0, model: str | None = None, label: str = "", seed: int = 0,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every job (closed loop at ``concurrency``, or open loop at ``rate`` jobs/s); the
    results in job order and the wall time from the first send to the last reply."""
    if mode not in ("closed", "open"):
        raise ValueError(f"unknown mode {mode!r} (closed or open)")
    if concurrency < 1 or rate <= 0:
        raise ValueError("concurrency must be >= 1 and rate > 0")
    url = url.rstrip("/").removesuffix("/v1")
    total = sum(len(j) for j in jobs)
    bar = Progress(total, f"[{label}]") if progress else None
    results: list[list[RequestResult]] = [[] for _ in jobs]
    async with client_for(concurrency if mode == "closed" else total) as client:
        model = model or await served_model(client, url)
        t0 = time.perf_counter()

        async def run_job(i: int) -> None:
            for req in jobs[i]:
                r = await send(client, url, model, req, t0)
                results[i].append(r)
                if bar:
                    bar.update(r.ok)

        if mode == "closed":
            order = iter(range(len(jobs)))

            async def stream() -> None:
                for i in order:  # shared iterator: each stream takes the next job
                    await run_job(i)

            await asyncio.gather(*(stream() for _ in range(min(concurrency, len(jobs)))))
        else:
            rng, tasks, at = random.Random(seed), [], 0.0
            for i in range(len(jobs)):
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                tasks.append(asyncio.create_task(run_job(i)))
                at += rng.expovariate(rate)
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    if bar:
        bar.close()
    return [r for rs in results for r in rs], wall


def load_label(run: dict) -> str:
    return f"c={run['concurrency']}" if run.get("mode", "closed") == "closed" else f"{run['rate']:g} req/s"


def run_level(url: str, jobs: list[list[Request]], *, system: str, workload: str, mode: str, concurrency: int,
              rate: float, model: str | None, slos: dict | None = None, seed: int = 0) -> dict:
    """One load level, summarized: the row every bench table and plot is drawn from."""
    level = f"c={concurrency}" if mode == "closed" else f"{rate:g} req/s"
    results, wall = asyncio.run(run_jobs(url, jobs, mode=mode, concurrency=concurrency, rate=rate, model=model,
                                         label=f"{system} {workload} {level}", seed=seed))
    errors = [r.error for r in results if not r.ok]
    if errors:
        sys.stderr.write(f"[{system} {level}] {len(errors)} failed, first: {errors[0]}\n")
    return {"system": system, "url": url, "workload": workload, "mode": mode, "concurrency": concurrency,
            "rate": rate if mode == "open" else None, "max_tokens": jobs[0][0].max_tokens,
            "slos": {**DEFAULT_SLOS, **(slos or {})}, **summarize(results, wall, slos),
            "per_request": [asdict(r) for r in results]}
