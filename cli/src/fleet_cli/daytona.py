"""`fleet daytona snapshot|sweep` and `fleet doctor daytona`: operator actions on Daytona."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TYPE_CHECKING

from fleet_shared.config import Settings, load_settings
from fleet_shared.db.engine import create_engine, session_factory

if TYPE_CHECKING:
    from fleet_worker.sandbox.daytona import DaytonaSandboxProvider


def run_daytona(action: str) -> int:
    settings = load_settings()
    from fleet_worker.sandbox.daytona import daytona_provider, ops
    from fleet_worker.sandbox.errors import SandboxUnavailable

    try:
        provider = daytona_provider(settings)
    except SandboxUnavailable as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 2
    if action == "snapshot":
        name = ops.build_snapshot(provider, on_logs=lambda line: print(line, flush=True))
        print(f"snapshot {name} is ready")
        return 0
    if action == "sweep":
        return asyncio.run(sweep(provider, settings))
    started = time.monotonic()
    try:
        printed = ops.doctor(provider)
    except Exception as exc:  # the check's whole point: say what failed, in one line
        print(f"daytona: FAILED ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    print(f"daytona: ok, a disposable sandbox ran a cell ({printed!r}) in {time.monotonic() - started:.1f}s")
    return 0


async def sweep(provider: DaytonaSandboxProvider, settings: Settings) -> int:
    from fleet_worker.sandbox.daytona import ops

    engine = create_engine(settings.database_url)
    try:
        deleted = await ops.sweep(provider, session_factory(engine))
    finally:
        await engine.dispose()
    print(f"deleted {deleted} idle sandbox(es)")
    return 0
