"""The one reconnecting pub/sub subscription (the gateway's fan-out and the worker's control
listener both use it), against a real Redis that drops it: it subscribes again, catches up, and
hears what is published after."""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis

from fleet_shared.backoff import Backoff
from fleet_shared.subscription import ResilientSubscription


def test_the_backoff_doubles_up_to_its_cap_and_starts_over() -> None:
    backoff = Backoff(0.2, 1.0)
    assert [backoff.next() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert backoff.failures == 5
    backoff.reset()
    assert backoff.pending == 0.2 and backoff.failures == 0


async def test_a_dropped_subscription_comes_back_and_catches_up(redis_url: str) -> None:
    listener = aioredis.Redis.from_url(redis_url)
    publisher = aioredis.Redis.from_url(redis_url)
    heard: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
    catch_ups: asyncio.Queue[None] = asyncio.Queue()

    async def catch_up() -> None:
        catch_ups.put_nowait(None)

    def on_message(channel: bytes, data: bytes) -> None:
        heard.put_nowait((channel, data))

    channels = ["test:one", b"test:two"]
    subscription = ResilientSubscription(listener, channels, on_message, name="t", on_connected=catch_up)
    task = asyncio.create_task(subscription.run_forever())
    try:
        await asyncio.wait_for(catch_ups.get(), 5)
        assert subscription.connected.is_set()
        await publisher.publish("test:one", b"a")
        await publisher.publish("test:two", b"b")
        assert [await asyncio.wait_for(heard.get(), 5) for _ in range(2)] == [
            (b"test:one", b"a"),
            (b"test:two", b"b"),
        ]

        assert await publisher.client_kill_filter(_type="pubsub") == 1
        await asyncio.wait_for(catch_ups.get(), 5)  # subscribed again, and told its owner to catch up
        assert subscription.connected.is_set()
        await publisher.publish("test:two", b"c")
        assert await asyncio.wait_for(heard.get(), 5) == (b"test:two", b"c")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await listener.aclose()
        await publisher.aclose()
