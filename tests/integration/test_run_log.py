"""The fenced Redis writes on a real Redis: who may hold a Run's lease, and who may append."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from fleet_shared import redis_keys
from fleet_shared.event_log import Appended, LeaseCheck, RunLog, lease_token, read_all_after
from fleet_shared.events import Reasoning, decode_event
from fleet_shared.ids import new_id
from fleet_shared.recovery import append_from
from tests.integration.harness import script_calls

TTL = 60_000


def event(run_id: str, seq: int) -> Reasoning:
    return Reasoning(run_id=run_id, seq=seq, part_id=f"r{seq}", text=f"thought {seq}")


async def test_who_may_take_a_lease(redis_client: aioredis.Redis) -> None:
    runlog, run_id = RunLog(redis_client), new_id()
    worker, rival, sweeper = lease_token(1, "w1"), lease_token(1, "w2"), lease_token(2, "sweeper")
    assert await runlog.take_lease(run_id, worker, TTL)
    assert await runlog.take_lease(run_id, worker, TTL)  # already ours: kept
    assert not await runlog.take_lease(run_id, rival, TTL)  # the same attempt, another owner
    assert await runlog.take_lease(run_id, sweeper, TTL)  # a later attempt replaces an earlier one
    await runlog.release_lease(run_id, sweeper)
    assert not await redis_client.exists(redis_keys.run_lease(run_id))
    # The sweeper let go, but attempt 1 is over for good: a zombie cannot take the lease back.
    assert not await runlog.take_lease(run_id, worker, TTL)


async def test_a_slow_claim_cannot_overwrite_a_take_over(redis_client: aioredis.Redis) -> None:
    """The worker's claim committed, but its first lease write came after a sweep took the Run."""
    runlog, run_id = RunLog(redis_client), new_id()
    assert await runlog.take_lease(run_id, lease_token(2, "sweeper"), TTL)
    assert not await runlog.take_lease(run_id, lease_token(1, "slow-worker"), TTL)
    assert await redis_client.get(redis_keys.run_lease(run_id)) == b"2:sweeper"


async def test_only_the_holder_appends_and_only_the_next_seq(redis_client: aioredis.Redis) -> None:
    runlog, run_id = RunLog(redis_client), new_id()
    holder = lease_token(1, "w1")
    assert (await runlog.append(event(run_id, 1), holder)).status is Appended.FENCED  # no lease yet
    assert await runlog.take_lease(run_id, holder, TTL)
    assert (await runlog.append(event(run_id, 1), holder)).status is Appended.APPENDED
    assert (await runlog.append(event(run_id, 1), holder)).status is Appended.DUPLICATE
    gap = await runlog.append(event(run_id, 3), holder)
    assert (gap.status, gap.last_seq) == (Appended.GAP, 1)
    assert (await runlog.append(event(run_id, 2), lease_token(1, "other"))).status is Appended.FENCED
    assert (await runlog.append(event(run_id, 2), holder)).status is Appended.APPENDED
    assert [e.seq for e in await read_all_after(redis_client, run_id, 0)] == [1, 2]


async def test_renewal_reports_the_lease_and_the_cancel_flag(redis_client: aioredis.Redis) -> None:
    runlog, run_id = RunLog(redis_client), new_id()
    holder = lease_token(1, "w1")
    assert await runlog.renew_lease(run_id, holder, TTL) is LeaseCheck.MISSING
    assert await runlog.take_lease(run_id, holder, TTL)
    assert await runlog.renew_lease(run_id, holder, TTL) is LeaseCheck.HELD
    assert await runlog.renew_lease(run_id, lease_token(1, "w2"), TTL) is LeaseCheck.TAKEN
    await redis_client.set(redis_keys.run_cancel(run_id), "1")
    assert await runlog.renew_lease(run_id, holder, TTL) is LeaseCheck.CANCEL_REQUESTED


async def test_a_batch_is_logged_and_announced_event_by_event(redis_client: aioredis.Redis) -> None:
    runlog, run_id = RunLog(redis_client), new_id()
    holder = lease_token(1, "w1")
    assert await runlog.take_lease(run_id, holder, TTL)
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(runlog.channel)
    assert (await pubsub.get_message(timeout=5))["type"] == "subscribe"  # type: ignore[index]
    result, sent = await runlog.append_batch([event(run_id, seq) for seq in (1, 2, 3)], holder)
    assert (result, sent) == ((Appended.APPENDED, 3), 3)
    announced = [await pubsub.get_message(timeout=5) for _ in range(3)]
    assert [decode_event(m["data"]).seq for m in announced if m] == [1, 2, 3]
    await pubsub.aclose()
    # Overlapping the log's end: what it holds is skipped, the rest written once.
    result, sent = await runlog.append_batch([event(run_id, seq) for seq in (2, 3, 4, 5)], holder)
    assert (result, sent) == ((Appended.APPENDED, 5), 4)
    result, _ = await runlog.append_batch([event(run_id, seq) for seq in (4, 5)], holder)
    assert result == (Appended.DUPLICATE, 5)
    # Past the end: a gap, and nothing written; from another writer: fenced.
    assert (await runlog.append_batch([event(run_id, 7), event(run_id, 8)], holder))[0] == (Appended.GAP, 5)
    with pytest.raises(ValueError, match="consecutive"):  # a hole inside: refused before Redis
        await runlog.append_batch([event(run_id, 6), event(run_id, 8)], holder)
    fenced, _ = await runlog.append_batch([event(run_id, 6)], lease_token(1, "w2"))
    assert fenced.status is Appended.FENCED
    assert [e.seq for e in await read_all_after(redis_client, run_id, 0)] == [1, 2, 3, 4, 5]


async def test_a_batch_stops_at_its_byte_budget_but_always_sends_one(redis_client: aioredis.Redis) -> None:
    runlog, run_id = RunLog(redis_client), new_id()
    holder = lease_token(1, "w1")
    assert await runlog.take_lease(run_id, holder, TTL)
    big = [Reasoning(run_id=run_id, seq=seq, part_id=f"r{seq}", text="x" * 40_000) for seq in range(1, 5)]
    result, sent = await runlog.append_batch(big, holder, max_bytes=100_000)
    assert (result, sent) == ((Appended.APPENDED, 2), 2)
    result, sent = await runlog.append_batch(big[2:], holder, max_bytes=1_000)
    assert (result, sent) == ((Appended.APPENDED, 3), 1)
    assert [e.seq for e in await read_all_after(redis_client, run_id, 0)] == [1, 2, 3]


async def test_a_refill_writes_what_the_log_lacks_in_one_round_trip(redis_client: aioredis.Redis) -> None:
    # A sweeper refilling a log that Redis cut short (its events from the DB): one Lua call for
    # the whole run of events, not one per event.
    runlog, run_id, token = RunLog(redis_client), new_id(), lease_token(1, "sweeper")
    assert await runlog.take_lease(run_id, token, TTL)
    await runlog.append_batch([event(run_id, seq) for seq in (1, 2, 3)], token)
    before = await script_calls(redis_client)
    assert await append_from(runlog, [event(run_id, seq) for seq in range(1, 11)], token)
    assert await script_calls(redis_client) - before == 1
    assert [e.seq for e in await read_all_after(redis_client, run_id, 0)] == list(range(1, 11))


async def test_a_refill_stops_at_a_hole_in_its_events(redis_client: aioredis.Redis) -> None:
    runlog, run_id, token = RunLog(redis_client), new_id(), lease_token(1, "sweeper")
    assert await runlog.take_lease(run_id, token, TTL)
    events = [event(run_id, seq) for seq in (1, 2, 3, 5, 6)]  # nobody holds 4 any more
    assert await append_from(runlog, events, token)  # keeps what it could write
    assert [e.seq for e in await read_all_after(redis_client, run_id, 0)] == [1, 2, 3]
    assert not await append_from(runlog, events, lease_token(1, "other"))  # fenced out
