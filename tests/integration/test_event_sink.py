"""The worker's event sink on a real Redis: what it publishes, and in how many round trips."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from fleet_shared.event_log import APPEND_SCRIPT, RunLog, lease_token, read_all_after
from fleet_shared.events import Reasoning, RunCompleted
from fleet_shared.ids import new_id
from fleet_worker.lease import RunLease
from fleet_worker.publisher import EventSink
from tests.integration.harness import script_calls


async def still_ours() -> bool:
    return True


async def test_events_emitted_together_are_published_in_one_round_trip(redis_client: aioredis.Redis) -> None:
    # Each append is a Lua call on Redis and a round trip for the worker's event loop: a step's
    # events (or those that piled up during the last append) must share one.
    runlog, run_id = RunLog(redis_client), new_id()
    async with RunLease(runlog, run_id, lease_token(1, "w1"), 30, still_ours) as lease:
        sink = EventSink(runlog, run_id, lease)
        await redis_client.script_load(APPEND_SCRIPT)  # else a first call counts twice (NOSCRIPT)
        before = await script_calls(redis_client)
        for index in range(20):
            sink.emit(Reasoning(run_id=run_id, part_id=f"r{index}", text=f"thought {index}"))
        # Until the steps are in the log (Redis's state: nothing in the sink signals it).
        while len(await read_all_after(redis_client, run_id, 0)) < 20:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        sink.stamp_terminal(RunCompleted(run_id=run_id, duration_ms=1))
        assert await sink.finish(within=10)
        calls = await script_calls(redis_client) - before
        await sink.close()
    logged = await read_all_after(redis_client, run_id, 0)
    assert [e.seq for e in logged] == list(range(1, 22))
    assert isinstance(logged[-1], RunCompleted)
    assert calls == 2  # the 20 steps, then the terminal
