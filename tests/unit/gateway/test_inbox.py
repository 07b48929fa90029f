"""A stream's inbox: notices wake a sleeping stream in order; a wait with nothing queued ends at
its deadline, not before (an alarm armed for an earlier deadline rings, and the wait goes on) and
not much after (a later alarm is replaced by one for the earlier deadline)."""

from __future__ import annotations

import asyncio
from typing import Any

from fleet_gateway.fanout import CLOSING, RESYNC, Inbox
from fleet_shared.events import StatusChanged

RUN = "run-1"


async def test_a_sleeping_stream_wakes_on_a_notice_and_takes_everything_queued() -> None:
    loop = asyncio.get_running_loop()
    inbox = Inbox(loop)
    first, second = (StatusChanged(run_id=RUN, seq=n, phase="execution") for n in (1, 2))
    waiting = asyncio.create_task(inbox.wait(loop.time() + 30))
    await asyncio.sleep(0)
    assert not waiting.done()
    inbox.put(first)
    inbox.put(second)
    await asyncio.wait_for(waiting, 5)  # woken by the notice, long before its deadline
    assert inbox.take() == [first, second]
    nothing = inbox.take()
    inbox.put(RESYNC)
    assert nothing == []  # the caller's own list: a later notice does not appear in it
    inbox.put(CLOSING)
    await asyncio.wait_for(inbox.wait(loop.time() + 30), 5)  # already queued: no sleep at all
    assert inbox.take() == [RESYNC, CLOSING]
    inbox.close()


async def test_a_wait_ends_at_its_deadline_even_with_an_earlier_or_later_alarm_armed() -> None:
    loop = asyncio.get_running_loop()
    inbox = Inbox(loop)
    # A short wait leaves its alarm armed; the next, longer wait must not end when it rings.
    await asyncio.wait_for(inbox.wait(loop.time() + 0.01), 5)
    started = loop.time()
    await asyncio.wait_for(inbox.wait(started + 0.2), 5)
    assert loop.time() - started >= 0.2
    # A long wait abandoned (the stream got a notice) leaves a late alarm; a shorter wait after
    # it must not sleep until that one.
    long_wait = asyncio.create_task(inbox.wait(loop.time() + 60))
    await asyncio.sleep(0)
    inbox.put(RESYNC)
    await asyncio.wait_for(long_wait, 5)
    inbox.take()
    started = loop.time()
    await asyncio.wait_for(inbox.wait(started + 0.05), 5)
    assert 0.05 <= loop.time() - started < 30
    inbox.close()


async def test_a_cancelled_wait_leaves_the_inbox_usable() -> None:
    loop = asyncio.get_running_loop()
    inbox = Inbox(loop)
    waiting = asyncio.create_task(inbox.wait(loop.time() + 60))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert waiting.cancelled()
    inbox.put(RESYNC)  # no waiter to wake: kept for the next take
    assert inbox.take() == [RESYNC]
    inbox.close()
    assert inbox.alarm is None


def test_a_quiet_wait_arms_its_alarm_once_under_uvloop() -> None:
    """uvloop rounds timers to whole milliseconds and may ring just before the deadline; a wait
    that re-armed for the sub-millisecond rest spun (call_soon after call_soon) until the clock
    ticked over: up to hundreds of arms per quiet wait."""
    import uvloop

    arms: list[int] = []

    async def waits() -> None:
        loop = asyncio.get_running_loop()
        real_call_at = loop.call_at

        def counting_call_at(when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
            arms[-1] += 1
            return real_call_at(when, callback, *args)

        loop.call_at = counting_call_at  # type: ignore[method-assign]
        inbox = Inbox(loop)
        for index in range(24):
            last_sent = loop.time()  # as follow_live: the deadline is a heartbeat after a send
            await asyncio.sleep(0.0007 * index)
            arms.append(0)
            until = last_sent + 0.03
            await inbox.wait(until)
            assert loop.time() >= until
        inbox.close()

    uvloop.run(waits())
    assert max(arms) == 1, f"alarms armed per wait: {arms}"
