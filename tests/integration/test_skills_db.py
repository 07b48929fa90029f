"""Skill cards in the DB on SQLite and PostgreSQL: seeding is idempotent, rewrites changed cards,
keeps cards whose file is gone; search and lookup; migration 0005 downgrades and upgrades again."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from alembic import command
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared.db import claims, queries, skills
from fleet_shared.db.engine import HEAD_REVISION, create_engine, current_revision, session_factory
from fleet_shared.db.migrate import alembic_config
from fleet_shared.db.models import Session
from fleet_shared.skills import load_skill_cards, seed_skills, sync_skills
from fleet_shared.tenancy import OPERATOR
from tests.conftest import POSTGRES_ADMIN_DSN, REPO


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(database_url)
    yield session_factory(engine)
    await engine.dispose()


def write_card(folder: Path, skill_id: str, version: str, body: str, description: str = "d") -> None:
    text = (
        f'+++\nname = "{skill_id} card"\nversion = "{version}"\ndescription = "{description}"\n+++\n{body}\n'
    )
    (folder / f"{skill_id}.md").write_text(text, encoding="utf-8")


async def test_the_fixtures_seed_the_built_in_cards(sessions: async_sessionmaker[AsyncSession]) -> None:
    shipped = load_skill_cards(REPO / "config" / "skills")
    async with sessions() as db:
        rows = await skills.get_skills(db, [card.id for card in shipped])
    assert [(r.id, r.version, r.digest) for r in rows] == [(c.id, c.version, c.digest) for c in shipped]


async def test_seeding_is_idempotent_updates_changed_cards_and_keeps_removed_ones(
    sessions: async_sessionmaker[AsyncSession], tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    first, second = f"t{tag}-one", f"t{tag}-two"
    write_card(tmp_path, first, "1", "the first body")
    write_card(tmp_path, second, "1", "the second body")
    async with sessions() as db:
        seeded = await sync_skills(db, load_skill_cards(tmp_path))
        again = await sync_skills(db, load_skill_cards(tmp_path))
        before = await skills.get_skill(db, first)
    assert (seeded.inserted, seeded.updated, seeded.unchanged) == ([first, second], [], [])
    assert (again.inserted, again.updated, again.unchanged) == ([], [], [first, second])
    assert before is not None
    created, stamp = before.created_at, before.updated_at

    write_card(tmp_path, first, "2", "a better body")
    (tmp_path / f"{second}.md").unlink()
    async with sessions() as db:
        changed = await sync_skills(db, load_skill_cards(tmp_path))
        rows = await skills.get_skills(db, [first, second])
    assert (changed.inserted, changed.updated, changed.unchanged) == ([], [first], [])
    updated, kept = rows
    assert (updated.version, updated.body) == ("2", "a better body")
    assert updated.created_at == created and updated.updated_at > stamp
    assert (kept.id, kept.body) == (second, "the second body")  # no file any more: still selectable


async def test_seed_skills_runs_from_synchronous_callers(database_url: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    write_card(tmp_path, f"sync-{tag}", "1", "body")
    first = await asyncio.to_thread(seed_skills, database_url, tmp_path)
    again = await asyncio.to_thread(seed_skills, database_url, tmp_path)
    assert first.inserted == [f"sync-{tag}"] and again.unchanged == [f"sync-{tag}"]
    assert (await asyncio.to_thread(seed_skills, database_url, tmp_path / "nowhere")).inserted == []


async def test_search_matches_id_name_and_description_ignoring_case(
    sessions: async_sessionmaker[AsyncSession], tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    write_card(tmp_path, f"q{tag}-a", "1", "b", description=f"Finds ZEBRA{tag} stripes")
    write_card(tmp_path, f"q{tag}-b", "1", "b", description="100% literal_match")
    async with sessions() as db:
        await sync_skills(db, load_skill_cards(tmp_path))
        by_id = await skills.list_skills(db, f"Q{tag}", 100)
        by_name = await skills.list_skills(db, f"q{tag}-A CARD", 100)
        by_description = await skills.list_skills(db, f"zebra{tag}", 100)
        wildcards = await skills.list_skills(db, "0% literal_", 100)
        underscore = await skills.list_skills(db, f"q{tag}_", 100)  # `_` is no wildcard
        everything = await skills.list_skills(db, None, 100)
        capped = await skills.list_skills(db, None, 2)
    assert [r.id for r in by_id] == [f"q{tag}-a", f"q{tag}-b"]
    assert [r.id for r in by_name] == [f"q{tag}-a"]
    assert [r.id for r in by_description] == [f"q{tag}-a"]
    assert f"q{tag}-b" in [r.id for r in wildcards]
    assert all("0% literal_" in r.description for r in wildcards)
    assert underscore == []
    assert [r.id for r in everything] == sorted(r.id for r in everything)
    assert len(capped) == 2


async def test_a_claim_puts_the_selected_skills_on_the_user_turn(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as db:
        session_id = (await queries.create_session(db, "t", OPERATOR)).id
        chosen = await skills.get_skills(db, ["csv-analysis", "code-review"])
        claimed = await claims.claim_turn(
            db,
            caller=OPERATOR,
            session_id=session_id,
            idempotency_key="k",
            fingerprint="f",
            text="hi",
            model="scripted/t",
            skills=chosen,
        )
        assert isinstance(claimed, claims.Claimed)
        turns = await queries.list_turns(db, session_id, after_sequence=0, limit=10)
        await claims.withdraw_claim(db, claimed.run.id)
    assert [p["type"] for p in turns[0].parts] == ["text", "data-skill", "data-skill"]
    assert [p["data"]["skill_id"] for p in turns[0].parts[1:]] == ["csv-analysis", "code-review"]
    assert all(p["data"]["phase"] == "selected" for p in turns[0].parts[1:])


@pytest.fixture(params=["sqlite", "postgres"])
async def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database of this test's own, so the downgrade touches no other test's tables."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'fleet.db'}"
        return
    name = f"fleet_test_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(POSTGRES_ADMIN_DSN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    base = POSTGRES_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    yield f"{base}/{name}"
    admin = await asyncpg.connect(POSTGRES_ADMIN_DSN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()


async def test_migration_0005_downgrades_and_upgrades_with_rows_present(empty_database: str) -> None:
    url = empty_database
    await asyncio.to_thread(command.upgrade, alembic_config(url), "head")
    await asyncio.to_thread(seed_skills, url, REPO / "config" / "skills")
    engine = create_engine(url)
    try:
        async with session_factory(engine)() as db:
            session = await queries.create_session(db, "kept", OPERATOR)
            assert (session.checkpoint_version, session.task) == (0, None)
        await asyncio.to_thread(command.downgrade, alembic_config(url), "0004_attachments_artifacts")
        assert await current_revision(engine) == "0004_attachments_artifacts"
        async with engine.connect() as conn:
            tables, columns = await conn.run_sync(
                lambda sync: (
                    inspect(sync).get_table_names(),
                    {c["name"] for c in inspect(sync).get_columns("sessions")},
                )
            )
        assert "skills" not in tables
        assert not {"checkpoint_version", "task"} & columns
        await asyncio.to_thread(command.upgrade, alembic_config(url), "head")
        assert await current_revision(engine) == HEAD_REVISION
        async with session_factory(engine)() as db:
            again = await db.get(Session, session.id)
        assert again is not None and again.checkpoint_version == 0  # the server default filled it
    finally:
        await engine.dispose()
