"""Shutdown always finishes: the sweep loop is asked to stop and finishes the sweep it is in
(cancelling it mid-query once left an aiosqlite connection whose `dispose()` never returned, and
the gateway's lifespan hung), and a teardown step that hangs is abandoned, not waited on."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from structlog.testing import capture_logs

from fleet_gateway.app import create_app
from fleet_gateway.fanout import EventFanout
from fleet_shared import shutdown
from fleet_shared.shutdown import bounded, stop_loop
from tests.integration.harness import Harness

REPO = Path(__file__).resolve().parents[2]
HANG_BOUND_SECONDS = 30  # loose: only catches a hang


async def never_resolves() -> None:
    """Stuck the way the aiosqlite close was: awaiting a future that nobody will ever set."""
    await asyncio.get_running_loop().create_future()


async def ignores_cancellation(release: asyncio.Event) -> None:
    """Worse: a cancel does not end it either (so `asyncio.wait_for` would hang on it too)."""
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            continue


async def test_a_hanging_step_is_abandoned_and_the_next_one_still_runs() -> None:
    ran: list[str] = []

    async def close() -> None:
        ran.append("close")

    release = asyncio.Event()
    started = time.monotonic()
    with capture_logs() as logs:
        finished = await bounded("stuck", lambda: ignores_cancellation(release), seconds=0.2)
        closed = await bounded("close", close)
    release.set()  # let the abandoned step end, so the test's event loop can close
    assert not finished and closed and ran == ["close"]
    assert time.monotonic() - started < HANG_BOUND_SECONDS
    abandoned = {"event": "shutdown.step_abandoned", "step": "stuck", "seconds": 0.2, "log_level": "warning"}
    assert abandoned in logs


async def test_a_failing_step_is_logged_not_raised() -> None:
    async def broken() -> None:
        raise OSError("connection reset")

    with capture_logs() as logs:
        assert not await bounded("broken", broken)
    assert [(e["event"], e["error_type"]) for e in logs] == [("shutdown.step_failed", "OSError")]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_stopping_sweeper_finishes_the_sweep_it_is_in(harness_factory: Any) -> None:
    harness: Harness = harness_factory({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='x')"})
    sweeper = harness.sweeper()
    real_sweep = sweeper.sweep
    in_sweep, sweeps_done = asyncio.Event(), []

    async def slow_sweep() -> int:
        in_sweep.set()
        await asyncio.sleep(0.3)  # long enough for the stop to arrive mid-sweep
        settled = await real_sweep()  # real queries after the stop was asked for
        sweeps_done.append(settled)
        return settled

    sweeper.sweep = slow_sweep  # type: ignore[method-assign]
    task = asyncio.create_task(sweeper.run_forever(0.01))
    await asyncio.wait_for(in_sweep.wait(), HANG_BOUND_SECONDS)
    await stop_loop("sweep", task, sweeper.stopping)
    assert task.done() and not task.cancelled()  # it returned on its own, between sweeps
    assert len(sweeps_done) == 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_gateway_stops_even_when_a_teardown_step_hangs(
    harness_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness: Harness = harness_factory({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='x')"})
    monkeypatch.setattr(shutdown, "STEP_SECONDS", 0.5)
    real_stop = EventFanout.stop

    async def stuck_stop(self: EventFanout) -> None:
        await real_stop(self)
        await never_resolves()

    monkeypatch.setattr(EventFanout, "stop", stuck_stop)
    started = time.monotonic()
    with capture_logs() as logs, TestClient(create_app(harness.settings)) as client:
        assert client.get("/api/sessions").status_code == 200
    assert time.monotonic() - started < HANG_BOUND_SECONDS
    abandoned = [e["step"] for e in logs if e["event"] == "shutdown.step_abandoned"]
    assert abandoned == ["fanout.stop"]  # and the steps after it (Redis, the database) finished
