"""Wire schemas: round trips, envelope, version and type checks, size limit; subject names."""

from __future__ import annotations

import orjson
import pytest

from shared import schemas, subjects
from shared.engine.sampling import SamplingParams
from shared.schemas import (
    MAX_PAYLOAD, Abort, Ack, DecodeRequest, ErrorReply, GenerateRequest, Heartbeat,
    MessageTooLarge, PrefillRequest, RoutePlan, RouteRequest, SchemaError, StreamChunk,
    TransferEvent, TransferHandle, decode, encode,
)

HANDLE = TransferHandle(transfer_id="t-1", host="127.0.0.1", port=5555, nbytes=1 << 20,
                        checksum="blake3:00ff", num_tokens=12, meta={"dtype": "float16"})
SAMPLING = SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]).to_dict()
RING = [schemas.RingPeer("cpu-0", "127.0.0.1", 7000), schemas.RingPeer("cpu-1", "127.0.0.1", 7001)]
CLAIM = schemas.RingClaim("ab" * 16, [[0, 64], [64, 256]])

EXAMPLES = [
    RouteRequest("r1", "smollm2", "interactive", "s1", 120, 64),
    RouteRequest("r1", "smollm2", "batch", None, 120, 64, prompt_token_ids=[1, 2, 3]),
    RoutePlan("r1", "prefill-0", "gpu-0", subjects.GPU_DECODE, "interactive -> gpu",
              decode_data_host="127.0.0.1", decode_data_port=4000),
    RoutePlan("r1", None, "cpu-0", subjects.CPU_DECODE, "short prompt"),
    PrefillRequest("r1", [1, 2, 3], SAMPLING, "standard", "cpu-0", subjects.worker_decode("cpu-0"),
                   subjects.stream("r1"), "127.0.0.1", 4000, session_id="s1"),
    DecodeRequest("r1", HANDLE, [1, 2, 3], [4], SAMPLING, "standard", subjects.stream("r1")),
    GenerateRequest("r1", [1, 2, 3], SAMPLING, "batch", subjects.stream("r1")),
    StreamChunk("r1", 0, [4], "Hi", "prefill-0"),
    StreamChunk("r1", 5, [], "", "cpu-0", logprobs=[{"token_id": 4, "logprob": -0.1, "top": [[4, -0.1]]}],
                finish_reason="length",
                usage={"prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0}),
    Abort("r1", "client disconnected"),
    Heartbeat("cpu-0", subjects.CPU_DECODE, "cpu", "smollm2", True, 0, 2, 100, 128, 8192,
              "127.0.0.1", 4000, 1700000000.5),
    Ack("r1", "cpu-0"),
    ErrorReply.of("overloaded", "queue full", "r1"),
    TransferEvent("t-1", "r1", 1 << 20, 0.01, "tcp"),
    TransferEvent("t-2", "", 1 << 20, 0.01, "tcp+zstd", wire_bytes=900_000, attempts=2),
    schemas.PoolLookup(["ab" * 32]),
    schemas.PoolLookupReply("kvpool-0", 1, ["ram"], 256, "127.0.0.1", 4000),
    schemas.PoolGet(["ab" * 32], "p-1", "127.0.0.1", 4001),
    schemas.PoolGetReply(1, 2_000_000, "shm"),
    schemas.PoolPut(["ab" * 32], "p-2", 1024, "xxh3:" + "0" * 32),
    schemas.PoolPutReply(1),
    schemas.KVEvent("kvpool-0", subjects.KVPOOL, 1_700_000_000_000_000_000, 3, ["ab" * 32], ["cd" * 32]),
    schemas.MigrateRequest("r1", "gpu-0", "127.0.0.1", 4000, "interactive", reason="session promoted"),
    schemas.MigrateReply("r1", "cpu-0", "gpu-0", 17, 300, 3_000_000, 0.02, "shm"),
    schemas.SessionUpdate("s1", "interactive"),
    schemas.SessionState("s1", "interactive", "gpu-0", ["r1"], moved=[{"request_id": "r1"}]),
    Heartbeat("gpu-0", subjects.GPU_DECODE, "cuda:0", "smollm2", True, 1, 2, 100, 128, 8192, "127.0.0.1",
              4000, 1700000000.5, waiting_by_tier={"batch": 1}, tpot_ms=12.5,
              requests=[schemas.InFlight("r1", "s1", "interactive")], kv_scope="ab" * 32, chunk_tokens=256),
    HANDLE,
    GenerateRequest("r1", [1, 2, 3], SAMPLING, "batch", subjects.stream("r1"), origin="gateway-1",
                    resume=schemas.Resume([4, 5], 7, 3, 1)),
    PrefillRequest("r1", [1, 2, 3], SAMPLING, "standard", "cpu-0", subjects.worker_decode("cpu-0"),
                   subjects.stream("r1"), resume=schemas.Resume([4], 2, 1, 2), origin="gateway-1"),
    schemas.Resume([4, 5], 7, 3, 1),
    schemas.Where("r1"),
    schemas.WhereReply("cpu-0", False, handed_to="gpu-0", ready=True, attempt=1),
    schemas.Lease("cpu-0", requests={"r1": 0, "r2": 2}),
    schemas.LeaseReply("gw-1", attempts={"r1": 0}),
    Abort("r1", "resumed", below_attempt=2),
    StreamChunk("r1", 3, [9], "x", "cpu-1", attempt=1, reused_tokens=256, recomputed_tokens=12, offset=7),
    schemas.InFlight("r1", "", "batch"),
    RING[0],
    CLAIM,
    DecodeRequest("r1", HANDLE, [1, 2, 3], [4], SAMPLING, "standard", subjects.stream("r1"), ring=RING, claim=CLAIM),
]


def test_ring_members_and_claims_are_typed_and_a_bad_field_is_named():
    """A plan's ring travels as RingPeer objects, the claim as a RingClaim (the shape changed in
    DecodeRequest v3): the old shape ([worker, host, port] lists) is refused naming the field,
    and an old peer's version is refused naming both versions."""
    obj = orjson.loads(encode(EXAMPLES[-1]))
    obj["ring"][1] = ["cpu-1", "127.0.0.1", 7001]
    with pytest.raises(SchemaError, match=r"DecodeRequest\.ring\[1\]: expected RingPeer") as e:
        decode(orjson.dumps(obj))
    assert e.value.field == "ring[1]"
    obj = orjson.loads(encode(EXAMPLES[-1]))
    obj["claim"]["ranges"] = "0-64"
    with pytest.raises(SchemaError, match=r"claim\.ranges"):
        decode(orjson.dumps(obj))
    obj = orjson.loads(encode(EXAMPLES[-1]))
    obj["v"] = 2
    with pytest.raises(SchemaError, match="DecodeRequest version 2 not supported .*v3"):
        decode(orjson.dumps(obj))


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    obj = orjson.loads(data)
    assert obj["schema"] == type(msg).SCHEMA and obj["v"] == type(msg).VERSION
    assert decode(data) == msg
    assert decode(data, type(msg)) == msg


def test_every_message_is_registered_and_exemplified():
    assert set(schemas.REGISTRY) == {type(m).SCHEMA for m in EXAMPLES}


def test_nested_handle_is_built_as_dataclass():
    msg = decode(encode(EXAMPLES[5]))
    assert isinstance(msg.handle, TransferHandle)
    assert msg.handle.nbytes == 1 << 20


def test_sampling_round_trips_through_engine_type():
    msg = decode(encode(EXAMPLES[4]), PrefillRequest)
    assert SamplingParams.from_dict(msg.sampling) == SamplingParams.from_dict(SAMPLING)


def test_error_status_hint():
    assert ErrorReply.of("overloaded", "x").status == 429
    assert ErrorReply.of("unavailable", "x").status == 503
    assert ErrorReply.of("prompt_too_long", "x").status == 400
    assert ErrorReply.of("something-new", "x").status == 500


def _raw(msg, **change):
    obj = orjson.loads(encode(msg))
    obj.update(change)
    return orjson.dumps(obj)


def test_version_mismatch():
    with pytest.raises(SchemaError, match="version") as e:
        decode(_raw(Abort("r1"), v=Abort.VERSION + 1))
    assert e.value.field == "v"


def test_unknown_and_unexpected_schema():
    with pytest.raises(SchemaError, match="unknown schema"):
        decode(_raw(Abort("r1"), schema="Nope"))
    with pytest.raises(SchemaError, match="expected schema 'RoutePlan'"):
        decode(encode(Abort("r1")), RoutePlan)


@pytest.mark.parametrize("field,value", [
    ("num_prompt_tokens", "12"),
    ("num_prompt_tokens", True),   # bool is not an int on the wire
    ("num_prompt_tokens", 1.5),
    ("session_id", 7),
    ("request_id", None),
    ("prompt_token_ids", ["a", 1]),
])
def test_wrong_types_name_the_field(field, value):
    with pytest.raises(SchemaError) as e:
        decode(_raw(EXAMPLES[0], **{field: value}))
    assert field in str(e.value)
    assert e.value.field.startswith(field)


def test_nested_wrong_type_names_the_path():
    obj = orjson.loads(encode(EXAMPLES[5]))
    obj["handle"]["port"] = "5555"
    with pytest.raises(SchemaError, match=r"handle\.port"):
        decode(orjson.dumps(obj))


def test_missing_and_unknown_fields():
    obj = orjson.loads(encode(EXAMPLES[0]))
    del obj["tier"]
    with pytest.raises(SchemaError, match="missing field 'tier'"):
        decode(orjson.dumps(obj))
    assert decode(_raw(EXAMPLES[0], extra=1)) == EXAMPLES[0]   # a newer peer's addition: ignored


def test_bad_tier_value():
    with pytest.raises(SchemaError, match="tier"):
        decode(_raw(EXAMPLES[0], tier="urgent"))
    with pytest.raises(SchemaError, match="tier"):
        encode(RouteRequest("r1", "m", "urgent", None, 1, 1))


def test_encode_checks_types():
    with pytest.raises(SchemaError, match="seq"):
        encode(StreamChunk("r1", "0", [], "", "w"))


def test_float_field_accepts_int():
    hb = decode(_raw(EXAMPLES[10], ts=17))
    assert hb.ts == 17.0 and isinstance(hb.ts, float)


def test_not_json_or_not_object():
    with pytest.raises(SchemaError, match="not JSON"):
        decode(b"\xff{")
    with pytest.raises(SchemaError, match="object"):
        decode(b"[1, 2]")


def test_oversize_message_is_refused():
    too_many = MAX_PAYLOAD // 2  # each token id costs >= 2 bytes ("1,")
    with pytest.raises(MessageTooLarge, match="data plane"):
        encode(GenerateRequest("r1", [1] * too_many, SAMPLING, "batch", subjects.stream("r1")))
    # a long but legal prompt still fits: 32k tokens of 5-digit ids
    assert len(encode(GenerateRequest("r1", [49151] * 32768, SAMPLING, "batch", "s"))) < MAX_PAYLOAD


# -- subjects ---------------------------------------------------------------------------------

def test_subjects():
    assert subjects.ROUTE == "tandem.router.route"
    assert subjects.worker_prefill("p-1") == "tandem.worker.p-1.prefill"
    assert subjects.worker_decode("d-1") == "tandem.worker.d-1.decode"
    assert subjects.worker_generate("d-1") == "tandem.worker.d-1.generate"
    assert subjects.stream("req-9") == "tandem.stream.req-9"
    assert subjects.heartbeat("cpu-decode", "c1") == "tandem.heartbeat.cpu-decode.c1"
    assert subjects.heartbeat_role("gpu-decode") == "tandem.heartbeat.gpu-decode.*"
    assert subjects.transfer("p-1") == "tandem.transfer.p-1"


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "a\tb", None])
def test_subject_tokens_are_validated(bad):
    with pytest.raises(ValueError, match="worker_id"):
        subjects.worker_decode(bad)
    with pytest.raises(ValueError, match="request_id"):
        subjects.stream(bad)


def test_unknown_role():
    with pytest.raises(ValueError, match="role 'decode'"):
        subjects.heartbeat("decode", "w1")


def test_peers_of_two_releases_read_each_other_s_heartbeats(caplog):
    """A rolling upgrade: an older peer's heartbeat lacks the fields added since (their defaults
    hold), a newer one's carries fields this build does not know (ignored, said once)."""
    import logging

    from shared.schemas import Heartbeat
    beat = Heartbeat("w1", "cpu-decode", "cpu", "m", True, 0, 1, 10, 10, 2048, "127.0.0.1", 9000, 0.0,
                     max_running=64, ended=["r1"])
    older = orjson.loads(encode(beat))
    del older["ended"], older["max_running"]
    got = decode(orjson.dumps(older), Heartbeat)
    assert (got.ended, got.max_running, got.running) == ([], 0, 1)
    newer = dict(orjson.loads(encode(beat)), next_release_field={"x": 1})
    with caplog.at_level(logging.INFO, logger="shared.envelope"):
        assert decode(orjson.dumps(newer), Heartbeat) == beat
        assert decode(orjson.dumps(newer), Heartbeat) == beat
    said = [r.getMessage() for r in caplog.records if "next_release_field" in r.getMessage()]
    assert len(said) == 1 and "Heartbeat" in said[0]
