"""Claims, idempotency, the one-active-Run index and the fenced commit, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared.db import queries
from fleet_shared.db.engine import HEAD_REVISION, create_engine, current_revision, session_factory
from fleet_shared.db.models import Run
from fleet_shared.events import Reasoning, RunCompleted
from fleet_shared.run_state import RunCommand, RunStatus


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(database_url)
    yield session_factory(engine)
    await engine.dispose()


async def claim(db: AsyncSession, session_id: str, key: str, fingerprint: str = "f1") -> object:
    return await queries.claim_turn(
        db, session_id=session_id, idempotency_key=key, fingerprint=fingerprint, text="hi", model="scripted/t"
    )


async def test_schema_is_at_head(database_url: str) -> None:
    engine = create_engine(database_url)
    assert await current_revision(engine) == HEAD_REVISION
    await engine.dispose()


async def test_claim_replay_mismatch_and_in_progress(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as db:
        session = await queries.create_session(db, "t")
        first = await claim(db, session.id, "k1")
        assert isinstance(first, queries.Claimed) and first.created
        assert first.run.status == "queued" and first.run.user_sequence == 1

        again = await claim(db, session.id, "k1")
        assert isinstance(again, queries.Claimed) and not again.created
        assert again.run.id == first.run.id

        mismatch = await claim(db, session.id, "k1", fingerprint="other")
        assert mismatch == queries.ClaimRefused("idempotency_key_mismatch", first.run.id)

        busy = await claim(db, session.id, "k2")
        assert busy == queries.ClaimRefused("turn_in_progress", first.run.id)


async def test_partial_unique_index_allows_one_active_run(sessions: async_sessionmaker[AsyncSession]) -> None:
    """The index itself (not just the pre-check) refuses a second non-terminal Run."""
    async with sessions() as db:
        session_id = (await queries.create_session(db, "t")).id
        first = await claim(db, session_id, "a")
        assert isinstance(first, queries.Claimed)
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
        assert isinstance(second, queries.Claimed) and second.created
        assert second.run.user_sequence == 2


async def test_concurrent_claims_admit_exactly_one(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as db:
        session = await queries.create_session(db, "race")

    async def attempt(key: str) -> object:
        async with sessions() as db:
            return await claim(db, session.id, key)

    outcomes = await asyncio.gather(*(attempt(f"key-{i}") for i in range(6)))
    created = [o for o in outcomes if isinstance(o, queries.Claimed) and o.created]
    refused = [o for o in outcomes if isinstance(o, queries.ClaimRefused)]
    assert len(created) == 1
    assert len(refused) == 5 and all(r.reason == "turn_in_progress" for r in refused)


async def test_start_run_is_atomic_and_duplicates_do_nothing(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as db:
        session = await queries.create_session(db, "t")
        claimed = await claim(db, session.id, "k")
        assert isinstance(claimed, queries.Claimed)
        run_id = claimed.run.id

    async def start() -> Run | None:
        async with sessions() as db:
            return await queries.start_run(db, run_id)

    results = await asyncio.gather(start(), start(), start())
    started = [r for r in results if r is not None]
    assert len(started) == 1
    assert started[0].status == "running" and started[0].attempt == 1


async def test_commit_is_fenced_by_attempt(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as db:
        session_id = (await queries.create_session(db, "t")).id
        claimed = await claim(db, session_id, "k")
        assert isinstance(claimed, queries.Claimed)
        run = await queries.start_run(db, claimed.run.id)
        assert run is not None
        run_id, attempt, user_sequence = run.id, run.attempt, run.user_sequence
        assert await queries.apply_transition(
            db, run_id, RunStatus.RUNNING, RunCommand.SETTLE, attempt=attempt
        )
        await db.commit()
        events = [
            Reasoning(run_id=run_id, seq=1, part_id="r1", text="think"),
            RunCompleted(run_id=run_id, seq=2, duration_ms=5),
        ]
        settlement = queries.Settlement(
            run_id=run_id,
            session_id=session_id,
            attempt=attempt + 1,  # a stale or foreign attempt
            current=RunStatus.SETTLING,
            command=RunCommand.COMPLETE,
            sequence=user_sequence + 1,
            parts=[{"type": "text", "text": "late"}],
            turn_status="completed",
            events=events,
        )
        assert not await queries.commit_settlement(db, settlement)
        assert (await queries.list_turns(db, session_id, after_sequence=0, limit=10))[-1].role == "user"

        import msgspec

        mine = msgspec.structs.replace(settlement, attempt=attempt)
        assert await queries.commit_settlement(db, mine)
        fresh = await queries.get_run(db, run_id)
        assert fresh is not None and fresh.status == "completed" and fresh.finished_at is not None
        turns = await queries.list_turns(db, session_id, after_sequence=0, limit=10)
        assert [t.role for t in turns] == ["user", "assistant"]
        assert await queries.load_run_events(db, run_id) == events
        # A second commit of the same Run is refused: it is no longer settling.
        assert not await queries.commit_settlement(db, mine)


async def test_concurrent_retries_with_one_key_all_get_the_same_run(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """An idempotent client retrying while its first POST is in flight attaches, never 409s."""
    async with sessions() as db:
        session_id = (await queries.create_session(db, "retry")).id

    async def attempt() -> object:
        async with sessions() as db:
            return await claim(db, session_id, "one-key")

    outcomes = await asyncio.gather(*(attempt() for _ in range(8)))
    assert all(isinstance(o, queries.Claimed) for o in outcomes), outcomes
    claimed = [o for o in outcomes if isinstance(o, queries.Claimed)]
    assert sum(o.created for o in claimed) == 1
    assert len({o.run.id for o in claimed}) == 1
