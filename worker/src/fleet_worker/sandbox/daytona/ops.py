"""Operator actions on Daytona: build the REPL's snapshot, the live check, and the sweep."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Literal

import structlog
from daytona import CreateSandboxFromSnapshotParams, CreateSnapshotParams, Image
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared.db import queries
from fleet_shared.run_state import is_terminal
from fleet_worker.sandbox.daytona.provider import (
    LABEL_DEPLOYMENT,
    LABEL_RUN,
    DaytonaSandboxProvider,
)
from fleet_worker.sandbox.jail import SITE_MOUNT

log = structlog.get_logger(__name__)
REPL_PYTHON: Literal["3.11"] = "3.11"  # the snapshot pins the interpreter the REPL runs on
DOCTOR_CELL = "import sys\nprint(6 * 7, sys.version_info[:2])"


def build_snapshot(provider: DaytonaSandboxProvider, on_logs: Callable[[str], None]) -> str:
    """Create the snapshot named by `sandbox.daytona.snapshot`: the REPL's Python, and the
    profile's sandbox.python.packages (wheels only) in their own folder, SITE_MOUNT, which the
    REPL adds to its path as a local jail does; its name."""
    image = Image.debian_slim(REPL_PYTHON)
    packages = provider.python.packages
    if packages:
        image = image.pip_install(list(packages), extra_options=f"--only-binary=:all: --target {SITE_MOUNT}")
    params = CreateSnapshotParams(name=provider.cfg.snapshot, image=image)
    snapshot = provider.client().snapshot.create(params, on_logs=on_logs)
    return str(snapshot.name)


def doctor(provider: DaytonaSandboxProvider) -> str:
    """Create one labelled, disposable sandbox, run a cell in it over the frame protocol, and
    delete it whatever happens; what the cell printed."""
    client = provider.client()
    labels = {LABEL_DEPLOYMENT: provider.cfg.deployment, "fleet.doctor": "true", LABEL_RUN: "doctor"}
    params = CreateSandboxFromSnapshotParams(
        snapshot=provider.cfg.snapshot,
        labels=labels,
        network_block_all=True,
        auto_stop_interval=5,
        ephemeral=True,
    )
    sandbox = client.create(params, timeout=provider.cfg.create_timeout_seconds)
    lease = None
    try:
        lease = provider.lease_on(sandbox, "doctor")
        result = lease.interpreter_factory().execute(DOCTOR_CELL, {}, {}, None)
        if result.error is not None:
            raise RuntimeError(f"the cell failed: {result.error.type}: {result.error.message}")
        return result.stdout.strip()
    finally:
        if lease is not None:
            lease.release()
        sandbox.delete()


def idle_check(
    db_sessions: async_sessionmaker[AsyncSession], loop: asyncio.AbstractEventLoop, idle: timedelta
) -> Callable[[str | None], bool]:
    """For `DaytonaSandboxProvider.sweep`, from a thread: is this Run over for `idle` or more
    (or unknown)?"""

    async def over(run_id: str | None) -> bool:
        if not run_id:
            return True
        async with db_sessions() as db:
            run = await queries.get_run(db, run_id)
        if run is None:
            return True
        if not is_terminal(run.status) or run.finished_at is None:
            return False
        finished = run.finished_at if run.finished_at.tzinfo else run.finished_at.replace(tzinfo=UTC)
        return datetime.now(UTC) - finished >= idle

    def check(run_id: str | None) -> bool:
        return asyncio.run_coroutine_threadsafe(over(run_id), loop).result(timeout=30)

    return check


async def sweep(provider: DaytonaSandboxProvider, db_sessions: async_sessionmaker[AsyncSession]) -> int:
    idle = timedelta(minutes=provider.cfg.idle_minutes)
    check = idle_check(db_sessions, asyncio.get_running_loop(), idle)
    return await asyncio.to_thread(provider.sweep, check)


async def sweep_forever(
    provider: DaytonaSandboxProvider, db_sessions: async_sessionmaker[AsyncSession], every_seconds: float
) -> None:
    while True:
        try:
            await sweep(provider, db_sessions)
        except Exception as exc:  # Daytona or the DB away: next time
            log.warning("daytona.sweep_failed", error_type=type(exc).__name__)
        await asyncio.sleep(every_seconds)
