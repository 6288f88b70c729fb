"""The bus's wire envelope: how a typed message (shared/schemas.py) becomes bytes and back.

Wire envelope (one JSON object)::

    {"schema": "<name>", "v": <version>, ...fields}

``encode(msg)`` checks the payload stays under ``MAX_PAYLOAD`` (512 KiB, well below NATS's
1 MiB including headers); KV bytes never travel in a message, only a ``TransferHandle``.
``decode(data, expected)`` checks the schema name, the version and every field's type and
raises ``SchemaError`` (a ValueError) naming the bad field: a peer speaking another version of
a message is refused with the versions named. A field this build does not know is a newer
peer's addition and is ignored (said once), so services of two releases whose messages differ
only by added fields work together through a rolling upgrade. ``REGISTRY`` maps schema name to class so
``tandem tap`` can decode anything. Messages are declared with ``@message(name, version)``.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from dataclasses import dataclass
from typing import Any

import orjson

from shared.tier import TIERS

log = logging.getLogger(__name__)

MAX_PAYLOAD = 512 * 1024  # bytes; NATS's default max_payload is 1 MiB including headers

# error code -> HTTP status the gateway answers with
ERROR_STATUS: dict[str, int] = {
    "bad_request": 400,
    "prompt_too_long": 400,   # OpenAI answers context-length errors with 400
    "forbidden": 403,         # e.g. KV asked to go to an address that is no live worker's
    "not_found": 404,
    "overloaded": 429,
    "internal": 500,
    "unavailable": 503,
    "timeout": 504,
}


class SchemaError(ValueError):
    """A message that does not match its schema; ``field`` names the offending field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class MessageTooLarge(ValueError):
    """An encoded message over MAX_PAYLOAD: send bulk data over the data plane instead."""


REGISTRY: dict[str, type] = {}
_HINTS: dict[type, dict[str, Any]] = {}    # class -> resolved field types
_NAMES: dict[type, tuple[str, ...]] = {}   # class -> field names, in order
_REQUIRED: dict[type, frozenset[str]] = {}  # class -> fields without a default


def message(name: str, version: int):
    """Class decorator: make a dataclass a wire message named ``name`` at ``version``."""

    def wrap(cls):
        cls = dataclass(cls)
        cls.SCHEMA = name
        cls.VERSION = version
        if name in REGISTRY:
            raise ValueError(f"duplicate schema name {name!r}")
        REGISTRY[name] = cls
        _prepare(cls)
        return cls

    return wrap


def _prepare(cls: type) -> None:
    fs = dataclasses.fields(cls)
    _HINTS[cls] = typing.get_type_hints(cls)
    _NAMES[cls] = tuple(f.name for f in fs)
    _REQUIRED[cls] = frozenset(
        f.name for f in fs
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


# ---------------------------------------------------------------------------------------------
# Encode / decode
# ---------------------------------------------------------------------------------------------

def to_dict(msg: Any) -> dict:
    """The envelope dict of a message (nested messages stay dataclasses; orjson handles them)."""
    cls = type(msg)
    if cls not in _NAMES:
        raise TypeError(f"{cls.__name__} is not a registered message")
    d = {"schema": cls.SCHEMA, "v": cls.VERSION}
    for name in _NAMES[cls]:
        d[name] = getattr(msg, name)
    return d


def encode(msg: Any) -> bytes:
    """Type-check ``msg`` and serialize it; raise MessageTooLarge past MAX_PAYLOAD."""
    cls = type(msg)
    if cls not in _NAMES:
        raise TypeError(f"{cls.__name__} is not a registered message")
    hints = _HINTS[cls]
    for name in _NAMES[cls]:
        value, tp = getattr(msg, name), hints[name]
        if type(value) is not tp:       # (``_check``'s first test, without the call and the path)
            _check(value, tp, f"{cls.SCHEMA}.{name}")
    _check_values(msg.__dict__, cls.SCHEMA)
    data = orjson.dumps(to_dict(msg))
    if len(data) >= MAX_PAYLOAD:
        raise MessageTooLarge(
            f"{cls.SCHEMA} message is {len(data)} bytes, limit {MAX_PAYLOAD}: "
            "bulk data belongs on the data plane")
    return data


def decode(data: bytes | bytearray | memoryview | str, expected: type | None = None) -> Any:
    """Parse and validate one message; ``expected`` (a message class) also checks its schema."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise SchemaError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise SchemaError("a message must be a JSON object")
    name = obj.pop("schema", None)
    version = obj.pop("v", None)
    if not isinstance(name, str):
        raise SchemaError("missing or non-string 'schema'", "schema")
    cls = REGISTRY.get(name)
    if cls is None:
        raise SchemaError(f"unknown schema {name!r}", "schema")
    if expected is not None and cls is not expected:
        raise SchemaError(f"expected schema {expected.SCHEMA!r}, got {name!r}", "schema")
    if version != cls.VERSION:
        raise SchemaError(f"{name} version {version!r} not supported (this build speaks "
                          f"v{cls.VERSION})", "v")
    return _build(cls, obj, name)


def from_fields(cls: type, obj: dict) -> Any:
    """Build and validate a message from a fields-only dict (no envelope)."""
    return _build(cls, dict(obj), cls.SCHEMA)


_IGNORED: set[tuple[str, str]] = set()   # (schema, field) of a newer peer's, said once


def _build(cls: type, obj: dict, where: str) -> Any:
    hints = _HINTS[cls]
    unknown = obj.keys() - hints.keys()
    if unknown:
        _ignore(obj, unknown, where)
    missing = _REQUIRED[cls] - obj.keys()
    if missing:
        bad = sorted(missing)[0]
        raise SchemaError(f"{where}: missing field {bad!r}", bad)
    for k, v in obj.items():
        tp = hints[k]
        if type(v) is not tp:           # (``_check``'s first test, without the call and the path)
            obj[k] = _check(v, tp, f"{where}.{k}")
    _check_values(obj, where)
    return cls(**obj)


def _ignore(obj: dict, unknown: set, where: str) -> None:
    """Drop the fields this build does not know: a newer peer's additions (a change an old
    reader cannot take bumps VERSION instead), so a rolling upgrade goes on. Said once each."""
    for name in sorted(unknown):
        del obj[name]
        if (where, name) not in _IGNORED and len(_IGNORED) < 1024:
            _IGNORED.add((where, name))
            log.info("%s: ignoring field %r, which this build does not know (a newer peer's)", where, name[:64])


def _check_values(fields: dict, where: str) -> None:
    """Value checks shared by several messages (types are checked already)."""
    tier = fields.get("tier")
    if tier is not None and tier not in TIERS:
        raise SchemaError(f"{where}.tier: {tier!r} is not one of {', '.join(TIERS)}", "tier")


_SHAPES: dict[Any, tuple[Any, tuple]] = {}   # field type -> (typing.get_origin, typing.get_args): asked once


def _check(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` (nested messages built) if it has type ``tp``, else raise SchemaError."""
    if type(value) is tp:   # a value of exactly its field's class: what the checks below say too
        return value
    shape = _SHAPES.get(tp)
    if shape is None:
        shape = _SHAPES[tp] = (typing.get_origin(tp), typing.get_args(tp))
    origin, args = shape
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        err = None
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _check(value, arm, path)
            except SchemaError as e:
                err = e
        if err is not None and len(args) == 2 and type(None) in args:
            raise err from None   # X | None: the error inside X names the bad field
        raise _type_error(path, value, tp)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list or origin is list:
        if isinstance(value, list):
            if args and args[0] in (str, int) and all(type(v) is args[0] for v in value):
                return value  # fast path (KV event keys, token ids); the general check says the same
            if args and args[0] is not Any:
                return [_check(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
            return value
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
    elif tp in _NAMES:  # a nested message
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return _build(tp, dict(value), path)
    else:  # pragma: no cover - a schema author's mistake
        raise TypeError(f"{path}: unsupported field type {tp!r}")
    raise _type_error(path, value, tp)


def _type_error(path: str, value: Any, tp: Any) -> SchemaError:
    name = getattr(tp, "__name__", None) or str(tp)
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return SchemaError(f"{path}: expected {name}, got {type(value).__name__} {shown}",
                       path.rsplit(".", 1)[-1])
