"""A Run's event log and lease in Redis: a Stream keyed by seq (the replay source), a pub/sub
notify, and the lease that fences who may write. Every write that needs a check is one Lua script.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple

import msgspec
import structlog
from redis.asyncio import Redis

from fleet_shared import redis_keys
from fleet_shared.events import RunEvent, decode_event, encode_event

FIELD = b"e"
READ_BATCH = 500
# One append round trip carries at most this many events and (past its first) bytes of payload:
# a Turn's burst of steps goes in one call, and no call holds Redis for long.
APPEND_BATCH_EVENTS = 64
APPEND_BATCH_BYTES = 256 * 1024
log = structlog.get_logger(__name__)


def events_channel(redis: Redis) -> str:
    return redis_keys.events_channel(redis_db(redis))


def control_channel(redis: Redis) -> str:
    return redis_keys.control_channel(redis_db(redis))


def redis_db(redis: Redis) -> int:
    return int(redis.connection_pool.connection_kwargs.get("db", 0))


def stream_id(seq: int) -> str:
    """Stream entry ids are `<seq>-0`: ordered, and a second write of the same seq is refused."""
    return f"{seq}-0"


class Appended(IntEnum):
    FENCED = -1  # the writer does not hold the Run's lease: nothing was written
    DUPLICATE = 0  # this seq is already logged (a retried write): nothing was written again
    APPENDED = 1
    GAP = 2  # the log ends before seq - 1 (Redis lost it): the writer must send from last_seq + 1


class AppendResult(NamedTuple):
    status: Appended
    last_seq: int  # the log's last seq after the call


class LeaseCheck(IntEnum):
    TAKEN = -1  # someone else holds it
    MISSING = 0  # it lapsed, or Redis lost it
    HELD = 1
    CANCEL_REQUESTED = 2  # held, and a client asked to cancel the Run


# KEYS: log, lease. ARGV: log ttl, channel, token, then seq and payload for each event (in seq
# order, consecutive: append_batch checks). Log, then announce, atomically, and only for the lease
# holder and only from the next seq: a late writer or a duplicate can never put an event on the
# wire, and a gap is reported, not written. With consecutive seqs only the first can open a gap.
# Events the log already holds are skipped; one batch is one round trip.
APPEND_SCRIPT = """
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return {-1, 0} end
local last = 0
local tail = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #tail > 0 then last = tonumber(string.match(tail[1][1], '^(%d+)')) end
if tonumber(ARGV[4]) > last + 1 then return {2, last} end
local written = 0
for i = 4, #ARGV, 2 do
  local seq = tonumber(ARGV[i])
  if seq == last + 1 then
    redis.call('XADD', KEYS[1], ARGV[i] .. '-0', 'e', ARGV[i + 1])
    redis.call('PUBLISH', ARGV[2], ARGV[i + 1])
    last = seq
    written = written + 1
  end
end
if written == 0 then return {0, last} end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return {1, last}
"""

# KEYS: lease, cancel flag. ARGV: token, ttl ms.
RENEW_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if not holder then return 0 end
if holder ~= ARGV[1] then return -1 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
return 1
"""

# KEYS: lease, fence. ARGV: token (`<attempt>:<owner>`), ttl ms, fence ttl s.
# The fence remembers the highest attempt that ever held the lease: once a sweeper has taken the
# Run (attempt + 1), no earlier attempt can take the lease again, even after the sweeper let go.
TAKE_SCRIPT = """
local attempt = tonumber(string.match(ARGV[1], '^(%d+):'))
if tonumber(redis.call('GET', KEYS[2]) or '-1') > attempt then return 0 end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  if tonumber(string.match(holder, '^(%d+):') or '-1') >= attempt then return 0 end
end
redis.call('SET', KEYS[2], attempt, 'EX', ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: lease. ARGV: token.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def lease_token(attempt: int, owner: str) -> str:
    """Unique per claim: each claim bumps the Run's attempt. The TAKE script reads the attempt."""
    return f"{attempt}:{owner}"


class RunLog:
    """The fenced writes to Runs' logs and leases, for one Redis client (scripts registered once)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.channel = events_channel(redis)
        self.append_script = redis.register_script(APPEND_SCRIPT)
        self.renew_script = redis.register_script(RENEW_SCRIPT)
        self.release_script = redis.register_script(RELEASE_SCRIPT)
        self.take_script = redis.register_script(TAKE_SCRIPT)

    async def append(self, event: RunEvent, token: str) -> AppendResult:
        """Log and announce the event, if `token` holds the Run's lease and seq is the next one."""
        return (await self.append_batch([event], token, max_bytes=0))[0]

    async def append_batch(
        self, events: Sequence[RunEvent], token: str, *, max_bytes: int = APPEND_BATCH_BYTES
    ) -> tuple[AppendResult, int]:
        """Log and announce a leading run of `events` (one Run's, consecutive seqs) in one round
        trip: as many as fit in `max_bytes` of payload, at least one. Returns the result and how
        many were sent. APPENDED: each sent event is now logged (some may have been already);
        DUPLICATE: all were; GAP: none was written, the log ends before the first."""
        first = events[0]
        if any(event.seq != first.seq + index for index, event in enumerate(events)):
            raise ValueError("a batch of events must have consecutive seqs")  # the script's gap check
        keys = [redis_keys.run_events(first.run_id), redis_keys.run_lease(first.run_id)]
        args: list[str | bytes | int] = [redis_keys.EVENT_LOG_TTL_SECONDS, self.channel, token]
        size = 0
        for event in events[:APPEND_BATCH_EVENTS]:
            payload = encode_event(event)
            size += len(payload)
            if len(args) > 3 and size > max_bytes:
                break
            args += [event.seq, payload]
        status, last = await self.append_script(keys, args)
        return AppendResult(Appended(int(status)), int(last)), (len(args) - 3) // 2

    async def take_lease(self, run_id: str, token: str, ttl_ms: int) -> bool:
        """Take the lease unless a later (or the same) attempt of another owner holds it or ever
        held it. An earlier attempt's holder is stale (the DB claim moved on) and is replaced."""
        keys = [redis_keys.run_lease(run_id), redis_keys.run_fence(run_id)]
        return bool(await self.take_script(keys, [token, ttl_ms, redis_keys.EVENT_LOG_TTL_SECONDS]))

    async def renew_lease(self, run_id: str, token: str, ttl_ms: int) -> LeaseCheck:
        keys = [redis_keys.run_lease(run_id), redis_keys.run_cancel(run_id)]
        return LeaseCheck(int(await self.renew_script(keys, [token, ttl_ms])))

    async def release_lease(self, run_id: str, token: str) -> None:
        await self.release_script([redis_keys.run_lease(run_id)], [token])


async def read_after(redis: Redis, run_id: str, after_seq: int, count: int = READ_BATCH) -> list[RunEvent]:
    """Events with seq > after_seq, oldest first (at most `count` log entries)."""
    return (await read_page(redis, run_id, after_seq, count))[0]


async def read_page(redis: Redis, run_id: str, after_seq: int, count: int) -> tuple[list[RunEvent], int, int]:
    """Up to `count` entries after `after_seq`: the decodable events, the entries read, the last seq."""
    entries = await redis.xrange(
        redis_keys.run_events(run_id), min=stream_id(after_seq + 1), max="+", count=count
    )
    events = []
    last_seq = after_seq
    for entry_id, fields in entries:
        last_seq = int(entry_id.split(b"-", 1)[0])
        try:
            events.append(decode_event(fields[FIELD]))
        except (msgspec.DecodeError, KeyError):
            # A newer worker's event type during a rolling deploy: skip it, keep the stream.
            log.warning("event_log.undecodable", run_id=run_id, entry=str(entry_id))
    return events, len(entries), last_seq


async def read_all_after(redis: Redis, run_id: str, after_seq: int) -> list[RunEvent]:
    events: list[RunEvent] = []
    while True:
        batch, entries, after_seq = await read_page(redis, run_id, after_seq, READ_BATCH)
        events.extend(batch)
        if entries < READ_BATCH:
            return events
