"""Claims, idempotency, the one-active-Run index and the fenced commit, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import event, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared.db import claims, queries, runs
from fleet_shared.db.engine import (
    HEAD_REVISION,
    create_engine,
    current_revision,
    dispose_engine,
    session_factory,
    sqlite_twin,
)
from fleet_shared.db.models import Run
from fleet_shared.events import Reasoning, RunCompleted
from fleet_shared.run_state import RunCommand, RunStatus
from fleet_shared.tenancy import OPERATOR


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(database_url)
    yield session_factory(engine)
    await engine.dispose()


async def claim(db: AsyncSession, session_id: str, key: str, fingerprint: str = "f1") -> object:
    return await claims.claim_turn(
        db,
        caller=OPERATOR,
        session_id=session_id,
        idempotency_key=key,
        fingerprint=fingerprint,
        text="hi",
        model="scripted/t",
    )


async def test_schema_is_at_head(database_url: str) -> None:
    engine = create_engine(database_url)
    assert await current_revision(engine) == HEAD_REVISION
    await engine.dispose()


async def test_claim_replay_mismatch_and_in_progress(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as db:
        session = await queries.create_session(db, "t", OPERATOR)
        first = await claim(db, session.id, "k1")
        assert isinstance(first, claims.Claimed) and first.created
        assert first.run.status == "queued" and first.run.user_sequence == 1

        again = await claim(db, session.id, "k1")
        assert isinstance(again, claims.Claimed) and not again.created
        assert again.run.id == first.run.id

        mismatch = await claim(db, session.id, "k1", fingerprint="other")
        assert mismatch == claims.ClaimRefused("idempotency_key_mismatch", first.run.id)

        busy = await claim(db, session.id, "k2")
        assert busy == claims.ClaimRefused("turn_in_progress", first.run.id)


async def test_a_claim_is_one_read_two_inserts_and_the_commit(database_url: str) -> None:
    """A claim stands between a POST and its first byte, and each statement is a round trip:
    the key, the active Run, the session and the last sequence are read in one statement."""
    engine = create_engine(database_url)
    statements: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        statements.append(statement.split(maxsplit=1)[0].upper())

    try:
        sessions = session_factory(engine)
        async with sessions() as db:
            session_id = (await queries.create_session(db, "t", OPERATOR)).id
        # On SQLite the claim runs whole on the engine's pysqlite twin (one hop to a thread).
        twin = sqlite_twin(engine)
        assert (twin is not None) == database_url.startswith("sqlite")
        event.listen(twin.engine if twin else engine.sync_engine, "before_cursor_execute", count)
        async with sessions() as db:
            claimed = await claim(db, session_id, "k1")
        assert isinstance(claimed, claims.Claimed) and claimed.created
        assert statements == ["SELECT", "INSERT", "INSERT"]
        async with sessions() as db:  # what the plain INSERTs wrote reads back as the ORM's rows
            run = await queries.get_run(db, claimed.run.id)
            assert run is not None and run.usage is None and run.failure_code is None
            assert (run.status, run.user_sequence, run.attempt) == ("queued", 1, 0)
            (turn,) = await queries.list_turns(db, session_id, after_sequence=0, limit=10)
            assert turn.parts == [{"type": "text", "text": "hi"}] and turn.run_id == run.id
    finally:
        await dispose_engine(engine)


async def test_a_claims_read_finds_the_active_run_through_its_index_not_the_sessions_runs(
    sqlite_url: str,
) -> None:
    """The read looks up the keyed Run and the active Run by index: with the active statuses as
    bound parameters SQLite could not use the partial index and read every Run of the session,
    a cost that grew with the session's length (0.36 ms at 3,000 Runs)."""
    engine = create_engine(sqlite_url)
    reads: list[tuple[str, object]] = []

    def keep(_conn: object, _cursor: object, statement: str, parameters: object, *_args: object) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            reads.append((statement, parameters))

    try:
        sessions = session_factory(engine)
        async with sessions() as db:
            session_id = (await queries.create_session(db, "t", OPERATOR)).id
        twin = sqlite_twin(engine)
        assert twin is not None
        event.listen(twin.engine, "before_cursor_execute", keep)
        async with sessions() as db:
            assert isinstance(await claim(db, session_id, "k1"), claims.Claimed)
        ((statement, parameters),) = reads
        with twin.engine.connect() as connection:
            plan = [
                row[3] for row in connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
            ]
        assert any("uq_runs_one_active_per_session" in step for step in plan), plan
        assert not any("ix_runs_session_id" in step or step.startswith("SCAN runs") for step in plan), plan
    finally:
        await dispose_engine(engine)


async def test_claims_in_unknown_and_archived_sessions_are_refused(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as db:
        assert await claim(db, "7d0c8f3e-0000-4000-8000-000000000000", "k") == claims.ClaimRefused(
            "unknown_session"
        )
        session_id = (await queries.create_session(db, "t", OPERATOR)).id
        first = await claim(db, session_id, "k1")
        assert isinstance(first, claims.Claimed)
        await db.execute(update(Run).where(Run.id == first.run.id).values(status="completed"))
        await queries.update_session(db, session_id, status="archived")
        assert await claim(db, session_id, "k2") == claims.ClaimRefused("session_archived")
        again = await claim(db, session_id, "k1")  # the key first: an existing Run still replays
        assert isinstance(again, claims.Claimed) and not again.created


async def test_partial_unique_index_allows_one_active_run(sessions: async_sessionmaker[AsyncSession]) -> None:
    """The index itself (not just the pre-check) refuses a second non-terminal Run."""
    async with sessions() as db:
        session_id = (await queries.create_session(db, "t", OPERATOR)).id
        first = await claim(db, session_id, "a")
        assert isinstance(first, claims.Claimed)
        first_id = first.run.id
        db.add(
            Run(
                id="00000000-0000-0000-0000-000000000001",
                session_id=session_id,
                status="running",
                attempt=0,
                idempotency_key="b",
                request_fingerprint="x",
                model="m",
                user_sequence=9,
                last_seq=0,
            )
        )
        with pytest.raises(IntegrityError):
            await db.commit()
        await db.rollback()
        # Once the first Run is terminal, a new one may start.
        await db.execute(update(Run).where(Run.id == first_id).values(status="completed"))
        await db.commit()
        second = await claim(db, session_id, "b")
        assert isinstance(second, claims.Claimed) and second.created
        assert second.run.user_sequence == 2


async def test_concurrent_claims_admit_exactly_one(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as db:
        session = await queries.create_session(db, "race", OPERATOR)

    async def attempt(key: str) -> object:
        async with sessions() as db:
            return await claim(db, session.id, key)

    outcomes = await asyncio.gather(*(attempt(f"key-{i}") for i in range(6)))
    created = [o for o in outcomes if isinstance(o, claims.Claimed) and o.created]
    refused = [o for o in outcomes if isinstance(o, claims.ClaimRefused)]
    assert len(created) == 1
    assert len(refused) == 5 and all(r.reason == "turn_in_progress" for r in refused)


async def test_start_run_is_atomic_and_duplicates_do_nothing(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as db:
        session = await queries.create_session(db, "t", OPERATOR)
        claimed = await claim(db, session.id, "k")
        assert isinstance(claimed, claims.Claimed)
        run_id = claimed.run.id

    async def start() -> Run | None:
        async with sessions() as db:
            started = await db.run_sync(runs.start_run_on, run_id)
            return started.run if started is not None else None

    results = await asyncio.gather(start(), start(), start())
    started = [r for r in results if r is not None]
    assert len(started) == 1
    assert started[0].status == "running" and started[0].attempt == 1


async def test_commit_is_fenced_by_attempt(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as db:
        session_id = (await queries.create_session(db, "t", OPERATOR)).id
        claimed = await claim(db, session_id, "k")
        assert isinstance(claimed, claims.Claimed)
        started = await db.run_sync(runs.start_run_on, claimed.run.id)
        assert started is not None
        run = started.run
        run_id, attempt, user_sequence = run.id, run.attempt, run.user_sequence
        events = [
            Reasoning(run_id=run_id, seq=1, part_id="r1", text="think"),
            RunCompleted(run_id=run_id, seq=2, duration_ms=5),
        ]
        settlement = runs.Settlement(
            run_id=run_id,
            session_id=session_id,
            attempt=attempt + 1,  # a stale or foreign attempt
            current=RunStatus.RUNNING,
            command=RunCommand.COMPLETE,
            sequence=user_sequence + 1,
            parts=[{"type": "text", "text": "late"}],
            turn_status="completed",
            events=events,
        )
        assert not await runs.commit_settlement(db, settlement)
        assert (await queries.list_turns(db, session_id, after_sequence=0, limit=10))[-1].role == "user"

        import msgspec

        mine = msgspec.structs.replace(settlement, attempt=attempt)
        assert await runs.commit_settlement(db, mine)
        fresh = await queries.get_run(db, run_id)
        assert fresh is not None and fresh.status == "completed" and fresh.finished_at is not None
        turns = await queries.list_turns(db, session_id, after_sequence=0, limit=10)
        assert [t.role for t in turns] == ["user", "assistant"]
        assert await queries.load_run_events(db, run_id) == events
        # A second commit of the same Run is refused: it is no longer running.
        assert not await runs.commit_settlement(db, mine)


async def test_concurrent_retries_with_one_key_all_get_the_same_run(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """An idempotent client retrying while its first POST is in flight attaches, never 409s."""
    async with sessions() as db:
        session_id = (await queries.create_session(db, "retry", OPERATOR)).id

    async def attempt() -> object:
        async with sessions() as db:
            return await claim(db, session_id, "one-key")

    outcomes = await asyncio.gather(*(attempt() for _ in range(8)))
    assert all(isinstance(o, claims.Claimed) for o in outcomes), outcomes
    claimed = [o for o in outcomes if isinstance(o, claims.Claimed)]
    assert sum(o.created for o in claimed) == 1
    assert len({o.run.id for o in claimed}) == 1


async def test_the_migrated_schema_matches_the_models(database_url: str) -> None:
    """Alembic owns the schema: every model change needs its migration, and vice versa."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from fleet_shared.db.models import Base

    engine = create_engine(database_url)
    async with engine.connect() as conn:
        diff = await conn.run_sync(
            lambda sync: compare_metadata(MigrationContext.configure(sync), Base.metadata)
        )
    await engine.dispose()
    assert diff == []


async def test_a_withdrawn_claim_leaves_nothing_and_frees_the_key(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as db:
        session_id = (await queries.create_session(db, "t", OPERATOR)).id
        first = await claim(db, session_id, "k")
        assert isinstance(first, claims.Claimed)
        assert await claims.withdraw_claim(db, first.run.id) is True
        assert await queries.list_turns(db, session_id, after_sequence=0, limit=10) == []
        assert await queries.get_run(db, first.run.id) is None
        again = await claim(db, session_id, "k")  # the same key claims afresh
        assert isinstance(again, claims.Claimed) and again.created
        assert await db.run_sync(runs.start_run_on, again.run.id) is not None
        assert await claims.withdraw_claim(db, again.run.id) is False  # a started Run stays


async def test_take_over_bumps_the_attempt_and_fences_the_old_owner(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as db:
        session_id = (await queries.create_session(db, "t", OPERATOR)).id
        claimed = await claim(db, session_id, "k")
        assert isinstance(claimed, claims.Claimed)
        started = await db.run_sync(runs.start_run_on, claimed.run.id)
        assert started is not None and started.run.attempt == 1
        run = started.run
        run_id, user_sequence = run.id, run.user_sequence
        assert await runs.take_over_run(db, run_id, attempt=1) is True
        assert await runs.take_over_run(db, run_id, attempt=1) is False  # only one taker
        taken = await queries.get_run(db, run_id)
        assert taken is not None and (taken.status, taken.attempt) == ("running", 2)
        old = settlement(run_id, session_id, attempt=1, user_sequence=user_sequence)
        assert await runs.commit_settlement(db, old) is False  # the old owner is fenced out
        new = settlement(run_id, session_id, attempt=2, user_sequence=user_sequence)
        assert await runs.commit_settlement(db, new) is True
        ended = await queries.get_run(db, run_id)
        assert ended is not None and ended.status == "completed"
        assert len(await queries.list_turns(db, session_id, after_sequence=0, limit=10)) == 2
        assert await runs.take_over_run(db, run_id, attempt=2) is False  # terminal: nothing to take


async def test_cancelling_a_queued_run_writes_its_tombstone_in_one_go(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as db:
        session_id = (await queries.create_session(db, "t", OPERATOR)).id
        claimed = await claim(db, session_id, "k")
        assert isinstance(claimed, claims.Claimed)
        terminal = await runs.cancel_queued_run(db, claimed.run.id)
        assert terminal is not None and terminal.seq == 1
        assert await runs.cancel_queued_run(db, claimed.run.id) is None  # once
        assert await db.run_sync(runs.start_run_on, claimed.run.id) is None  # no worker can claim it now
        turns = await queries.list_turns(db, session_id, after_sequence=0, limit=10)
        events = await queries.load_run_events(db, claimed.run.id)
    assert [t.role for t in turns] == ["user", "assistant"]
    assert turns[1].status == "cancelled" and turns[1].parts == [
        {"type": "text", "text": "Turn cancelled", "state": "done"}
    ]
    assert events == [terminal]


def settlement(run_id: str, session_id: str, *, attempt: int, user_sequence: int) -> runs.Settlement:
    return runs.Settlement(
        run_id=run_id,
        session_id=session_id,
        attempt=attempt,
        current=RunStatus.RUNNING,
        command=RunCommand.COMPLETE,
        sequence=user_sequence + 1,
        parts=[],
        turn_status="completed",
        events=[RunCompleted(run_id=run_id, seq=1, duration_ms=1)],
    )
