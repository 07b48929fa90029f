"""A worker's database work on a Turn's path (the Run's start, the history it reads, its
settlement) each run whole: on a file SQLite engine in one hop to the twin's thread, on PostgreSQL
through `run_sync`; on both databases the fencing is unchanged."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import msgspec
import pytest
from sqlalchemy import event, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db import claims, queries, runs, workspace_versions
from fleet_shared.db.engine import create_engine, dispose_engine, run_whole, session_factory, sqlite_twin
from fleet_shared.db.models import Run
from fleet_shared.db.workspace_versions import WorkspaceChange
from fleet_shared.events import RunCompleted
from fleet_shared.manifests import FileEntry, Manifest, ManifestCache
from fleet_shared.run_state import RunCommand, RunStatus
from fleet_shared.tenancy import OPERATOR
from fleet_worker.conversation import load_conversation
from fleet_worker.settlement import commit_with_retry
from fleet_worker.turn import Claim, claim_run


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    created = create_engine(database_url)
    yield created
    await dispose_engine(created)


class Statements:
    """Each statement's first word and the thread it ran in, as the driver was handed it."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.seen: list[tuple[str, str]] = []
        twin = sqlite_twin(engine)
        for sync_engine in (engine.sync_engine, *((twin.engine,) if twin else ())):
            event.listen(sync_engine, "before_cursor_execute", self.keep)

    def keep(self, _conn: object, _cursor: object, statement: str, *_args: object) -> None:
        self.seen.append((statement.split(maxsplit=1)[0].upper(), threading.current_thread().name))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.seen]

    def threads(self) -> set[str]:
        return {thread for _, thread in self.seen}


async def queued_run(engine: AsyncEngine) -> str:
    async with session_factory(engine)() as db:
        session_id = (await queries.create_session(db, "t", OPERATOR)).id
    claimed = await claims.claim_turn(
        engine,
        caller=OPERATOR,
        session_id=session_id,
        idempotency_key="k",
        fingerprint="f",
        text="hi",
        model="scripted/t",
    )
    assert isinstance(claimed, claims.Claimed)
    return claimed.run.id


async def started_run(engine: AsyncEngine) -> tuple[Claim, runs.Settlement]:
    """A Run the worker has started, and the settlement that answers it with "42"."""
    run_id = await queued_run(engine)
    claim = await claim_run(SimpleNamespace(db_sessions=session_factory(engine), manifests=None), run_id)  # type: ignore[arg-type]
    assert claim is not None
    answered = runs.Settlement(
        run_id=run_id, session_id=claim.session_id, attempt=claim.attempt, current=RunStatus.RUNNING,
        command=RunCommand.COMPLETE, sequence=claim.user_sequence + 1,
        parts=[{"type": "text", "text": "42"}], turn_status="completed",
        events=[RunCompleted(run_id=run_id, seq=1, duration_ms=5)],
    )  # fmt: skip
    return claim, answered


def assert_run_whole(engine: AsyncEngine, statements: Statements) -> None:
    if sqlite_twin(engine) is not None:  # every statement in one of the twin's threads
        (thread,) = statements.threads()
        assert thread.startswith("fleet-sqlite"), statements.seen
    else:  # PostgreSQL: on the event loop's thread, a round trip per statement
        assert statements.threads() == {threading.current_thread().name}, statements.seen


async def test_a_runs_start_is_one_unit_and_a_duplicate_job_starts_nothing(engine: AsyncEngine) -> None:
    sessions = session_factory(engine)
    run_id = await queued_run(engine)
    statements = Statements(engine)
    deps = SimpleNamespace(db_sessions=sessions, manifests=None)
    claim = await claim_run(deps, run_id)  # type: ignore[arg-type]
    assert claim is not None and (claim.run_id, claim.attempt, claim.user_sequence) == (run_id, 1, 1)
    assert statements.kinds() == ["UPDATE", "SELECT", "SELECT"]  # the fenced start, the Run, its session
    assert_run_whole(engine, statements)
    assert await claim_run(deps, run_id) is None  # a second delivery of the job: not queued any more
    async with sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None and (run.status, run.attempt) == ("running", 1)


async def test_a_settlement_is_one_unit_and_a_stale_attempt_changes_nothing(engine: AsyncEngine) -> None:
    sessions = session_factory(engine)
    claim, settlement = await started_run(engine)
    run_id = claim.run_id
    deadline = time.monotonic() + 10
    stale = msgspec.structs.replace(settlement, attempt=7)
    assert await commit_with_retry(sessions, stale, deadline=deadline) is False  # the read fences it
    # Past the read (as if the Run changed hands between the two), the UPDATE's own fence holds.
    assert await run_whole(sessions, functools.partial(runs.commit_settlement_on, s=stale)) is False
    statements = Statements(engine)
    assert await commit_with_retry(sessions, settlement, deadline=deadline) is True
    # The Run read; on PostgreSQL the session row held FOR SHARE (fleet_shared.db.waiting); the
    # fenced UPDATE.
    locks = ["SELECT"] if engine.dialect.name == "postgresql" else []
    assert statements.kinds()[: 2 + len(locks)] == ["SELECT", *locks, "UPDATE"]
    assert "INSERT" in statements.kinds()
    assert_run_whole(engine, statements)
    assert await commit_with_retry(sessions, settlement, deadline=deadline) is True  # its own commit again
    async with sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None and (run.status, run.last_seq) == ("completed", 1)
        turns = await queries.list_turns(db, claim.session_id, after_sequence=0, limit=10)
        assert [(t.role, t.parts) for t in turns][1] == ("assistant", [{"type": "text", "text": "42"}])
        assert len(turns) == 2  # nothing written twice


async def test_work_that_raises_leaves_nothing_behind(engine: AsyncEngine) -> None:
    sessions = session_factory(engine)
    run_id = await queued_run(engine)

    def fail_after_writing(db: OrmSession) -> None:
        db.execute(update(Run).where(Run.id == run_id).values(status=RunStatus.FAILED.value))
        raise RuntimeError("midway")

    with pytest.raises(RuntimeError, match="midway"):
        await run_whole(sessions, fail_after_writing)
    async with sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None and run.status == "queued"


async def test_a_turns_history_is_read_in_one_unit(engine: AsyncEngine) -> None:
    """The conversation a Turn starts from (fleet_worker.conversation): on every Turn's path."""
    sessions = session_factory(engine)
    claim, answered = await started_run(engine)
    assert await commit_with_retry(sessions, answered, deadline=time.monotonic() + 10)
    claimed = await claims.claim_turn(
        engine,
        caller=OPERATOR,
        session_id=claim.session_id,
        idempotency_key="k2",
        fingerprint="f",
        text="and?",
        model="m",
    )
    assert isinstance(claimed, claims.Claimed)
    statements = Statements(engine)
    conversation = await load_conversation(
        sessions, claim.session_id, claimed.run.user_sequence, max_turns=20, max_chars=10_000
    )
    assert conversation.request == "and?"
    assert conversation.history == [{"request": "hi", "answer": "42"}]
    assert statements.kinds() == ["SELECT"]  # no attachments or skills: nothing else to read
    assert_run_whole(engine, statements)


async def test_a_warm_sessions_start_reads_no_manifest_entries(engine: AsyncEngine) -> None:
    """A version's manifest is read with the Run's start only when this worker has not decoded
    or captured it already: a session's next Turn on the same worker costs no extra statement."""
    sessions = session_factory(engine)
    first = await queued_run(engine)
    cache: ManifestCache[Manifest] = ManifestCache(1000)
    claim = await claim_run(SimpleNamespace(db_sessions=sessions, manifests=cache), first)  # type: ignore[arg-type]
    assert claim is not None and claim.workspace is not None
    manifest = Manifest.of([FileEntry("memory/a.txt", 1, 0o644, "a" * 64, 1)])
    change = WorkspaceChange(workspace_id=claim.workspace_id, seen_version=0, manifest=manifest)
    await run_whole(sessions, lambda db: (workspace_versions.record_on(db, change, first), db.commit()))
    await end_run(engine, first)
    cold = SimpleNamespace(db_sessions=sessions, manifests=ManifestCache(1000))
    for reads in (["UPDATE", "SELECT", "SELECT", "SELECT"], ["UPDATE", "SELECT", "SELECT"]):
        run_id = await next_run(engine, claim.session_id)
        statements = Statements(engine)
        started = await claim_run(cold, run_id)  # type: ignore[arg-type]
        assert started is not None and started.workspace is not None
        assert started.workspace.manifest == manifest and started.workspace.version == 1
        assert statements.kinds() == reads  # the second time, the entries come from the cache
        await end_run(engine, run_id)


async def next_run(engine: AsyncEngine, session_id: str) -> str:
    claimed = await claims.claim_turn(
        engine,
        caller=OPERATOR, session_id=session_id, idempotency_key=f"k-{time.monotonic_ns()}", fingerprint="f",
        text="again", model="scripted/t",
    )  # fmt: skip
    assert isinstance(claimed, claims.Claimed)
    return claimed.run.id


async def end_run(engine: AsyncEngine, run_id: str) -> None:
    async with session_factory(engine)() as db:
        await db.execute(update(Run).where(Run.id == run_id).values(status="completed"))
        await db.commit()
