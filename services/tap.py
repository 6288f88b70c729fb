"""``tandem tap [SUBJECT]``: print live bus traffic, one line per message.

    12:00:01.123  tandem.stream.r-42  164B  StreamChunk/v1  trace=4bf92f35  request_id=r-42 seq=3 token_ids=[318] ...

``trace=`` is the first 8 hex digits of the trace id the message's ``traceparent`` header carries
(shared/tracing.py), so one request's messages can be followed across services.

Prompts (token ids) and text are elided unless ``--show-text``; long lists are shortened.
Connects with the usual settings (TANDEM_NATS_URL, credentials, TLS) or ``--url``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import signal
import sys
from typing import Any, TextIO

from shared import schemas, subjects, tracing
from shared.bus import Bus, BusError
from shared.settings import Settings, env_help

log = logging.getLogger(__name__)

_SECRET_LISTS = ("prompt_token_ids",)          # elided unless --show-text
_SECRET_TEXT = ("text", "message_text")        # elided unless --show-text
_MAX_LIST = 8                                  # list items shown before "..."
_MAX_STR = 80                                  # characters shown of other strings


def add_arguments(parser) -> None:
    parser.add_argument("subject", nargs="?", default=subjects.ALL,
                        help=f"subject or wildcard to watch (default {subjects.ALL}; a tap on request subjects "
                             "delays finding a dead worker: NATS no longer says 'no responders' for it)")
    parser.add_argument("--show-text", action="store_true",
                        help="print prompt token ids and text instead of eliding them")
    parser.add_argument("--url", default=None, help="NATS URL (default: TANDEM_NATS_URL)")
    parser.add_argument("--replies", action="store_true",
                        help="also show request replies (_INBOX.>)")
    parser.add_argument("--count", type=int, default=0,
                        help="exit after this many messages (default: run until Ctrl-C)")
    parser.epilog = env_help()
    parser.formatter_class = __import__("argparse").RawDescriptionHelpFormatter


def main(args) -> int:
    try:
        return asyncio.run(tap(args.subject, url=args.url, show_text=args.show_text,
                               replies=args.replies, count=args.count))
    except KeyboardInterrupt:
        return 0
    except (ValueError, BusError) as e:  # no URL, bad settings, server unreachable
        log.error("%s", e)
        return 1


async def tap(subject: str = subjects.ALL, *, url: str | None = None, show_text: bool = False,
              replies: bool = False, count: int = 0, out: TextIO | None = None,
              settings: Settings | None = None, ready: asyncio.Event | None = None) -> int:
    """Print matching messages to ``out`` (stdout) until ``count`` were shown or interrupted."""
    out = out or sys.stdout
    tokens = subject.split(".")
    if any(not t or any(c.isspace() for c in t) for t in tokens) or ">" in tokens[:-1]:
        raise ValueError(f"{subject!r} is not a NATS subject: dot-separated tokens without spaces, "
                         "'*' for one token, '>' last for the rest (e.g. tandem.router.>)")
    settings = settings or Settings.from_env()
    bus = await Bus.connect(settings, url=url, name="tandem-tap", role="tap")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (tests) or no signals on this platform
    queue: asyncio.Queue = asyncio.Queue(maxsize=10_000)

    async def on_msg(msg) -> None:
        try:
            queue.put_nowait(msg)
        except asyncio.QueueFull:
            log.warning("tap is falling behind; dropping a message on %s", msg.subject)

    subs = [await bus.nc.subscribe(subject, cb=on_msg)]
    if replies:
        subs.append(await bus.nc.subscribe("_INBOX.>", cb=on_msg))
    await bus.flush()
    log.info("tapping %s%s", subject, " and replies" if replies else "")
    if ready is not None:
        ready.set()
    shown = 0
    try:
        while not stop.is_set():
            getter = asyncio.ensure_future(queue.get())
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for f in (getter, stopper):
                if f not in done:
                    f.cancel()
            if getter not in done:
                break
            msg = getter.result()
            out.write(format_line(msg.subject, msg.data, show_text=show_text, headers=msg.headers) + "\n")
            out.flush()
            shown += 1
            if count and shown >= count:
                break
    finally:
        for s in subs:
            await s.unsubscribe()
        # nothing was published here, so nothing waits on the flush: a frozen server (no PONG)
        # would otherwise hold the exit for the bus's whole close timeout
        await bus.close(timeout=0.2)
    return 0


def format_line(subject: str, data: bytes, *, show_text: bool = False,
                when: datetime.datetime | None = None, headers: dict | None = None) -> str:
    """One tap line: time, subject, size, schema/version, trace id prefix, short payload."""
    when = when or datetime.datetime.now()
    stamp = when.strftime("%H:%M:%S.%f")[:-3]
    if not data:   # no payload: a NATS status (a JetStream heartbeat, "no responders") or an empty reply
        status = " ".join(f"{k}={v}" for k, v in (headers or {}).items() if k.lower() in ("status", "description"))
        return f"{stamp}  {subject}  0B  -  no payload{f' ({status})' if status else ''}"
    try:
        msg = schemas.decode(data)
    except schemas.SchemaError as e:
        body = repr(bytes(data[:60])) if show_text else f"<{len(data)} bytes>"
        return f"{stamp}  {subject}  {len(data)}B  ?  undecodable ({e}): {body}"
    fields = schemas.to_dict(msg)
    name, version = fields.pop("schema"), fields.pop("v")
    parts = " ".join(f"{k}={_short(k, v, show_text)}" for k, v in fields.items()
                     if v is not None and v != "" and v != [] and v != {})
    trace = tracing.parse_traceparent((headers or {}).get(tracing.TRACEPARENT))
    return f"{stamp}  {subject}  {len(data)}B  {name}/v{version}  " + (f"trace={trace[0][:8]}  " if trace else "") + parts


def _short(key: str, value: Any, show_text: bool) -> str:
    if hasattr(value, "SCHEMA"):  # nested message (a TransferHandle)
        inner = schemas.to_dict(value)
        inner.pop("schema"), inner.pop("v")
        return "{" + " ".join(f"{k}={_short(k, v, show_text)}" for k, v in inner.items()
                              if v not in (None, "", [], {})) + "}"
    if not show_text and key in _SECRET_LISTS and isinstance(value, list):
        return f"<{len(value)} ids>"
    if not show_text and key in _SECRET_TEXT and isinstance(value, str):
        return f"<{len(value)} chars>"
    if isinstance(value, list):
        shown = ",".join(str(v) for v in value[:_MAX_LIST])
        more = f",...+{len(value) - _MAX_LIST}" if len(value) > _MAX_LIST else ""
        return f"[{shown}{more}]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_short(k, v, show_text)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        s = value if len(value) <= _MAX_STR else value[:_MAX_STR - 3] + "..."
        return s if s and " " not in s else repr(s)
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
