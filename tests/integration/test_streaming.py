"""The Turn stream against real Redis: log-first delivery, gap filling, heartbeats, one pub/sub.

The gateway's streaming code runs in-process here; the events come from Redis exactly as a worker
writes them (Stream log + pub/sub), and the DB is real SQLite/PostgreSQL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis

from fleet_gateway.fanout import EventFanout
from fleet_gateway.streaming import RunView, StreamDeps, stream_run
from fleet_shared import event_log, redis_keys
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.event_log import Appended, RunLog
from fleet_shared.events import (
    Answer,
    IterationFinished,
    IterationStarted,
    Reasoning,
    RunCompleted,
    RunEvent,
    StatusChanged,
)
from fleet_shared.ids import new_id


@pytest.fixture
async def fanout(redis_url: str) -> AsyncIterator[EventFanout]:
    client = aioredis.Redis.from_url(redis_url)
    fan = EventFanout(client)
    await fan.start()
    await asyncio.wait_for(fan.connected.wait(), 5)
    yield fan
    await fan.stop()
    await client.aclose()


@pytest.fixture
async def deps(fanout: EventFanout, sqlite_url: str) -> AsyncIterator[StreamDeps]:
    engine = create_engine(sqlite_url)
    yield StreamDeps(fanout.redis, fanout, session_factory(engine), heartbeat_seconds=0.3)
    await engine.dispose()


async def log_event(redis: aioredis.Redis, event: RunEvent) -> None:
    """Log an event as the Run's worker does: under the Run's lease."""
    runlog = RunLog(redis)
    assert await runlog.take_lease(event.run_id, "1:test-worker", 60_000)
    assert (await runlog.append(event, "1:test-worker")).status is Appended.APPENDED


def run_view(run_id: str) -> RunView:
    return RunView(run_id, new_id(), "scripted/test", datetime.now(UTC), "running")


def body(run_id: str) -> list[RunEvent]:
    return [
        StatusChanged(run_id=run_id, seq=1, phase="execution"),
        IterationStarted(run_id=run_id, seq=2, iteration=1),
        Reasoning(run_id=run_id, seq=3, part_id="r1", text="hm"),
        IterationFinished(run_id=run_id, seq=4, iteration=1),
        Answer(run_id=run_id, seq=5, part_id="t1", text="yes"),
        RunCompleted(run_id=run_id, seq=6, duration_ms=3),
    ]


def split_frames(writes: list[bytes]) -> list[str]:
    """The SSE frames in what the stream wrote (one write may carry several frames)."""
    return [f for w in writes for f in w.decode().split("\n\n") if f]


def chunks(writes: list[bytes]) -> list[dict[str, object]]:
    out = []
    for frame in split_frames(writes):
        data = frame.split("data: ", 1)[1].strip()
        if data != "[DONE]":
            out.append(json.loads(data))
    return out


async def collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    async with asyncio.timeout(10):
        return [frame async for frame in stream]


async def test_events_published_before_the_stream_opened_are_not_lost(
    deps: StreamDeps, redis_client: aioredis.Redis
) -> None:
    run_id = new_id()
    events = body(run_id)
    for event in events[:3]:  # the worker raced ahead of the client's subscription
        await log_event(redis_client, event)
    stream = stream_run(deps, run_view(run_id), delivery="live")
    first = [
        await anext(stream) for _ in range(4)
    ]  # start, then one write per event: status, step, reasoning
    for event in events[3:]:
        await log_event(redis_client, event)
    frames = first + await collect(stream)
    types = [c["type"] for c in chunks(frames)]
    assert types == [
        "start",
        "data-status",
        "start-step",
        "reasoning-start",
        "reasoning-delta",
        "reasoning-end",
        "finish-step",
        "text-start",
        "text-delta",
        "text-end",
        "finish",
    ]
    assert frames[-1] == b"data: [DONE]\n\n"
    ids = [frame.split("\n", 1)[0] for frame in split_frames(frames)[:-1]]
    assert ids[0] == "id: 0.0.1"  # start: a control frame before any content
    assert ids[1] == "id: 1.0" and ids[-1] == "id: 6.0"
    assert len(set(ids)) == len(ids)  # every frame has its own id
    # reasoning start, delta, end: one event, one write, three ids
    assert b"id: 3.0\n" in frames[3] and b"id: 3.1\n" in frames[3] and b"id: 3.2\n" in frames[3]


async def test_a_missed_notification_is_filled_from_the_log(
    deps: StreamDeps, redis_client: aioredis.Redis
) -> None:
    run_id = new_id()
    events = body(run_id)
    stream = stream_run(deps, run_view(run_id), delivery="live")
    await anext(stream)  # start: now subscribed
    # Events 1-4 reach the log without a notification (as if pub/sub dropped them) ...
    for event in events[:4]:
        await redis_client.xadd(
            redis_keys.run_events(run_id), {"e": event_log.encode_event(event)}, id=f"{event.seq}-0"
        )
    # ... then 5 and 6 arrive normally: the stream notices the gap and reads the log.
    for event in events[4:]:
        await log_event(redis_client, event)
    types = [c["type"] for c in chunks(await collect(stream))]
    assert types[0] == "data-status" and types[-1] == "finish"
    assert types.count("text-delta") == 1 and "reasoning-delta" in types


async def test_heartbeats_fill_silence(deps: StreamDeps, redis_client: aioredis.Redis) -> None:
    run_id = new_id()
    events = body(run_id)
    stream = stream_run(deps, run_view(run_id), delivery="live")
    await anext(stream)
    beats = [await anext(stream) for _ in range(2)]  # nothing published: only heartbeats come
    for event in events:
        await log_event(redis_client, event)
    rest = await collect(stream)
    for beat in chunks(beats):
        assert beat == {
            "type": "data-status",
            "data": {"phase": "queued", "status": "heartbeat"},
            "transient": True,
        }
    assert chunks(rest)[-1]["type"] == "finish"


async def test_a_busy_stream_heartbeats_a_period_after_its_last_frame(
    deps: StreamDeps, redis_client: aioredis.Redis
) -> None:
    """The stream's alarm is kept across wake-ups: armed for a heartbeat after the stream opened,
    it rings early once frames went out since; the stream must then sleep on, and beat a
    heartbeat period after its last frame."""
    run_id = new_id()
    events = body(run_id)
    loop = asyncio.get_running_loop()
    received: list[tuple[float, bytes]] = []
    arrived = asyncio.Condition()

    async def read() -> None:
        async for data in stream_run(deps, run_view(run_id), delivery="live"):
            async with arrived:
                received.append((loop.time(), data))
                arrived.notify_all()

    async def writes(count: int) -> None:
        async with arrived:
            await arrived.wait_for(lambda: len(received) >= count)

    reader = asyncio.create_task(read())
    async with asyncio.timeout(10):
        await writes(1)
        await asyncio.sleep(deps.heartbeat_seconds * 0.6)  # the stream sleeps, its alarm armed
        await log_event(redis_client, events[0])
        await writes(3)  # start, the event's frames, then a heartbeat
    (sent, frames), (beat_at, beat) = received[1], received[2]
    assert chunks([frames])[0]["type"] == "data-status" and "heartbeat" not in frames.decode()
    assert chunks([beat]) == [
        {"type": "data-status", "data": {"phase": "execution", "status": "heartbeat"}, "transient": True}
    ]
    assert beat_at - sent >= deps.heartbeat_seconds * 0.9  # not when the first alarm rang
    for event in events[1:]:
        await log_event(redis_client, event)
    await asyncio.wait_for(reader, 10)
    assert chunks([data for _, data in received])[-1]["type"] == "finish"


async def test_many_streams_share_one_pubsub_connection(
    deps: StreamDeps, redis_client: aioredis.Redis
) -> None:
    runs = [new_id() for _ in range(8)]
    streams = [stream_run(deps, run_view(run_id), delivery="live") for run_id in runs]
    for stream in streams:
        await anext(stream)  # start
    await asyncio.gather(*(anext(stream) for stream in streams))  # a heartbeat: all are listening
    channel = event_log.events_channel(redis_client)
    (_name, subscribers), *_ = await redis_client.pubsub_numsub(channel)
    assert subscribers == 1
    assert deps.fanout.active_streams == 8
    for run_id in runs:
        for event in body(run_id):
            await log_event(redis_client, event)
    results = await asyncio.gather(*(collect(stream) for stream in streams))
    for frames in results:
        assert chunks(frames)[-1]["type"] == "finish"
    assert deps.fanout.active_streams == 0


async def test_a_client_that_goes_away_releases_its_subscription(deps: StreamDeps) -> None:
    """The server cancels the body task on disconnect; the fan-out must forget that stream."""
    stream = stream_run(deps, run_view(new_id()), delivery="live")

    async def consume() -> None:
        async for _frame in stream:
            pass

    task = asyncio.create_task(consume())
    for _ in range(50):
        await asyncio.sleep(0.02)
        if deps.fanout.active_streams == 1:
            break
    assert deps.fanout.active_streams == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert deps.fanout.active_streams == 0


async def test_an_event_this_gateway_cannot_decode_is_skipped(
    deps: StreamDeps, redis_client: aioredis.Redis
) -> None:
    """A newer worker may log an event type an older gateway does not know (a rolling deploy)."""
    run_id = new_id()
    events = body(run_id)
    for event in events[:2]:
        await log_event(redis_client, event)
    future = b'{"type":"from.the.future","run_id":"%s","seq":3}' % run_id.encode()
    await redis_client.xadd(redis_keys.run_events(run_id), {"e": future}, id="3-0")
    for event in events[3:]:
        await log_event(redis_client, event)
    frames = await collect(stream_run(deps, run_view(run_id), delivery="live"))
    types = [c["type"] for c in chunks(frames)]
    assert types[-1] == "finish" and "text-delta" in types
    assert frames[-1] == b"data: [DONE]\n\n"


async def test_a_run_this_request_created_streams_without_asking_the_db(
    deps: StreamDeps, redis_client: aioredis.Redis
) -> None:
    # A stream checks the DB first in case its Run ended with no log (Redis lost it); a Run the
    # POST itself just created cannot have, so its stream skips that lookup on every Turn.
    opened: list[str] = []
    factory = deps.db_sessions

    def counting_sessions() -> Any:
        opened.append("session")
        return factory()

    counting = dataclasses.replace(deps, db_sessions=counting_sessions)  # type: ignore[arg-type]
    for fresh, expected in ((True, []), (False, ["session"])):
        run_id = new_id()
        events = body(run_id)
        await log_event(redis_client, events[0])
        opened.clear()
        stream = stream_run(counting, run_view(run_id), delivery="live", fresh=fresh)
        first = [await anext(stream) for _ in range(2)]  # start, then the logged status
        for event in events[1:]:
            await log_event(redis_client, event)
        frames = first + await collect(stream)
        assert frames[-1] == b"data: [DONE]\n\n"
        assert opened == expected
