"""A worker stopped while a Turn's claim is under way: on SQLite the claim runs whole in a thread
that a cancel cannot stop (fleet_shared.db.engine.run_whole), so the claim lands anyway. The Turn
it started must still end properly (`worker_shutdown`), not stay `running` with no lease until a
sweeper calls it lost. A real arq worker, real Redis, a real SQLite file whose write lock the test
holds so the claim is caught halfway."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from fleet_shared.db import queries
from fleet_shared.db.engine import sqlite_twin
from fleet_worker.app import build_worker
from tests.conftest import migrate
from tests.integration.harness import Harness

SUBMIT = {"lm": "root", "reasoning": "Done.", "code": "SUBMIT(answer='x')"}
WITHIN_SECONDS = 30.0  # a hang guard only


@pytest.fixture
async def database_path(tmp_path: Path) -> Path:
    return tmp_path / "fleet.db"


@pytest.fixture
async def database_url(database_path: Path) -> str:
    url = f"sqlite+aiosqlite:///{database_path}"
    await asyncio.to_thread(migrate, url)
    return url


async def until(check: Any, what: str) -> None:
    deadline = time.monotonic() + WITHIN_SECONDS
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_turn_whose_claim_was_under_way_when_the_worker_stopped_still_ends(
    harness_factory: Any, database_path: Path
) -> None:
    harness: Harness = harness_factory(SUBMIT)
    worker = build_worker(harness.settings)
    main = asyncio.create_task(worker.run())
    blocker = sqlite3.connect(database_path, isolation_level=None, check_same_thread=False)
    try:
        await until(lambda: asyncio.sleep(0, "deps" in worker.ctx), "the worker to start")
        twin = sqlite_twin(worker.ctx["engine"])
        assert twin is not None
        claiming = threading.Event()

        def watch(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
            if statement.lstrip().upper().startswith("UPDATE RUNS"):
                claiming.set()

        event.listen(twin.engine, "before_cursor_execute", watch)
        run_id = await harness.submit(enqueue=False)
        blocker.execute("BEGIN IMMEDIATE")  # the claim's UPDATE waits on SQLite's busy timeout
        assert await harness.jobs().enqueue(run_id)
        arq_tasks = worker.worker.tasks  # arq's running jobs, by job id
        await until(lambda: asyncio.sleep(0, claiming.is_set() and run_id in arq_tasks), "the claim")
        arq_tasks[run_id].cancel()  # what arq does to a running job when its drain time is up
        for _ in range(20):  # loop turns, not time: the cancel reaches the job through arq's wait_for
            await asyncio.sleep(0)
        blocker.execute("ROLLBACK")  # the claim now lands

        async def ended() -> bool:
            async with harness.db_sessions() as db:
                run = await queries.get_run(db, run_id)
            return run is not None and run.status not in ("queued", "running", "settling")

        await until(ended, "the Turn to end")
        async with harness.db_sessions() as db:
            run = await queries.get_run(db, run_id)
        assert run is not None and (run.status, run.failure_code) == ("failed", "worker_shutdown")
    finally:
        blocker.close()
        main.cancel()
        await asyncio.gather(main, return_exceptions=True)
        await worker.close()
