"""Settings: one dataclass per concern, every field overridable by one environment variable.

    settings = Settings.from_env()          # reads os.environ (or a given mapping)
    settings.nats.url                        # None -> `tandem up` starts an embedded server
    print(env_help())                        # every variable, its default and meaning (--help)

Each field declares its variable with ``_env(NAME, default, help)``. Values are parsed by the
field's type (str, int, float, bool, or ``X | None`` where an empty string means None);
cross-field checks in ``validate()`` raise ValueError naming the variables involved.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

class ConfigError(ValueError):
    """A setting the environment cannot honour, found while a service starts (a key file that cannot
    be read, a fixed port another process has): ``tandem serve`` says it in one line and exits 2."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _env(name: str, default: Any, help: str, factory: Any = None) -> Any:
    meta = {"env": name, "help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


PINGS_OUTSTANDING = 3   # pings unanswered before a client leaves its server (NatsSettings.ping_s)


@dataclass
class NatsSettings:
    """How every service reaches the bus."""
    url: str | None = _env("TANDEM_NATS_URL", None,
                           "NATS server URL(s), comma-separated (nats://, tls://); unset: "
                           "`tandem up` starts an embedded nats-server")
    store_dir: str | None = _env("TANDEM_NATS_STORE_DIR", None,
                                 "JetStream store of `tandem up`'s embedded nats-server, kept across runs "
                                 "(stored Responses, sessions, the prefix index); unset: a temporary one")
    user: str | None = _env("TANDEM_NATS_USER", None, "NATS user name (with TANDEM_NATS_PASSWORD)")
    password: str | None = _env("TANDEM_NATS_PASSWORD", None, "NATS password")
    token: str | None = _env("TANDEM_NATS_TOKEN", None, "NATS auth token (instead of user/password)")
    creds_file: str | None = _env("TANDEM_NATS_CREDS_FILE", "~/.cache/tandem/nats.creds",
                                  "the bus credentials of every service role (docs/security.md): each service "
                                  "connects as its role unless TANDEM_NATS_USER/TOKEN is set; `tandem up` "
                                  "creates it (mode 0600) and its embedded nats-server accepts only these; "
                                  "empty: none")
    tls: bool = _env("TANDEM_NATS_TLS", False, "use TLS even with a nats:// URL")
    tls_ca: str | None = _env("TANDEM_NATS_TLS_CA", None, "CA bundle (PEM) to verify the server")
    tls_cert: str | None = _env("TANDEM_NATS_TLS_CERT", None, "client certificate (PEM), mutual TLS")
    tls_key: str | None = _env("TANDEM_NATS_TLS_KEY", None, "client private key (PEM), mutual TLS")
    name: str | None = _env("TANDEM_NATS_NAME", None, "connection name shown by the server")
    connect_timeout: float = _env("TANDEM_NATS_CONNECT_TIMEOUT", 5.0, "seconds per connect attempt at start "
                                  "(a reconnect waits at most 2 s for a server, then tries the next)")
    request_timeout: float = _env("TANDEM_NATS_REQUEST_TIMEOUT", 10.0,
                                  "default seconds to wait for a bus reply")
    ping_s: float = _env("TANDEM_NATS_PING_S", 1.0,
                         "seconds between the client's pings to its server; one that answers none of "
                         f"{PINGS_OUTSTANDING} in a row is left for another server of the cluster (a frozen "
                         "nats-server, a host whose network dropped: the connection stays open)")
    replicas: int = _env("TANDEM_NATS_REPLICAS", 0,
                         "replicas of every JetStream stream and KV bucket Tandem creates (stored "
                         "responses, sessions, the prefix index, KV events); 0: auto, 3 when the "
                         "server is in a cluster of >= 3 servers, else 1 (docs/deploy.md)")

    def validate(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError("TANDEM_NATS_USER and TANDEM_NATS_PASSWORD must be set together")
        if self.token is not None and self.user is not None:
            raise ValueError("set TANDEM_NATS_TOKEN or TANDEM_NATS_USER/PASSWORD, not both")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TANDEM_NATS_TLS_CERT and TANDEM_NATS_TLS_KEY must be set together")
        if self.replicas < 0 or self.replicas > 5:
            raise ValueError("TANDEM_NATS_REPLICAS must be 0 (auto) or 1..5 (JetStream's limit)")
        if self.connect_timeout <= 0 or self.request_timeout <= 0 or self.ping_s <= 0:
            raise ValueError("TANDEM_NATS_CONNECT_TIMEOUT, TANDEM_NATS_REQUEST_TIMEOUT and TANDEM_NATS_PING_S "
                             "must be > 0")
        for u in self.servers():
            if "://" not in u:
                raise ValueError(f"TANDEM_NATS_URL entry {u!r} needs a scheme (nats:// or tls://)")

    def servers(self) -> list[str]:
        """The URL list (empty when unset)."""
        return [u.strip() for u in (self.url or "").split(",") if u.strip()]

    @property
    def use_tls(self) -> bool:
        return self.tls or self.tls_ca is not None or self.tls_cert is not None or any(
            u.startswith("tls://") for u in self.servers())


_ROLE_BUDGETS = {"prefill": "prefill", "gpu-decode": "gpu_decode", "cpu-decode": "cpu_decode"}  # role -> field suffix


KV_BLOCK_TOKENS = 16          # tokens per KV block (every engine's; a pool chunk is a whole number of them)
MAX_THREADS = 4096            # engine threads a worker may ask for (more is a typo, not a machine)
MAX_BUDGET_MB = 1 << 30       # a KV budget past 1 PiB is a typo (and overflows what it sizes)
_NON_NEGATIVE = {"threads", "kv_blocks", "max_seqs", "load_threads", "max_context", "step_tokens", "prefill_step_tokens",
                 "shared_step_tokens", "guest_step_tokens", "batch_coalesce_ms", "session_retention_s"}


@dataclass
class WorkerSettings:
    """A prefill or decode worker: identity, engine and KV budget."""
    worker_id: str | None = _env("TANDEM_WORKER_ID", None,
                                 "this copy's id (a subject token); unset: <role>-<host>-<pid>")
    model: str | None = _env("TANDEM_MODEL", None,
                             "model name or GGUF path; unset: the bundled SmolLM2-135M-Instruct")
    device: str | None = _env("TANDEM_DEVICE", None,
                              "torch device: cpu, cuda, cuda:1; unset: the role's default")
    threads: int = _env("TANDEM_THREADS", 0, "CPU threads for the engine; 0 = torch's default")
    weight_cache_dir: str = _env("TANDEM_WEIGHT_CACHE_DIR", "~/.cache/tandem/weights",
                                 "converted weights are cached here and memory-mapped by every engine on the "
                                 "node (docs/weights.md); empty: convert at every load")
    load_threads: int = _env("TANDEM_LOAD_THREADS", 0, "threads converting a model on a weight-cache miss; "
                             "0 = 1 (one conversion at a time per node)")
    kv_blocks: int = _env("TANDEM_KV_BLOCKS", 0, "KV cache blocks; 0 = from TANDEM_KV_BUDGET_MB")
    kv_budget_mb: int = _env("TANDEM_KV_BUDGET_MB", 512, "KV cache memory budget in MiB")
    kv_budget_mb_prefill: int = _env("TANDEM_KV_BUDGET_MB_PREFILL", 0, "a prefill worker's KV budget in MiB; "
                                     "0 = TANDEM_KV_BUDGET_MB")
    kv_budget_mb_gpu_decode: int = _env("TANDEM_KV_BUDGET_MB_GPU_DECODE", 0, "a gpu-decode worker's KV budget "
                                        "in MiB; 0 = TANDEM_KV_BUDGET_MB")
    kv_budget_mb_cpu_decode: int = _env("TANDEM_KV_BUDGET_MB_CPU_DECODE", 0, "a cpu-decode worker's KV budget "
                                        "in MiB (a context past it needs a ring: docs/strategies.md); "
                                        "0 = TANDEM_KV_BUDGET_MB")
    max_context: int = _env("TANDEM_MAX_CONTEXT", 0, "longest context in tokens; 0 = the model's")
    gpu_step: str = _env("TANDEM_GPU_STEP", "graphs", "a CUDA engine's step: graphs (fused Triton kernels, "
                         "decode steps replayed as CUDA graphs), fused (the same kernels launched eagerly) or "
                         "ops (op by op around the Q4_0 GEMV; docs/kernels.md \"GPU\")")
    step_tokens: int = _env("TANDEM_STEP_TOKENS", 0, "tokens per engine step (prefill chunk budget); 0 = "
                            "64 on CPU (a step stalls every stream in the engine), 512 on CUDA")
    prefill_step_tokens: int = _env("TANDEM_PREFILL_STEP_TOKENS", 0, "tokens per engine step while no sequence "
                                    "in the engine decodes (prompts alone: no stream waits on the step); 0 = 512 "
                                    "on CPU, TANDEM_STEP_TOKENS on CUDA")
    shared_step_tokens: int = _env("TANDEM_SHARED_STEP_TOKENS", 0, "prefill tokens of worse tiers per step "
                                   "while interactive work runs; 0 = 8 on CPU, 64 on CUDA")
    guest_step_tokens: int = _env("TANDEM_GUEST_STEP_TOKENS", 0, "prefill tokens of standard/batch work per step "
                                  "on a gpu-decode worker (overflow guests of the interactive pool); 0 = 16 "
                                  "when it runs on the CPU, no cap on CUDA")
    max_seqs: int = _env("TANDEM_MAX_SEQS", 0, "sequences one engine runs at once (its decode batch); 0 = 64. "
                         "More wait in its queue, and the router counts them as waiting (TANDEM_QUEUE_*)")
    max_waiting: int = _env("TANDEM_MAX_WAITING", 256, "requests queued in one engine at most; more get "
                            "'overloaded' (429 at the gateway)")
    batch_coalesce_ms: float = _env("TANDEM_BATCH_COALESCE_MS", 0.0, "batch-tier streams only: wait this long "
                                    "after each published chunk, so the next carries every token made meanwhile "
                                    "(fewer bus messages); 0 = off. Interactive and standard never wait")
    step_deadline_s: float = _env("TANDEM_STEP_DEADLINE_S", 30.0, "an engine step running longer than this "
                                  "marks the worker not ready (a hung engine gets no work; its requests resume "
                                  "elsewhere); a ring's coordinator gives up a silent member after 0.8 of it")
    heartbeat_interval: float = _env("TANDEM_HEARTBEAT_INTERVAL", 1.0, "seconds between heartbeats (a worker "
                                     "silent for 3 of them is taken for gone)")
    metrics_port: int = _env("TANDEM_METRICS_PORT", 0, "Prometheus /metrics HTTP port of a worker or "
                             "router (the gateway uses its own port); 0 = a free one (in heartbeats), -1 = off")
    metrics_host: str = _env("TANDEM_METRICS_HOST", "127.0.0.1", "bind address of that /metrics server")
    session_retention_s: float = _env("TANDEM_SESSION_RETENTION_S", 600.0, "session KV kept resident, s idle; 0: off")
    fair_tenants: bool = _env("TANDEM_FAIR_TENANTS", True, "share each tier's queue of an engine fairly between "
                              "API keys (a key with one request waits for a slot, not for another key's backlog); "
                              "0: one queue in arrival order")

    def validate(self) -> None:
        if self.worker_id is not None:
            from shared.subjects import check_token
            try:
                check_token(self.worker_id, "worker_id")
            except ValueError as e:
                raise ValueError(f"TANDEM_WORKER_ID: {e}") from None
        for f in dataclasses.fields(self):  # counts and budgets: 0 means "the default" or "off"
            if f.name in _NON_NEGATIVE and getattr(self, f.name) < 0:
                raise ValueError(f"{f.metadata['env']} must be >= 0")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"TANDEM_DEVICE must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.threads > MAX_THREADS or self.load_threads > MAX_THREADS:
            raise ValueError(f"TANDEM_THREADS and TANDEM_LOAD_THREADS must be at most {MAX_THREADS}")
        for f in dataclasses.fields(self):
            if f.name.startswith("kv_budget_mb") and getattr(self, f.name) > MAX_BUDGET_MB:
                raise ValueError(f"{f.metadata['env']} must be at most {MAX_BUDGET_MB} (MiB)")
        if self.kv_blocks > 2**31:
            raise ValueError("TANDEM_KV_BLOCKS must be at most 2**31")
        if self.gpu_step not in ("graphs", "fused", "ops"):
            raise ValueError(f"TANDEM_GPU_STEP must be graphs, fused or ops, got {self.gpu_step!r}")
        if 0 < self.step_tokens < max(64, self.max_seqs):
            raise ValueError(f"TANDEM_STEP_TOKENS must be 0 (the device's default) or >= {max(64, self.max_seqs)} "
                             "(one token per sequence: 64, or TANDEM_MAX_SEQS where larger)")
        if self.kv_blocks == 0 and self.kv_budget_mb <= 0:
            raise ValueError("TANDEM_KV_BLOCKS is 0, so TANDEM_KV_BUDGET_MB must be > 0")
        for suffix in _ROLE_BUDGETS.values():
            if getattr(self, "kv_budget_mb_" + suffix) < 0:
                raise ValueError(f"TANDEM_KV_BUDGET_MB_{suffix.upper()} must be >= 0 (0: TANDEM_KV_BUDGET_MB)")
        if self.heartbeat_interval <= 0:
            raise ValueError("TANDEM_HEARTBEAT_INTERVAL must be > 0")
        if self.max_waiting < 1 or self.step_deadline_s <= 0:
            raise ValueError("TANDEM_MAX_WAITING must be >= 1 and TANDEM_STEP_DEADLINE_S > 0")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError("TANDEM_METRICS_PORT must be -1 (off), 0 (a free port) or a port")

    def kv_budget_mb_for(self, role: str) -> int:
        """The KV budget (MiB) of a worker of ``role``: its TANDEM_KV_BUDGET_MB_<ROLE> where set,
        else TANDEM_KV_BUDGET_MB."""
        suffix = _ROLE_BUDGETS.get(role)
        return (getattr(self, "kv_budget_mb_" + suffix) if suffix else 0) or self.kv_budget_mb

    def resolved_worker_id(self, role: str) -> str:
        """The configured id, or ``<role>-<host>-<pid>`` (dots in the host name become '-')."""
        if self.worker_id:
            return self.worker_id
        host = socket.gethostname().split(".")[0].replace(" ", "-") or "host"
        return f"{role}-{host}-{os.getpid()}"


@dataclass
class PrioritySettings:
    """OS priorities: the kernel's scheduler enforces the tiers too (shared/os_priority.py)."""
    enabled: bool = _env("TANDEM_OS_PRIORITY", True, "an engine step whose sequences are all batch-tier runs on "
                         "a thread of its own (and its kernel thread team) at TANDEM_BATCH_NICE / "
                         "TANDEM_BATCH_SCHED; interactive and standard steps, the gateway, router and NATS stay "
                         "at normal priority. No privilege needed")
    batch_nice: int = _env("TANDEM_BATCH_NICE", 19, "nice value of batch-only engine steps (0..19)")
    batch_sched: str = _env("TANDEM_BATCH_SCHED", "batch", "scheduling policy of batch-only engine steps: "
                            "batch (SCHED_BATCH), idle (SCHED_IDLE: runs only on otherwise idle cores) or other")
    omp_spin: str = _env("TANDEM_OMP_SPIN", "auto", "how long the kernels' OpenMP threads spin at a barrier "
                         "before sleeping (`tandem up` sets GOMP_SPINCOUNT for the engines): auto = 10000 "
                         "where engine threads outnumber the cores, else libgomp's default; off = libgomp's "
                         "default (300000); a number = that count. A GOMP_SPINCOUNT / OMP_WAIT_POLICY "
                         "already set wins")
    role_threads: bool = _env("TANDEM_ROLE_THREADS", True, "`tandem up` without TANDEM_THREADS: engines "
                              "serving interactive work (gpu-decode, prefill) get cores - 1 threads, cpu-decode "
                              "half the cores (at least 1 each); off: every engine torch's default (every core)")

    def validate(self) -> None:
        from shared.os_priority import SCHED_POLICIES
        if not 0 <= self.batch_nice <= 19:
            raise ValueError(f"TANDEM_BATCH_NICE must be in 0..19, got {self.batch_nice}")
        if self.batch_sched not in SCHED_POLICIES:
            raise ValueError(f"TANDEM_BATCH_SCHED must be one of {', '.join(SCHED_POLICIES)}, "
                             f"got {self.batch_sched!r}")
        if self.omp_spin not in ("auto", "off") and not (self.omp_spin.isdigit()):
            raise ValueError(f"TANDEM_OMP_SPIN must be auto, off or a count >= 0, got {self.omp_spin!r}")


@dataclass
class RouterSettings:
    """The router: placement policy, admission control, session moves."""
    policy: str = _env("TANDEM_ROUTER_POLICY", "sla", "placement: sla (tiers: pool, priority, cache, "
                       "affinity, migration), fifo (one queue, no tiers) or round-robin (every decode "
                       "worker in turn)")
    queue_interactive: int = _env("TANDEM_QUEUE_INTERACTIVE", 64, "interactive requests waiting "
                                  "across their pool before new ones get 429")
    queue_standard: int = _env("TANDEM_QUEUE_STANDARD", 256, "standard requests waiting before 429")
    queue_batch: int = _env("TANDEM_QUEUE_BATCH", 1024, "batch requests waiting before 429")
    pressure_free: float = _env("TANDEM_PRESSURE_FREE", 0.1, "a gpu-decode worker with less than this "
                                "fraction of its KV blocks free demotes batch/standard work to CPU decode")
    session_idle_s: float = _env("TANDEM_SESSION_IDLE_S", 300.0, "a session's tier change lapses after "
                                 "this long without a request")
    local_prefill_tokens: int = _env("TANDEM_LOCAL_PREFILL_TOKENS", 256, "an interactive prompt of at "
                                     "most this many uncached tokens is prefilled on its gpu-decode worker "
                                     "when every prefill worker holds worse-tier work; 0 = always the "
                                     "prefill worker")

    def queue_limit(self, tier: str) -> int:
        return getattr(self, f"queue_{tier}")

    def validate(self) -> None:
        if self.policy not in ("sla", "fifo", "round-robin"):
            raise ValueError(f"TANDEM_ROUTER_POLICY must be sla, fifo or round-robin, got {self.policy!r}")
        from shared.tier import TIERS
        for t in TIERS:
            if self.queue_limit(t) < 1:
                raise ValueError(f"TANDEM_QUEUE_{t.upper()} must be >= 1")
        if not 0 <= self.pressure_free < 1:
            raise ValueError("TANDEM_PRESSURE_FREE must be in [0, 1)")
        if self.session_idle_s <= 0:
            raise ValueError("TANDEM_SESSION_IDLE_S must be > 0")
        if self.local_prefill_tokens < 0:
            raise ValueError("TANDEM_LOCAL_PREFILL_TOKENS must be >= 0")


def _secret(value: str | None, path: str, name: str) -> bytes:
    """A deployment secret: ``value`` when set, else the contents of the file at ``path`` (b"": no
    such file). ValueError naming the variable ``name`` for a path that cannot be read (a
    directory, no permission): every copy would fail the same way."""
    if value:
        return value.encode()
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read().strip()
    except FileNotFoundError:
        return b""
    except OSError as e:
        raise ConfigError(f"{name}={path} cannot be read ({e.strerror or e}): name a file this user can "
                         "read, or set the key itself") from None


@dataclass
class DataPlaneSettings:
    """The KV data plane (shared/transfer)."""
    host: str = _env("TANDEM_DATA_HOST", "127.0.0.1", "data-plane bind address (loopback unless set: "
                     "another machine's workers cannot reach it)")
    port: int = _env("TANDEM_DATA_PORT", 0, "data-plane port; 0 = a free one")
    ring_port: int = _env("TANDEM_RING_PORT", 0, "cpu-decode: the port it hosts ring members on, on "
                          "TANDEM_DATA_HOST (in its heartbeats); 0 = a free one. Fixed, a firewall rule can name it")
    advertise_host: str | None = _env("TANDEM_DATA_ADVERTISE_HOST", None,
                                      "address peers dial (heartbeats); unset: TANDEM_DATA_HOST")
    chunk_mb: int = _env("TANDEM_DATA_CHUNK_MB", 4, "socket read/write chunk and buffer unit, MiB")
    max_pending_mb: int = _env("TANDEM_DATA_MAX_PENDING_MB", 4096,
                               "received-but-not-taken payload bytes held at most, MiB")
    timeout: float = _env("TANDEM_DATA_TIMEOUT", 30.0, "seconds a transfer may stall")
    shm: bool = _env("TANDEM_DATA_SHM", True, "use shared memory (/dev/shm) for peers on the same host (KV "
                     "transfers and ring connections; 0: TCP only)")
    ring_prefill_scatter: bool = _env("TANDEM_RING_PREFILL_SCATTER", True, "a ring plan's prefill worker loads "
                                      "the members' KV ranges itself, all at once, and the coordinator receives "
                                      "its own range only (0: the coordinator receives the whole KV and scatters it)")
    ring_fold: bool = _env("TANDEM_RING_FOLD", False, "ring decode: the members fold the attention states along "
                           "the ring, member to member over links of their own, and the coordinator receives one "
                           "state per kv head (bytes independent of the context); 0: every segment's state back "
                           "to the coordinator (docs/strategies.md)")
    ring_groups: int = _env("TANDEM_RING_GROUPS", 1, "ring decode with the fold: head groups a layer's fold is "
                            "pipelined in (each group's state passed on while the next is attended); 0: one per "
                            "kv head")
    ring_qpass: bool = _env("TANDEM_RING_QPASS", False, "ring decode with the fold: the q rows go member to member "
                            "along the ring instead of from the coordinator to each member (broadcast)")
    key: str | None = _env("TANDEM_DATA_KEY", None, "secret every data-plane frame is tagged with (HMAC-SHA256); "
                           "a receiver refuses frames without it; unset: the one in TANDEM_DATA_KEY_FILE")
    key_file: str = _env("TANDEM_DATA_KEY_FILE", "~/.cache/tandem/data.key", "file holding the data-plane key "
                         "when TANDEM_DATA_KEY is unset; `tandem up` creates it (mode 0600) when missing; no "
                         "file: frames are not authenticated (receivers warn)")

    def secret(self) -> bytes:
        """The data-plane key (TANDEM_DATA_KEY, else TANDEM_DATA_KEY_FILE's contents; b"": none)."""
        return _secret(self.key, self.key_file, "TANDEM_DATA_KEY_FILE")

    def validate(self) -> None:
        if not 0 <= self.port <= 65535 or not 0 <= self.ring_port <= 65535:
            raise ValueError("TANDEM_DATA_PORT and TANDEM_RING_PORT must be in 0..65535")
        if self.port and self.port == self.ring_port:
            raise ValueError("TANDEM_DATA_PORT and TANDEM_RING_PORT must differ (two listeners)")
        if self.chunk_mb <= 0 or self.max_pending_mb < self.chunk_mb:
            raise ValueError("TANDEM_DATA_CHUNK_MB must be > 0 and <= TANDEM_DATA_MAX_PENDING_MB")
        if self.timeout <= 0:
            raise ValueError("TANDEM_DATA_TIMEOUT must be > 0")
        if self.ring_groups < 0:
            raise ValueError("TANDEM_RING_GROUPS must be >= 0 (0: one group per kv head)")
        if self.host in ("0.0.0.0", "::") and not self.advertise_host:
            raise ValueError("TANDEM_DATA_HOST binds every address: set TANDEM_DATA_ADVERTISE_HOST "
                             "to the address peers should dial")


@dataclass
class PoolSettings:
    """The KV pool: the kvpool service's tiers, and how workers use it (kvpool/, docs/kvpool.md)."""
    enabled: bool = _env("TANDEM_POOL", True, "workers look prefixes up in the KV pool service and "
                         "write chunks back (when a pool answers)")
    ram_mb: int = _env("TANDEM_POOL_RAM_MB", 1024, "pool RAM tier capacity, MiB (0: no RAM tier)")
    dir: str = _env("TANDEM_POOL_DIR", "~/.cache/tandem/kvpool",
                    "pool local-disk (NVMe) tier directory; empty: no disk tier")
    disk_gb: float = _env("TANDEM_POOL_DISK_GB", 64.0, "pool local-disk tier capacity, GiB")
    local_read: bool = _env("TANDEM_POOL_LOCAL_READ", True, "workers on the pool's host read cached entries "
                            "straight from TANDEM_POOL_DIR's files (the page cache: one copy, verified as "
                            "always), the pool's data plane for the rest")
    shared_dir: str | None = _env("TANDEM_POOL_SHARED_DIR", None,
                                  "pool shared-filesystem tier directory (NFS...); unset: none")
    shared_gb: float = _env("TANDEM_POOL_SHARED_GB", 256.0, "pool shared tier capacity, GiB")
    redis_url: str | None = _env("TANDEM_POOL_REDIS_URL", None, "pool Redis tier every node shares "
                                 "(redis://[:password@]host:port/db, rediss:// for TLS; needs tandem-serve[redis]); "
                                 "unset: none")
    redis_gb: float = _env("TANDEM_POOL_REDIS_GB", 16.0, "pool Redis tier capacity, GiB")
    redis_prefix: str = _env("TANDEM_POOL_REDIS_PREFIX", "tandem:kvpool:", "prefix of the pool's Redis keys")
    codec: str = _env("TANDEM_POOL_CODEC", "auto",
                      "chunk codec: raw (lossless, uncompressed: the fastest warm reads), shuffle-zstd "
                      "(lossless, ~13 % fewer bytes), int8-zstd (lossy, opt-in), auto = shuffle-zstd when "
                      "TANDEM_POOL_REDIS_URL or TANDEM_POOL_SHARED_DIR is set (bytes cost more there), else raw")
    chunk_tokens: int = _env("TANDEM_POOL_CHUNK_TOKENS", 256, "tokens per pool chunk (a multiple of the block size)")
    tenant: str = _env("TANDEM_POOL_TENANT", "", "tenant salt: tenants never share pool entries")
    pin_share: float = _env("TANDEM_POOL_PIN_SHARE", 0.25, "a tenant's share of a pool tier for 24h pins (docs/api.md)")
    timeout: float = _env("TANDEM_POOL_TIMEOUT", 2.0, "seconds a worker waits, at most, for the pool to deliver "
                          "a prompt's cached prefix before it computes the prompt instead")
    backoff_s: float = _env("TANDEM_POOL_BACKOFF_S", 5.0, "after the pool failed or was too slow, seconds during "
                            "which workers compute prompts without asking it")
    drain_s: float = _env("TANDEM_POOL_DRAIN_S", 5.0, "at shutdown (SIGTERM), seconds a worker waits, at most, "
                          "for its pending KV write-backs to reach the pool (the rest are dropped, logged), "
                          "and a pool copy keeps taking them")
    key: str | None = _env("TANDEM_POOL_KEY", None, "secret the workers MAC pool entries with (an entry without "
                           "it is never loaded); unset: the one in TANDEM_POOL_KEY_FILE")
    key_file: str = _env("TANDEM_POOL_KEY_FILE", "~/.cache/tandem/pool.key", "file holding the pool secret when "
                         "TANDEM_POOL_KEY is unset; `tandem up` creates it (mode 0600) when missing; no file: "
                         "entries carry no MAC")

    def validate(self) -> None:
        from kvpool.codec import CODECS
        if self.codec != "auto" and self.codec not in CODECS:
            raise ValueError(f"TANDEM_POOL_CODEC must be auto or one of {', '.join(CODECS)}, got {self.codec!r}")
        if min(self.ram_mb, self.disk_gb, self.shared_gb, self.redis_gb) < 0:
            raise ValueError("TANDEM_POOL_RAM_MB, TANDEM_POOL_DISK_GB, TANDEM_POOL_SHARED_GB and "
                             "TANDEM_POOL_REDIS_GB must be >= 0")
        if min(self.chunk_tokens - 1, self.backoff_s, self.drain_s) < 0 or self.timeout <= 0 \
                or not 0 <= self.pin_share <= 1:
            raise ValueError("TANDEM_POOL_CHUNK_TOKENS must be >= 1, TANDEM_POOL_TIMEOUT > 0, TANDEM_POOL_BACKOFF_S "
                             ">= 0, TANDEM_POOL_DRAIN_S >= 0 and TANDEM_POOL_PIN_SHARE in [0, 1]")
        if self.chunk_tokens % KV_BLOCK_TOKENS:   # every worker failed at start (a crash loop)
            raise ValueError(f"TANDEM_POOL_CHUNK_TOKENS must be a multiple of the KV block ({KV_BLOCK_TOKENS} "
                             f"tokens), got {self.chunk_tokens}")

    def resolved_codec(self) -> str:
        """The codec workers write with: TANDEM_POOL_CODEC, ``auto`` resolved from the tiers."""
        if self.codec != "auto":
            return self.codec
        from kvpool.codec import LOSSLESS, RAW
        return LOSSLESS if self.redis_url or self.shared_dir else RAW

    def secret(self) -> bytes:
        """The MAC secret of pool entries (TANDEM_POOL_KEY, else TANDEM_POOL_KEY_FILE's contents; b"": none)."""
        return _secret(self.key, self.key_file, "TANDEM_POOL_KEY_FILE")

    def pool_config(self):
        """The kvpool.pool.PoolConfig these settings describe."""
        from kvpool.pool import PoolConfig
        return PoolConfig(ram_bytes=self.ram_mb << 20,
                          disk_dir=os.path.expanduser(self.dir) if self.dir else None,
                          disk_bytes=int(self.disk_gb * 2**30),
                          shared_dir=self.shared_dir, shared_bytes=int(self.shared_gb * 2**30),
                          redis_url=self.redis_url or None, redis_bytes=int(self.redis_gb * 2**30),
                          redis_prefix=self.redis_prefix, pin_share=self.pin_share).validate()


# the sampling parameters TANDEM_GENERATION_DEFAULTS may set, with their types
GENERATION_DEFAULTS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
                       "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float}


@dataclass
class GatewaySettings:
    """The OpenAI-compatible REST gateway."""
    host: str = _env("TANDEM_HOST", "127.0.0.1", "gateway bind address (0.0.0.0: every interface)")
    port: int = _env("TANDEM_PORT", 8000, "gateway HTTP port")
    api_key: str | None = _env("TANDEM_API_KEY", None, "bearer token clients must send; unset: no auth")
    api_keys: str | None = _env("TANDEM_API_KEYS", None, "more accepted bearer tokens, each with the tier "
                                "its requests default to: key1=interactive,key2=batch")
    default_tier: str = _env("TANDEM_DEFAULT_TIER", "standard",
                             "SLA tier when a request names none: interactive|standard|batch")
    liveness_check_s: float = _env("TANDEM_LIVENESS_CHECK_S", 0.5, "a stream quiet this long: the gateway asks "
                                   "the request's worker whether it still holds it (a dead one is found in one "
                                   "round trip and the request resumes elsewhere)")
    resume_attempts: int = _env("TANDEM_RESUME_ATTEMPTS", 3, "times one request is resumed after losing its "
                                "worker before the client gets an error")
    resume_wait_s: float = _env("TANDEM_RESUME_WAIT_S", 30.0, "seconds a lost request waits for a worker that "
                                "can take it over before the client gets an error")
    max_body_bytes: int = _env("TANDEM_MAX_BODY_BYTES", 32 << 20, "larger request bodies get 413, chunked uploads "
                               "too (counted as they arrive, never buffered past it)")
    read_timeout_s: float = _env("TANDEM_READ_TIMEOUT_S", 60.0, "seconds a client has to send a request's "
                                 "headers (from connecting, or from its last request: else the connection is "
                                 "closed), then its whole body (else 408 request_timeout)")
    write_timeout_s: float = _env("TANDEM_WRITE_TIMEOUT_S", 60.0, "seconds a response may wait for its client "
                                  "to read (the connection's buffers full: a client that stopped reading); then "
                                  "it is closed and its request aborted, its stream slot freed")
    max_streams_per_key: int = _env("TANDEM_MAX_STREAMS_PER_KEY", 256, "generation requests (streamed or not) one "
                                    "API key may have in flight; more get 429 too_many_streams; keyless clients "
                                    "count as one key; 0 = no cap")
    tokenize_threads: int = _env("TANDEM_TOKENIZE_THREADS", 2, "threads that parse, template and tokenize large "
                                 "requests (bodies over 16 KiB) off the event loop; more wait for one")
    responses_retention_s: float = _env("TANDEM_RESPONSES_RETENTION_S", 30 * 86400.0, "stored Responses "
                                        "(/v1/responses with store) are kept this long")
    responses_max_per_tenant: int = _env("TANDEM_RESPONSES_MAX_PER_TENANT", 10000, "stored Responses one API "
                                         "key keeps at most; one more removes its oldest; 0 = no cap")
    responses_max_bytes_per_tenant: int = _env("TANDEM_RESPONSES_MAX_BYTES_PER_TENANT", 1 << 30, "bytes of stored "
                                               "Responses (their records: response, input items, conversation) one "
                                               "API key keeps at most; oldest out first; 0 = no cap")
    drain_s: float = _env("TANDEM_DRAIN_S", 30.0, "on SIGTERM, in-flight requests get this long: at the "
                          "gateway a stream still going then ends with an error event; an engine worker hands "
                          "its decodes to other workers and waits this long for the rest, then cuts it (resumed "
                          "elsewhere)")
    served_model_name: str | None = _env("TANDEM_SERVED_MODEL_NAME", None, "the model id clients send and "
                                         "/v1/models lists; unset: the model file's stem (SmolLM2-135M-Instruct)")
    generation_defaults: str | None = _env("TANDEM_GENERATION_DEFAULTS", None, "what a request leaves out, for "
                                           "clients that cannot set it (Codex sends no temperature or output cap): "
                                           "temperature=0,max_tokens=256,repetition_penalty=1.1 (also top_p, top_k, "
                                           "min_p, presence_penalty, frequency_penalty); unset: OpenAI's defaults, "
                                           "max_tokens the rest of the context")
    tool_parser: str | None = _env("TANDEM_TOOL_PARSER", None, "tool-call format: hermes | llama3_json | mistral; "
                                   "unset: from the vocabulary's markers, else hermes")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "GatewaySettings":
        """Defaults, then ``env`` (default os.environ), then ``overrides`` (None = not given)."""
        s = _section_from_env(cls, os.environ if env is None else env)
        for k, v in overrides.items():
            if v is not None:
                setattr(s, k, v)
        s.validate()
        return s

    def defaults(self) -> dict[str, float]:
        """TANDEM_GENERATION_DEFAULTS parsed: {parameter: value}."""
        out: dict[str, float] = {}
        for item in filter(None, (x.strip() for x in (self.generation_defaults or "").split(","))):
            key, _, raw = item.partition("=")
            key = key.strip()
            kind = GENERATION_DEFAULTS.get(key)
            if kind is None:
                raise ValueError(f"TANDEM_GENERATION_DEFAULTS: unknown parameter {key!r} (one of "
                                 f"{', '.join(GENERATION_DEFAULTS)})")
            try:
                out[key] = kind(raw)
            except ValueError:
                raise ValueError(f"TANDEM_GENERATION_DEFAULTS: {key}={raw!r} is not "
                                 f"{'an integer' if kind is int else 'a number'}") from None
        from shared.engine.sampling import SamplingParams
        try:        # the ranges a request's own values must meet (a bad default would fail every request)
            SamplingParams(**out).validate()
        except ValueError as e:
            raise ValueError(f"TANDEM_GENERATION_DEFAULTS: {e}") from None
        return out

    def validate(self) -> "GatewaySettings":
        from shared.tier import TIERS
        if not 0 < self.port <= 65535:
            raise ValueError(f"TANDEM_PORT must be in 1..65535, got {self.port}")
        self.defaults()  # a ValueError naming the bad entry
        if self.default_tier not in TIERS:
            raise ValueError(f"TANDEM_DEFAULT_TIER must be one of {', '.join(TIERS)}, got {self.default_tier!r}")
        if self.liveness_check_s <= 0 or self.resume_wait_s <= 0 or self.resume_attempts < 0:
            raise ValueError("TANDEM_LIVENESS_CHECK_S and TANDEM_RESUME_WAIT_S must be > 0, "
                             "TANDEM_RESUME_ATTEMPTS >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError("TANDEM_MAX_BODY_BYTES must be >= 1024")
        if not self.read_timeout_s > 0 or not self.write_timeout_s > 0:
            raise ValueError("TANDEM_READ_TIMEOUT_S and TANDEM_WRITE_TIMEOUT_S must be > 0")
        if self.max_streams_per_key < 0:
            raise ValueError("TANDEM_MAX_STREAMS_PER_KEY must be >= 0 (0 = no cap)")
        if self.tokenize_threads < 1:
            raise ValueError("TANDEM_TOKENIZE_THREADS must be >= 1")
        if self.responses_max_per_tenant < 0 or self.responses_max_bytes_per_tenant < 0:
            raise ValueError("TANDEM_RESPONSES_MAX_PER_TENANT and TANDEM_RESPONSES_MAX_BYTES_PER_TENANT must be >= 0 "
                             "(0 = no cap)")
        if self.drain_s < 0:
            raise ValueError("TANDEM_DRAIN_S must be >= 0")
        if self.responses_retention_s <= 0:   # JetStream refuses a negative age: every store failed, the 200s said stored
            raise ValueError("TANDEM_RESPONSES_RETENTION_S must be > 0")
        if self.tool_parser is not None and self.tool_parser not in ("hermes", "llama3_json", "mistral"):
            raise ValueError(f"TANDEM_TOOL_PARSER must be hermes, llama3_json or mistral, got {self.tool_parser!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("TANDEM_SERVED_MODEL_NAME must not be empty")
        self.key_tiers()
        return self

    def key_tiers(self) -> dict[str, str]:
        """Accepted bearer tokens -> the default tier of their requests (empty: no auth)."""
        from shared.tier import TIERS
        keys = {self.api_key: self.default_tier} if self.api_key else {}
        for item in (self.api_keys or "").split(","):
            if not item.strip():
                continue
            key, sep, tier = item.strip().rpartition("=")
            if not sep or not key or tier not in TIERS:
                raise ValueError(f"TANDEM_API_KEYS entry {item.strip()!r}: expected KEY=TIER with TIER one of "
                                 f"{', '.join(TIERS)}")
            keys[key] = tier
        return keys


@dataclass
class Settings:
    """Everything, one section per concern."""
    nats: NatsSettings = field(default_factory=NatsSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    priority: PrioritySettings = field(default_factory=PrioritySettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    data: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Build from ``env`` (default os.environ); ``overrides`` replace whole sections."""
        env = os.environ if env is None else env
        sections = {f.name: _section_from_env(f.type_cls, env) for f in _sections()}
        sections.update(overrides)
        s = cls(**sections)
        s.validate()
        return s

    def validate(self) -> None:
        for f in _sections():
            getattr(self, f.name).validate()


@dataclass
class _Section:
    name: str
    type_cls: type


def _sections() -> list[_Section]:
    hints = typing.get_type_hints(Settings)
    return [_Section(f.name, hints[f.name]) for f in dataclasses.fields(Settings)]


def _section_from_env(cls: type, env: Mapping[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        var = f.metadata["env"]
        if var in env:
            kwargs[f.name] = _parse(env[var], hints[f.name], var)
    return cls(**kwargs)


def _parse(raw: str, tp: Any, var: str) -> Any:
    args = typing.get_args(tp)
    if type(None) in args:  # X | None: empty means None
        if raw.strip() == "":
            return None
        tp = next(a for a in args if a is not type(None))
    try:
        if tp is bool:
            v = raw.strip().lower()
            if v in _TRUE:
                return True
            if v in _FALSE:
                return False
            raise ValueError("expected true/false")
        if tp is int:
            return int(raw)
        if tp is float:
            v = float(raw)
            if not math.isfinite(v):   # nan passes every "x <= 0" check, inf overflows what it sizes
                raise ValueError("expected a finite number")
            return v
        return raw
    except ValueError as e:
        raise ValueError(f"{var}={raw!r}: {e}") from None


def env_vars() -> list[tuple[str, str, str]]:
    """(variable, default, help) for every setting, in section order."""
    out = []
    for sec in _sections():
        for f in dataclasses.fields(sec.type_cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append((f.metadata["env"], "" if default is None else str(default), f.metadata["help"]))
    return out


# Variables read where they are used rather than through Settings: the kernels' and benches'
# knobs (docs/kernels.md, docs/benchmarks.md, docs/observability.md). Listed so that a name in
# neither is reported (``unknown_env``); tests/unit/test_settings.py checks the list is whole.
ELSEWHERE: dict[str, str] = {
    "TANDEM_KERNELS": "auto or reference (kernels/dispatch.py)",
    "TANDEM_CACHE_DIR": "where the CPU kernels' built libraries live (kernels/cpu.py)",
    "TANDEM_CXXFLAGS": "extra g++ flags for the CPU kernels",
    "TANDEM_CPU_ISA": "cap the CPU kernels' path: scalar, avx2, avx512vnni, neon, amx",
    "TANDEM_CPU_ACT": "the CPU matmuls' activations: q16, f32 or q8",
    "TANDEM_CPU_FUSED": "0: the CPU model op by op",
    "TANDEM_GPU_AHEAD": "1 (the default on CUDA): launch the next decode step before reading this one's tokens",
    "TANDEM_GPU_DECODE_ATTN": "dot (the default; 3xTF32, where the matmuls are not ieee) or sum: a decode's attention",
    "TANDEM_GPU_GEMM_ROWS": "prefill steps of at least this many rows through cuBLAS",
    "TANDEM_GPU_GEMM_CACHE_MB": "tf32x3: MB of the weights' TF32 split kept on the device for those cuBLAS "
                                "matmuls (2048; 8 bytes a weight; 0: split at each call)",
    "TANDEM_GPU_PDL": "0 (the default), 1 or exit: programmatic dependent launch (sm_90+), the next "
                      "kernel let launch right after each wait (1) or as each kernel's programs exit",
    "TANDEM_GPU_PRECISION": "ieee, tf32 or tf32x3 (the default on CUDA): the matmuls' dots",
    "TANDEM_GPU_PREFETCH": "auto, 0 or 1: a K step's weights fetched during the step before",
    "TANDEM_GPU_PREFILL_ATTN": "ieee, tf32, fp16 or tf32x3: the prefill attention's dots",
    "TANDEM_GPU_PREFILL_TILE": "BLOCK_Q,BLOCK_K,WARPS,SEG: the prefill attention's tile",
    "TANDEM_GPU_REDUCE": "fused or launch: split sums by the last program or launches of their own",
    "TANDEM_GPU_SAMPLE": "0: every draw on the host",
    "TANDEM_GPU_STEP_INTERPRET": "1: the fused step in Triton's interpreter off CUDA (tests)",
    "TANDEM_GPU_TUNING": "the matmul tiles' table (a JSON file, or none)",
    "TANDEM_LLAMA_CPP_CFLAGS": "extra flags for the llama.cpp build `tandem bench kernels --with-llama-cpp` makes",
    "TANDEM_LLAMA_CPP_VENV": "where that build's virtual environment lives",
    "TANDEM_MODELED_GPU_US": "bench.gpu_host's modeled device time a step",
    "TANDEM_OTLP_ENDPOINT": "send trace spans to this OTLP/HTTP endpoint (docs/observability.md)",
    "TANDEM_VENV": "where scripts/setup puts the virtual environment",
    "TANDEM_BASE_IMAGE": "scripts/compose-check's and kube-check's base image",
    "TANDEM_NATS_HOST_PORT": "scripts/compose-check's NATS port on the host",
    "TANDEM_LLAMA_CUDA_DIR": "scripts/gpu-check's llama.cpp CUDA build",
}


def unknown_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """{name: one line} for each ``TANDEM_*`` variable of ``env`` (default os.environ) that nothing
    reads — a typo such as TANDEM_THREDS would otherwise be ignored in silence — naming the
    closest known variable where one is close."""
    import difflib
    env = os.environ if env is None else env
    known = {v for v, _, _ in env_vars()} | set(ELSEWHERE)
    out = {}
    for name in sorted(n for n in env if n.startswith("TANDEM_") and n not in known):
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        out[name] = (f"{name} is not a Tandem setting and is ignored"
                     + (f": did you mean {near[0]}?" if near else " (`tandem up --help` lists them)"))
    return out


def env_help() -> str:
    """Text for --help epilogs: one line per variable."""
    width = max(len(v) for v, _, _ in env_vars())
    lines = ["environment variables:"]
    for var, default, help in env_vars():
        suffix = f" (default {default})" if default else ""
        lines.append(f"  {var:<{width}}  {help}{suffix}")
    return "\n".join(lines)


SECTION_TITLES = {"nats": "The bus (NATS)", "worker": "Engine workers", "priority": "OS priorities",
                  "router": "The router", "data": "The data plane (KV transfers, rings)",
                  "pool": "The KV pool", "gateway": "The gateway (HTTP)"}


def settings_markdown() -> str:
    """docs/settings.md: every variable with its default and what it does, by section, then the
    ones read where they are used (``ELSEWHERE``). Generated (``python -m shared.settings``); a
    test keeps the file equal to it."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")
    lines = ["# Settings", "",
             "Every `TANDEM_*` environment variable, generated from `shared/settings.py` (`python -m "
             "shared.settings > docs/settings.md`; a test keeps this file equal to it). Each service reads "
             "these at start; `tandem up` passes them to every process it starts, and refuses a value no "
             "service could run with before anything starts. `tandem up --help` prints the same list."]
    for sec in _sections():
        lines += ["", f"## {SECTION_TITLES.get(sec.name, sec.name)}", "", "| variable | default | what |",
                  "|---|---|---|"]
        for f in dataclasses.fields(sec.type_cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = "" if default is None or default == "" else f"`{default}`"
            lines.append(f"| `{f.metadata['env']}` | {cell(shown)} | {cell(f.metadata['help'])} |")
    lines += ["", "## Read where they are used", "",
              "Kernel, benchmark and script knobs (docs/kernels.md, docs/benchmarks.md, docs/testing.md):", "",
              "| variable | what |", "|---|---|"]
    lines += [f"| `{var}` | {cell(text)} |" for var, text in ELSEWHERE.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(settings_markdown(), end="")
