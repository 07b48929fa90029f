"""A Run's event log in Redis: a Stream keyed by seq (the replay source) plus a pub/sub notify."""

from __future__ import annotations

import hashlib

import msgspec
import structlog
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from fleet_shared import redis_keys
from fleet_shared.events import RunEvent, decode_event, encode_event

FIELD = b"e"
log = structlog.get_logger(__name__)


def events_channel(redis: Redis) -> str:
    return redis_keys.events_channel(int(redis.connection_pool.connection_kwargs.get("db", 0)))


def stream_id(seq: int) -> str:
    """Stream entry ids are `<seq>-0`: ordered, and a second write of the same seq is refused."""
    return f"{seq}-0"


# Log, then announce, atomically; a seq that is already logged is neither logged nor announced
# again, so a late or duplicate writer can never put a second terminal event on the wire.
APPEND_SCRIPT = """
local added = redis.pcall('XADD', KEYS[1], ARGV[1], 'e', ARGV[2])
if type(added) == 'table' and added.err then return 0 end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('PUBLISH', ARGV[4], ARGV[2])
return 1
"""


APPEND_SHA = hashlib.sha1(APPEND_SCRIPT.encode()).hexdigest()


async def append(redis: Redis, event: RunEvent) -> bool:
    """Log and announce the event; False when its seq was already logged (nothing is sent)."""
    keys = [redis_keys.run_events(event.run_id)]
    args: list[str] = [
        stream_id(event.seq),
        encode_event(event).decode(),
        str(redis_keys.EVENT_LOG_TTL_SECONDS),
        events_channel(redis),
    ]
    try:  # the hot path: every event of every Run; send the script body only once per server
        added = await redis.evalsha(APPEND_SHA, len(keys), *keys, *args)  # type: ignore[misc]
    except NoScriptError:
        added = await redis.eval(APPEND_SCRIPT, len(keys), *keys, *args)  # type: ignore[misc]
    return bool(added)


async def read_after(redis: Redis, run_id: str, after_seq: int, count: int = 500) -> list[RunEvent]:
    """Events with seq > after_seq, oldest first (at most `count`)."""
    entries = await redis.xrange(
        redis_keys.run_events(run_id), min=stream_id(after_seq + 1), max="+", count=count
    )
    events = []
    for entry_id, fields in entries:
        try:
            events.append(decode_event(fields[FIELD]))
        except (msgspec.DecodeError, KeyError):
            # A newer worker's event type during a rolling deploy: skip it, keep the stream.
            log.warning("event_log.undecodable", run_id=run_id, entry=str(entry_id))
    return events


async def read_all_after(redis: Redis, run_id: str, after_seq: int) -> list[RunEvent]:
    events: list[RunEvent] = []
    while True:
        batch = await read_after(redis, run_id, after_seq)
        events.extend(batch)
        if len(batch) < 500:
            return events
        after_seq = batch[-1].seq
