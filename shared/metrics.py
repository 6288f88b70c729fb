"""Prometheus metrics: every series Tandem exports, defined once, with small helpers to feed them.

Every series lives in the process-wide default registry of ``prometheus_client``; a process
exports them on ``/metrics`` — the gateway on its own HTTP port, workers and the router on a
small HTTP server of their own (``serve_http``; TANDEM_METRICS_PORT, 0 = a free port, -1 = off).

How a service feeds them:

    from shared import metrics
    metrics.observe_request("cpu-decode", "standard", ttft=0.05, tpot=0.012, queue=0.003)
    metrics.set_engine_load("cpu-decode", queue_depth=2, running=5, kv_used=100, kv_free=412)
    metrics.pool_lookup("ram", hit=True)                      # KV pool, per storage tier
    metrics.pool_stored("disk", nbytes=64 << 20)             # bytes the tier now holds
    metrics.transfer("tcp", nbytes=2_000_000, seconds=0.004) # KV moved, per data-plane path
    metrics.migration("gpu-decode", "cpu-decode", "ok", 0.02) # a running request moved between workers
    metrics.ring_step(0.03, out=4096, back=512, ring=0)       # a ring decode step with remote members

Labels: ``service`` is the role (gateway, router, prefill, gpu-decode, cpu-decode, kvpool);
``tier`` on request series is the SLA tier (interactive|standard|batch); on pool series it is
the storage tier the pool names (e.g. gpu, cpu, disk); ``path`` is a transfer path (tcp,
local, rdma...). Names and meanings are listed in docs/observability.md.
"""

from __future__ import annotations

import logging

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest

from shared.settings import ConfigError

log = logging.getLogger(__name__)

# latency buckets: 1 ms .. 2 min (TTFT of a long prompt on a CPU runs to tens of seconds)
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# per-token buckets: 1 ms .. 5 s
_PER_TOKEN = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

# -- requests, per service and SLA tier -------------------------------------------------------
TTFT = Histogram("tandem_ttft_seconds", "time to first token (gateway: as the client sees it; "
                 "workers: from accepting the request to publishing its first token)",
                 ["service", "tier"], buckets=_LATENCY)
TPOT = Histogram("tandem_tpot_seconds", "mean time per output token after the first, per request",
                 ["service", "tier"], buckets=_PER_TOKEN)
QUEUE_TIME = Histogram("tandem_queue_seconds", "time a request waited before its first engine step "
                       "(gateway: before a worker accepted it)", ["service", "tier"], buckets=_LATENCY)
REQUESTS = Counter("tandem_requests", "requests by outcome (ok, error, aborted; the gateway: rejected = "
                   "a 4xx, the client's, overloaded = a 429, shed load; parked = a prefill "
                   "worker handed it to decode; migrated = moved to another decode worker)",
                   ["service", "tier", "outcome"])
TOKENS = Counter("tandem_generated_tokens", "output tokens generated", ["service", "tier"])

ROUTES = Counter("tandem_routes", "router placements by policy, decode pool and whether a prefill "
                 "worker was chosen", ["policy", "decode_role", "prefill"])
STRATEGIES = Counter("tandem_route", "router placements by execution strategy (gpu, cpu, cpu-ring(N): "
                     "docs/strategies.md)", ["strategy"])

# -- engine load, per service (set from each heartbeat) ---------------------------------------
QUEUE_DEPTH = Gauge("tandem_queue_depth", "requests waiting for an engine step", ["service"])
RUNNING = Gauge("tandem_running_sequences", "sequences in the running batch", ["service"])
KV_BLOCKS = Gauge("tandem_kv_blocks", "paged KV cache blocks by state (used, free)", ["service", "state"])
READY = Gauge("tandem_ready", "1 while the service takes work: connected to NATS and (engines) not stuck "
              "in a step; `tandem health` checks it", ["service"])

# -- KV pool, per storage tier ----------------------------------------------------------------
POOL_LOOKUPS = Counter("tandem_pool_lookups", "KV pool lookups by storage tier and result (hit, miss)",
                       ["tier", "result"])
POOL_HIT_BYTES = Counter("tandem_pool_hit_bytes", "KV bytes served from the pool", ["tier"])
POOL_BYTES = Gauge("tandem_pool_bytes", "KV bytes the pool holds", ["tier"])
POOL_FORGED = Counter("tandem_pool_forged_entries", "KV pool entries a worker ignored: their MAC does not check "
                      "out (written without TANDEM_POOL_KEY)")

# -- data plane and migrations ----------------------------------------------------------------
TRANSFER_BYTES = Counter("tandem_transfer_bytes", "KV bytes moved over the data plane", ["path"])
TRANSFER_SECONDS = Histogram("tandem_transfer_seconds", "seconds per KV transfer", ["path"],
                             buckets=_LATENCY)
DATA_REFUSED = Counter("tandem_data_refused_frames", "data-plane frames a receiver refused: no valid tag under "
                       "TANDEM_DATA_KEY (reason: no tag, wrong tag), or addressed to no live worker", ["reason"])
RING_BYTES = Counter("tandem_ring_bytes", "ring decode traffic between processes (cpu-ring(N)): scatter = the "
                     "members' KV ranges loaded, out = q|k|v rows (and states) the coordinator sends, back = states "
                     "it receives, ring = member to member (the fold)", ["direction"])
RING_STEPS = Counter("tandem_ring_steps", "ring decode steps a coordinator ran with members in other processes")
RING_STEP_SECONDS = Histogram("tandem_ring_step_seconds", "seconds per ring decode step (coordinator)",
                              buckets=_PER_TOKEN)
RING_SESSIONS = Counter("tandem_ring_sessions", "ring sessions set up, by how (scattered: by the coordinator; "
                        "parked: by the prefill; claimed: by the coordinator, parked by the prefill) and outcome "
                        "(ok, or the error code)",
                        ["how", "outcome"])
RESUMES = Counter("tandem_resumes", "requests resumed on this role after the worker holding them was lost",
                  ["role"])
RESUME_TOKENS = Counter("tandem_resume_tokens", "tokens of resumed requests: KV reused (prefix cache, KV pool) "
                        "or recomputed", ["role", "kind"])
RESTARTS = Counter("tandem_restarts", "service copies restarted by `tandem up` after they exited", ["service"])
GIVEN_UP = Counter("tandem_given_up", "service copies `tandem up` gave up restarting (a crash loop): they stay down",
                   ["service"])
MIGRATIONS = Counter("tandem_migrations", "running requests moved between decode workers, by outcome "
                     "(ok; failed: it went on at the source)", ["source_role", "target_role", "outcome"])
ROUTER_MOVES = Counter("tandem_router_moves", "running requests the router moved, by kind (promote, demote; "
                       "spread: onto a ring under KV pressure; evacuate: off a stopping worker; retier: in "
                       "place, at its session's new tier), the strategy they run on after and the outcome "
                       "(ok; failed: it went on where it was)", ["kind", "strategy", "outcome"])
MIGRATION_SECONDS = Histogram("tandem_migration_seconds", "seconds per migration, export to the target's ack",
                              ["source_role", "target_role"], buckets=_LATENCY)

# -- agent sessions: what each turn's prompt reused (gateway; a turn = a request with a session) ---
SESSION_PROMPT_TOKENS = Counter("tandem_session_prompt_tokens", "prompt tokens of session turns, by whether "
                                "their KV was reused (cached) or computed (computed): the cached share is "
                                "cached / (cached + computed)", ["tier", "kind"])
SESSION_TURN_COMPUTED = Histogram("tandem_session_turn_computed_tokens", "prompt tokens a session turn "
                                  "computed (not found cached)", ["tier"],
                                  buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 32768))

SESSION_TURN_CACHED = Histogram("tandem_session_turn_cached_tokens", "prompt tokens a session turn found "
                                "cached (usage cached_tokens)", ["tier"],
                                buckets=(0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072))
# a worker's sessions held between turns (shared/engine/retention.py)
SESSIONS_RESIDENT = Gauge("tandem_sessions_resident", "sessions whose KV a worker holds resident between turns",
                          ["service"])
SESSIONS_EVICTED = Counter("tandem_sessions_evicted", "resident sessions evicted to make room, their KV "
                           "written to the KV pool", ["service"])
SESSIONS_RELOADED = Counter("tandem_sessions_reloaded", "prompts that loaded an evicted session's KV from the "
                            "KV pool (instead of computing it)", ["service"])


def observe_session_turn(tier: str, prompt_tokens: int, cached_tokens: int) -> None:
    """One finished session turn: its prompt tokens, cached and computed."""
    computed = max(0, prompt_tokens - cached_tokens)
    SESSION_PROMPT_TOKENS.labels(tier, "cached").inc(min(cached_tokens, prompt_tokens))
    SESSION_PROMPT_TOKENS.labels(tier, "computed").inc(computed)
    SESSION_TURN_COMPUTED.labels(tier).observe(computed)
    SESSION_TURN_CACHED.labels(tier).observe(min(cached_tokens, prompt_tokens))


# -- the gateway ------------------------------------------------------------------------------
GATEWAY_IN_FLIGHT = Gauge("tandem_gateway_requests_in_flight", "generation requests the gateway is answering now "
                          "(streamed or not; 0 when idle: nothing left behind by clients that left)")

# -- stored Responses (services/gateway/response_store.py) -----------------------------------
RESPONSES_STORED = Gauge("tandem_responses_stored", "stored Responses this gateway knows of, over every tenant "
                         "(records, bytes; held: not taken by the bus yet)", ["what"])
RESPONSES_EVICTED = Counter("tandem_responses_evicted", "stored Responses removed to keep a tenant within its cap "
                            "(entries: TANDEM_RESPONSES_MAX_PER_TENANT, bytes: TANDEM_RESPONSES_MAX_BYTES_PER_TENANT)",
                            ["cap"])

# -- energy (only where the hardware reports power; see shared/energy.py) ---------------------
ENERGY = Counter("tandem_energy_joules", "energy the process's power domain used while serving "
                 "(only where RAPL / NVML report it)", ["service", "domain"])


def observe_request(service: str, tier: str, *, ttft: float | None = None, tpot: float | None = None,
                    queue: float | None = None, tokens: int = 0, outcome: str | None = None) -> None:
    """Record what is known about one request (None = not measured)."""
    if ttft is not None:
        TTFT.labels(service, tier).observe(ttft)
    if tpot is not None:
        TPOT.labels(service, tier).observe(tpot)
    if queue is not None:
        QUEUE_TIME.labels(service, tier).observe(queue)
    if tokens:
        TOKENS.labels(service, tier).inc(tokens)
    if outcome is not None:
        REQUESTS.labels(service, tier, outcome).inc()


def set_engine_load(service: str, *, queue_depth: int, running: int, kv_used: int, kv_free: int,
                    sessions_resident: int = 0) -> None:
    QUEUE_DEPTH.labels(service).set(queue_depth)
    RUNNING.labels(service).set(running)
    KV_BLOCKS.labels(service, "used").set(kv_used)
    KV_BLOCKS.labels(service, "free").set(kv_free)
    SESSIONS_RESIDENT.labels(service).set(sessions_resident)


def set_ready(service: str, ready: bool) -> None:
    READY.labels(service).set(1 if ready else 0)


class _PoolTiers:
    """The KV pool's storage tiers' own counts (``kvpool.store.Tier``), read at each scrape: a tier
    that fails every write looked like a cold cache (its warnings are once a minute)."""

    SERIES = (("write_errors", "tandem_pool_write_errors", "writes a pool storage tier failed (device full, "
               "read-only, permission): the entry was not stored there"),
              ("read_errors", "tandem_pool_read_errors", "reads the system refused a pool storage tier (too many "
               "open files, I/O error): a miss, the entry kept"),
              ("corrupt", "tandem_pool_corrupt_entries", "entries a pool storage tier found broken (checksum, size, "
               "header) and removed"),
              ("evictions", "tandem_pool_evictions", "entries a pool storage tier evicted to make room"))

    def __init__(self):
        self.tiers: list = []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for field, name, doc in self.SERIES:
            fam = CounterMetricFamily(name, doc, labels=["tier"])
            for t in self.tiers:
                fam.add_metric([t.name], float(getattr(t, field)))
            yield fam


_POOL_TIERS = _PoolTiers()
REGISTRY.register(_POOL_TIERS)


def watch_pool_tiers(tiers) -> None:
    """Export these storage tiers' counts (the pool service's; the last call's tiers)."""
    _POOL_TIERS.tiers = list(tiers)


def pool_lookup(tier: str, hit: bool) -> None:
    """One KV pool lookup for a prompt: a hit (its first chunk found on storage ``tier``), or a
    miss (tier "none")."""
    POOL_LOOKUPS.labels(tier, "hit" if hit else "miss").inc()


def pool_hit_bytes(tier: str, nbytes: int) -> None:
    """Bytes of KV the pool read from storage ``tier`` for a worker."""
    POOL_HIT_BYTES.labels(tier).inc(nbytes)


def pool_stored(tier: str, nbytes: int) -> None:
    """The bytes storage ``tier`` holds now."""
    POOL_BYTES.labels(tier).set(nbytes)


def resumed(role: str, reused: int, recomputed: int) -> None:
    """A request resumed here after its worker was lost: tokens of KV reused and recomputed."""
    RESUMES.labels(role).inc()
    RESUME_TOKENS.labels(role, "reused").inc(reused)
    RESUME_TOKENS.labels(role, "recomputed").inc(recomputed)


def transfer(path: str, nbytes: int, seconds: float) -> None:
    """One KV transfer over data-plane ``path``."""
    TRANSFER_BYTES.labels(path).inc(nbytes)
    TRANSFER_SECONDS.labels(path).observe(seconds)


def ring_step(seconds: float, *, out: int, back: int, ring: int) -> None:
    """One ring decode step of a coordinator with remote members, and the bytes it moved."""
    RING_STEPS.inc()
    RING_STEP_SECONDS.observe(seconds)
    for direction, n in (("out", out), ("back", back), ("ring", ring)):
        if n:
            RING_BYTES.labels(direction).inc(n)


def ring_session(how: str, outcome: str, scattered_bytes: int = 0) -> None:
    """A ring session set up (or refused): ``how`` scattered | parked | claimed, ``outcome`` ok | an error code."""
    RING_SESSIONS.labels(how, outcome).inc()
    if scattered_bytes:
        RING_BYTES.labels("scatter").inc(scattered_bytes)


def migration(source_role: str, target_role: str, outcome: str = "ok", seconds: float | None = None) -> None:
    """One migration attempt of a running request; ``seconds`` for a completed one."""
    MIGRATIONS.labels(source_role, target_role, outcome).inc()
    if seconds is not None:
        MIGRATION_SECONDS.labels(source_role, target_role).observe(seconds)


def render() -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text exposition, for an HTTP handler."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def serve_http(port: int, host: str = "127.0.0.1") -> int | None:
    """Start the /metrics HTTP server in a daemon thread; the bound port, or None when ``port`` < 0.

    ``port`` 0 picks a free port (logged)."""
    if port < 0:
        return None
    from prometheus_client import start_http_server
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as e:   # a fixed port another process has: one line, not a traceback
        raise ConfigError(f"the metrics server cannot listen on {host}:{port} (TANDEM_METRICS_HOST, "
                          f"TANDEM_METRICS_PORT={port}: {e.strerror or e}): another process has the port? (0: a "
                          "free port, said in the heartbeats; -1: off)") from None
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
