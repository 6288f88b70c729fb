"""Every message on the bus: a typed, versioned dataclass (the envelope: shared/envelope.py).

A change to a message's fields that an old reader cannot accept bumps its VERSION; a peer
speaking the old one is refused by ``decode`` with both versions named.
"""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from shared.envelope import (  # noqa: F401  (re-exported: the bus and every service import them from here)
    ERROR_STATUS, MAX_PAYLOAD, REGISTRY, MessageTooLarge, SchemaError, decode, encode, from_fields, message, to_dict,
)


# ---------------------------------------------------------------------------------------------
# Messages. Every field carries a comment; defaults exist only where "absent" is meaningful.
# ---------------------------------------------------------------------------------------------

@message("TransferHandle", 1)
class TransferHandle:
    """Where and how a KV payload travels on the data plane (the bus carries only this)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    transfer_id: str            # unique per transfer; the receiver's key for take()
    host: str                   # receiver's data-plane host
    port: int                   # receiver's data-plane port
    nbytes: int                 # payload size in bytes
    checksum: str               # "<algo>:<hex>" of the payload (xxh3, blake3 or crc32)
    path: str = "tcp"           # transport: "tcp" (later "rdma", "shm", "bus")
    num_tokens: int = 0         # tokens whose KV the payload holds
    meta: dict = field(default_factory=dict)  # layout (dtype, shapes, block size): small only


@message("RingPeer", 1)
class RingPeer:
    """A member of a ring (cpu-ring(N), docs/strategies.md), in shard order in a plan."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    worker: str                 # its worker id
    host: str                   # its data-plane host (from its heartbeat)
    port: int                   # its ring port (Heartbeat.ring_port)

    def as_list(self) -> list:
        """[worker, host, port] (what ``shared/ring`` plans and logs take)."""
        return [self.worker, self.host, self.port]


@message("RingClaim", 1)
class RingClaim:
    """The ticket a prefill parked a ring's other shards under, for the coordinator to claim."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    ticket: str                 # 32 to 128 hex digits (shared/ring/connector.new_ticket)
    ranges: list[list[int]]     # [start, end) of every member in shard order, as the prefill planned them


@message("InFlight", 1)
class InFlight:
    """A request a worker holds, as its heartbeat lists it."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str
    session_id: str             # "" = none
    tier: str


@message("RouteRequest", 4)
class RouteRequest:
    """gateway -> router: how should this request run?"""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str             # gateway-assigned, unique, a valid subject token
    model: str                  # model name the client asked for
    tier: str                   # "interactive" | "standard" | "batch"
    session_id: str | None      # agent session for affinity; None = stateless
    num_prompt_tokens: int      # prompt length after the chat template
    max_tokens: int             # new tokens at most
    prompt_token_ids: list[int] = field(default_factory=list)  # the prompt: the router keys its chunks
    exclude: list[str] = field(default_factory=list)  # workers not to use (found dead for this request)
    attempt: int = 0            # 0: a new request; k > 0: its k-th resume (tokens so far in the prompt)
    tenant: str = ""            # whose KV it may reuse (kvpool.keys.tenant_salt; "" = public)
    owner: str = ""             # the API key's tenant: a session belongs to the key that created it


@message("RoutePlan", 4)
class RoutePlan:
    """router -> gateway: the execution strategy for one request; also published on
    ``tandem.router.decision`` (every router copy applies it to its session table; tap shows it)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str
    prefill_worker: str | None  # None: the decode worker runs the prompt itself (generate)
    decode_worker: str          # worker id of the decode worker
    decode_role: str            # "gpu-decode" | "cpu-decode"
    reason: str                 # short human-readable why (logged, shown by tap)
    decode_data_host: str = ""  # decode worker's data-plane address (from its heartbeat)
    decode_data_port: int = 0
    tier: str = "standard"      # the tier the request runs at
    session_id: str | None = None  # its agent session, if any
    cached_tokens: int = 0      # prompt tokens the chosen path finds cached (worker or pool)
    cached_at: str = ""         # where: a worker id, "pool", or "" (nothing cached)
    router: str = ""            # the router copy that decided
    moved_from: str = ""        # a move of a running request: the worker it left ("" = a placement)
    owner: str = ""             # the session's owner (RouteRequest.owner)
    strategy: str = ""          # how it decodes: "gpu", "cpu" or "cpu-ring(N)" (shared/strategy.py)
    ring: list[RingPeer] = field(default_factory=list)  # cpu-ring: the members in shard order; the
                                                        # first is the coordinator (decode_worker)
    context_tokens: int = 0     # the session's prompt now (its length; 0: not a session's turn) ...
    context_digest: str = ""    # ... and placement.context_digest of it: every router copy knows what
                                # the session's worker holds for its next turn


@message("MigrateRequest", 2)
class MigrateRequest:
    """router -> subjects.worker_migrate(source): move a running request to another decode worker
    at a decode-step boundary (KV + sampler state over the data plane; the stream goes on)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str
    target_worker: str           # decode worker that continues the request
    target_data_host: str        # its data-plane receiver (from its heartbeat)
    target_data_port: int
    tier: str                    # the tier the request runs at from now on
    reason: str = ""             # why (logged)
    ring: list[RingPeer] = field(default_factory=list)  # spread it onto this ring (RoutePlan.ring; the
                                                        # target is its coordinator); empty: one worker


@message("MigrateReply", 1)
class MigrateReply:
    """source worker -> router: the request now runs on ``target`` from stream seq ``next_seq``."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str
    source: str                  # worker it left
    target: str                  # worker it runs on now
    next_seq: int                # first StreamChunk.seq the target publishes
    num_tokens: int              # tokens whose KV moved
    nbytes: int                  # KV bytes moved
    seconds: float               # export -> target acked
    path: str = ""               # data-plane path used ("shm", "tcp", ...)


@message("SessionUpdate", 2)
class SessionUpdate:
    """gateway (POST /v1/sessions/{id}) -> subjects.ROUTER_SESSION: a session's new tier (another
    owner's session: error "not_found")."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    session_id: str
    tier: str
    owner: str = ""              # the API key's tenant (RouteRequest.owner)


@message("SessionState", 2)
class SessionState:
    """router -> gateway: where a session's work runs now, and what moved."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    session_id: str
    tier: str
    worker: str | None           # decode worker holding the session's KV (None: none yet)
    running: list[str]           # its requests in flight
    moved: list[dict] = field(default_factory=list)  # MigrateReply fields of each move made now
    reason: str = ""
    router: str = ""             # the router copy that made the change
    owner: str = ""              # the session's owner (RouteRequest.owner)


@message("Resume", 1)
class Resume:
    """What a worker needs to continue a request exactly where the client is: the tokens the
    client has seen are appended to the prompt and computed (from the prefix cache / KV pool where
    they are), the next draw is number ``len(output_token_ids)`` of the request's seed."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    output_token_ids: list[int]  # tokens the client has received, in order
    emitted_chars: int           # characters of their text the client has received
    next_seq: int                # StreamChunk.seq of the first chunk of this attempt
    attempt: int                 # k-th resume (k >= 1); chunks and aborts of older attempts are ignored


@message("PrefillRequest", 4)
class PrefillRequest:
    """gateway -> one prefill worker (reply Ack); it streams the first token, then hands off."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str
    prompt_token_ids: list[int]  # the whole prompt (elided by tap unless --show-text)
    sampling: dict               # SamplingParams.to_dict()
    tier: str                    # SLA tier; the scheduler's priority follows from it
    decode_worker: str           # who continues after prefill
    decode_subject: str          # subjects.worker_decode(decode_worker)
    stream_subject: str          # subjects.stream(request_id)
    decode_data_host: str = ""   # where to send the KV (decode worker's receiver)
    decode_data_port: int = 0
    session_id: str | None = None
    priority: int | None = None  # explicit scheduler priority; None = from tier
    resume: Resume | None = None  # continue a request whose worker was lost (first chunk: resume.next_seq)
    origin: str = ""             # the gateway that waits for the stream (workers drop the request if it dies)
    tenant: str = ""             # whose cached KV it may reuse (RouteRequest.tenant)
    ring: list[RingPeer] = field(default_factory=list)  # RoutePlan.ring: the decode worker coordinates it
    cache_retention: str = ""    # prompt_cache_retention: "" | in_memory | 24h (the session's KV, docs/api.md)


@message("DecodeRequest", 3)
class DecodeRequest:
    """prefill worker -> decode worker: import the KV in ``handle`` and continue decoding (the
    blob's header carries the request's tenant)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str
    handle: TransferHandle       # the KV bytes, arriving (or arrived) on the data plane
    prompt_token_ids: list[int]  # needed for penalties, stop checks and session reuse
    output_token_ids: list[int]  # tokens already generated (the prefill's first token)
    sampling: dict               # SamplingParams.to_dict()
    tier: str
    stream_subject: str
    next_seq: int = 1            # StreamChunk.seq the decode worker starts at
    session_id: str | None = None
    attempt: int = 0             # the request's attempt (StreamChunk.attempt)
    origin: str = ""             # the gateway that waits for the stream
    ring: list[RingPeer] = field(default_factory=list)  # RoutePlan.ring: scatter the KV over these
                                                        # members and coordinate it (empty: decode here)
    claim: RingClaim | None = None  # with ring: the prefill scattered the other members' ranges itself,
                                    # parked under this ticket; the handle carries this worker's range
                                    # only (None: the whole KV, this worker scatters)
    at_cap: str = "queue"        # with every sequence slot here taken: "queue" (wait, KV in host memory:
                                 # a hand-off from prefill), "refuse" (overloaded: a live move, which its
                                 # source keeps running), "run" (past the cap: a stopping worker's move)


@message("GenerateRequest", 4)
class GenerateRequest:
    """gateway -> decode worker: run prefill and decode here (plan without a prefill worker)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict               # SamplingParams.to_dict()
    tier: str
    stream_subject: str
    session_id: str | None = None
    resume: Resume | None = None  # continue a request whose worker was lost
    origin: str = ""             # the gateway that waits for the stream
    tenant: str = ""             # whose cached KV it may reuse (RouteRequest.tenant)
    cache_retention: str = ""    # prompt_cache_retention: "" | in_memory | 24h (the session's KV, docs/api.md)


@message("StreamChunk", 3)
class StreamChunk:
    """worker -> gateway on subjects.stream(request_id): new tokens, in seq order."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str
    seq: int                     # 0, 1, 2, ... per request across prefill and decode workers
    token_ids: list[int]         # tokens new in this chunk
    text: str                    # their text (stop strings trimmed)
    worker: str                  # worker id that produced it
    logprobs: list | None = None  # per token {"token_id", "logprob", "top": [[id, lp], ...]}
    finish_reason: str | None = None  # set on the last chunk: "stop" | "length" (a dropped request sends none)
    usage: dict | None = None    # last chunk: {"prompt_tokens", "completion_tokens", "cached_tokens"}
    attempt: int = 0             # the request's attempt that produced it (a resume starts a new one)
    reused_tokens: int = -1      # first chunk of a resumed attempt: tokens of KV reused (-1: not a resume)
    recomputed_tokens: int = 0   # ... and recomputed
    offset: int = -1             # output tokens of the request before this chunk's (-1: not said); the
    #                              gateway takes a chunk only where it continues what the client has


@message("Abort", 2)
class Abort:
    """broadcast on subjects.ABORT: every service holding the request drops it."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str
    reason: str = ""
    below_attempt: int = 0       # > 0: drop only copies of attempts before this one (a resume fences them)


@message("Where", 1)
class Where:
    """gateway -> subjects.worker_where(id): does this worker still hold the request? No
    responders means the worker is gone (the server drops a dead client's subscriptions at once)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str


@message("WhereReply", 1)
class WhereReply:
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    worker: str
    holds: bool                  # the request runs (or waits, or is parked) here
    handed_to: str = ""          # not here: the worker it was handed to or moved to ("" = finished/unknown)
    ready: bool = True           # the engine makes progress (False: a step has hung)
    attempt: int = 0             # the attempt it holds


@message("Lease", 1)
class Lease:
    """worker -> subjects.gateway_alive(gateway), every heartbeat interval: the requests of that
    gateway it holds (request id -> attempt). Answered with a LeaseReply."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    worker: str
    requests: dict = field(default_factory=dict)   # request id -> the attempt held here


@message("LeaseReply", 1)
class LeaseReply:
    """gateway -> worker: the attempt the gateway waits for, per request it still runs; a
    request it does not list is one it let go (finished, failed, its client gone)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    gateway: str
    attempts: dict = field(default_factory=dict)   # request id -> current attempt


@message("Heartbeat", 4)
class Heartbeat:
    """worker -> subjects.heartbeat(role, id), every few seconds: readiness and load."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    worker_id: str
    role: str                    # one of subjects.ROLES
    device: str                  # "cuda:0", "cpu", ...
    model: str                   # model name served
    ready: bool                  # accepts work now
    queue_depth: int             # requests waiting
    running: int                 # sequences running
    free_kv_blocks: int
    total_kv_blocks: int
    max_context: int             # longest context (tokens) this worker accepts
    data_host: str               # data-plane receiver address ("" = none)
    data_port: int               # 0 = none
    ts: float                    # sender's time.time()
    interval: float = 2.0        # seconds to the next heartbeat (the router's liveness window)
    metrics_port: int = 0        # the sender's Prometheus /metrics HTTP port (0 = none)
    waiting_by_tier: dict = field(default_factory=dict)  # tier -> requests waiting at that tier
    tpot_ms: float = 0.0         # measured time per output token, recent average (0 = none yet)
    requests: list[InFlight] = field(default_factory=list)  # the requests it holds
    kv_scope: str = ""           # hex seed of the pool key scope (kvpool.keys.KeyScope.seed())
    chunk_tokens: int = 0        # tokens per pool chunk key (0 = no pool keys)
    kv_block_tokens: int = 0     # tokens per KV block (free tokens = free_kv_blocks x this)
    ring_port: int = 0           # cpu-decode: the data-plane port it hosts ring members on (0 = none)
    kv_tokens: dict = field(default_factory=dict)  # running requests: id -> [tokens now, tokens at its end
                                                   # (prompt + max_tokens), ring members (1: here alone)]
    max_running: int = 0         # sequences it runs at once at most (0: not said)
    ended: list[str] = field(default_factory=list)  # requests that left it lately (finished, handed off,
                                                    # moved, aborted): the router stops counting them
    draining: bool = False       # stopping (SIGTERM): takes no new work, and is not coming back; the
                                 # router moves what it holds to other workers (ready is False)
    waiting_by_owner: dict = field(default_factory=dict)  # API key's tenant -> {tier: requests waiting}
                                                          # (those with any: a full tier queue's shares)


@message("Ack", 1)
class Ack:
    """Reply: the request was accepted (its results come elsewhere, e.g. the stream subject)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    request_id: str = ""
    worker: str = ""


@message("ErrorReply", 4)
class ErrorReply:
    """The error envelope: a reply to a failed request, or a message on a stream subject."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    code: str                    # a key of ERROR_STATUS
    message: str                 # human-readable, safe to show a client
    status: int = 500            # HTTP status hint for the gateway
    request_id: str = ""
    retry_after: float = 0.0     # "overloaded": seconds the client should wait (HTTP Retry-After)
    attempt: int = 0             # on a stream: the request's attempt that failed (older ones are ignored)
    lost: str = ""               # the worker found gone ("": the sender's own failure; a ring: a member;
    #                              a prefill's failed hand-off: the decode worker it did not reach)
    sender_ok: bool = False      # nobody is gone: a live peer's answer failed the sender (a decode worker
    #                              refusing a prefill's hand-off), so a resume may route to both again
    param: str = ""              # the request field at fault: "prompt" or "max_tokens" for prompt_too_long
    #                              (the gateway answers with its endpoint's name of it: messages, input, ...)

    @classmethod
    def of(cls, code: str, message: str, request_id: str = "", retry_after: float = 0.0) -> "ErrorReply":
        return cls(code=code, message=message, status=ERROR_STATUS.get(code, 500),
                   request_id=request_id, retry_after=retry_after)


@message("TransferEvent", 2)
class TransferEvent:
    """For tap and metrics: one KV transfer finished (or failed)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    transfer_id: str
    request_id: str
    nbytes: int                  # payload bytes
    seconds: float
    path: str                    # "shm", "tcp", "tcp+zstd", "rdma"
    ok: bool = True
    error: str = ""
    wire_bytes: int = 0          # bytes that crossed the link (compressed size; 0 = nbytes)
    attempts: int = 1            # paths tried (a failed path is retried on the next one)


# ---------------------------------------------------------------------------------------------
# KV pool (services/kvpool.py): lookup / get / put over the bus, bulk bytes on the data plane
# ---------------------------------------------------------------------------------------------

@message("PoolLookup", 2)
class PoolLookup:
    """How many leading chunks of a prompt the pool holds (kvpool.keys chunk keys)."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    keys: list[str]              # chunk keys in prompt order (64 hex chars each)
    for_put: bool = False        # a write-back asks: it puts the missing chunks next (a pool
                                 # stopping waits for that put, TANDEM_POOL_DRAIN_S at most)
    alternatives: int = 0        # the last N keys are alternatives for the piece after the others
                                 # (tails, longest first): the first stored one is the hit
    pin_s: float = 0.0           # for_put: pin the stored leading keys this long (prompt_cache_retention 24h)
    tenant: str = ""             # ... under this tenant (its share of the pool: TANDEM_POOL_PIN_SHARE)


@message("PoolLookupReply", 2)
class PoolLookupReply:
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    pool_id: str                 # the answering pool copy (get/put go to it: subjects.kvpool_get/put)
    hits: int                    # leading keys stored
    tiers: list[str]             # tier of each hit ("ram", "disk", "shared"), then the alternative's
    chunk_tokens: int = 256      # tokens per chunk
    data_host: str = ""          # the pool's data-plane receiver (for put)
    data_port: int = 0
    alternative: int = -1        # index among PoolLookup's alternatives of the first stored one
                                 # (looked at only when every other key is stored; -1: none)


@message("PoolGet", 1)
class PoolGet:
    """Send these entries (a bundle) to the requester's data-plane receiver."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    keys: list[str]
    transfer_id: str             # the requester's key for take()
    host: str                    # requester's data-plane receiver
    port: int


@message("PoolGetReply", 2)
class PoolGetReply:
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    found: int                   # leading keys sent (a miss ends the bundle)
    nbytes: int = 0              # bundle bytes sent (0 when found == 0)
    path: str = ""
    checksum: str = ""           # "<algo>:<hex>" of the bundle sent: the requester checks it ("" when found == 0)


@message("PoolPut", 3)
class PoolPut:
    """Entries (a bundle) already sent to the pool's receiver under ``transfer_id``."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    keys: list[str]
    transfer_id: str
    nbytes: int                  # the bundle's size and checksum ("<algo>:<hex>", as sent): the pool
    checksum: str                # stores it only if what it received matches
    pin_s: float = 0.0           # pin the entries this long (prompt_cache_retention 24h; 0: not pinned)
    tenant: str = ""             # ... under this tenant (its share of the pool: TANDEM_POOL_PIN_SHARE)
    replace: list[str] = field(default_factory=list)  # of ``keys``, those the pool holds whose entries the
    #                              writer could not use (their MAC did not check out: another secret's,
    #                              or altered): stored over what it holds (the others are kept if held)


@message("PoolPutReply", 1)
class PoolPutReply:
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    stored: int                  # entries stored in at least one tier


@message("KVEvent", 2)
class KVEvent:
    """Pool chunks a KV holder (a worker's prefix cache, a pool copy) gained or lost, on
    ``subjects.kv_events(holder)``. Net changes: a key is in at most one list. A holder numbers
    its events 1, 2, ... within an epoch (its start), so a reader sees gaps and restarts."""
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    holder: str                  # worker id or pool id
    role: str                    # the holder's role (subjects.ROLES)
    epoch: int                   # the holder's start, time.time_ns(): a newer epoch starts from empty
    seq: int                     # 1, 2, ... per holder and epoch
    stored: list[str] = field(default_factory=list)   # chunk keys now held
    evicted: list[str] = field(default_factory=list)  # chunk keys no longer held
