"""A worker's local folders of deleted sessions' workspaces: after a Turn, the worker keeps its
session's workspace folder for the next Run; once the session is deleted and purged, the
worker's sweep (fleet_worker.app.remove_deleted_workspaces) removes that folder and keeps every
other session's. Real worker (arq, bwrap), real SQLite or PostgreSQL."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from sqlalchemy import select

from fleet_shared.blobs import open_blob_store
from fleet_shared.db import purge
from fleet_shared.db.models import Session
from fleet_worker.app import remove_deleted_workspaces, sandbox_provider
from tests.integration.harness import Harness

ROOT_WRITE = {"lm": "root", "reasoning": "note", "code": "open('/workspace/memory/n.txt', 'w').write('x')"}
ROOT_SUBMIT = {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='ok')"}


async def test_the_sweep_removes_a_deleted_sessions_folder_and_keeps_the_others(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness: Harness = harness_factory(ROOT_WRITE, ROOT_SUBMIT)
    gone_run = await harness.submit("first", key="a")
    kept_run = await harness.submit("second", key="b")
    await harness.work()
    async with harness.db_sessions() as db:
        rows = (await db.execute(select(Session.id, Session.workspace_id))).all()
    sessions = {session_id: workspace_id for session_id, workspace_id in rows}
    provider = sandbox_provider(harness.settings)
    root = provider.workspaces
    assert root is not None
    gone_session, kept_session = await session_of(harness, gone_run), await session_of(harness, kept_run)
    gone, kept = root / sessions[gone_session], root / sessions[kept_session]
    assert gone.is_dir() and kept.is_dir(), sorted(p.name for p in root.iterdir())
    async with harness.db_sessions() as db:
        await purge.mark_deleted(db, gone_session)
    assert await purge.purge_session(
        harness.db_sessions, None, open_blob_store(harness.settings), gone_session
    )
    deps = SimpleNamespace(sandbox_ops=ThreadPoolExecutor(1), db_sessions=harness.db_sessions)
    try:
        assert await remove_deleted_workspaces(deps, provider) >= 1  # type: ignore[arg-type]
        assert not gone.exists()
        assert kept.is_dir(), sorted(p.name for p in root.iterdir())  # (its volume, if any, unmounted)
        assert await remove_deleted_workspaces(deps, provider) == 0  # type: ignore[arg-type]
    finally:
        deps.sandbox_ops.shutdown()
        provider.close()


async def session_of(harness: Harness, run_id: str) -> str:
    from fleet_shared.db.queries import get_run

    async with harness.db_sessions() as db:
        run = await get_run(db, run_id)
    assert run is not None
    return run.session_id
