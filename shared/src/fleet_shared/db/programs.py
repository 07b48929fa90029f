"""Program versions: the RLM's instructions as rows (ADR 0044). One is active, and a Run that
does not ask for another runs the version active when it starts, recorded on the Run. Nothing
becomes active but by `activate_on` (`fleet program activate`, `PUT /api/programs/active`): an
optimizer writes candidates only."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import ScalarSelect, false, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_shared.db.models import ProgramVersion, utcnow
from fleet_shared.program_text import SHIPPED_INSTRUCTIONS, text_sha256

ACTIVE, CANDIDATE, RETIRED = "active", "candidate", "retired"
SHIPPED_BY = "fleet"  # created_by of a version seeded from the text fleet ships
PROGRAMS_LOCK = 0x666C656574_01  # pg_advisory_xact_lock key: "fleet" + 1


@dataclass(frozen=True)
class Seeded:
    version_id: str
    outcome: Literal["active", "candidate", "present"]


def active_version_id() -> ScalarSelect[str]:
    """The active version's id, as a subquery (NULL when there is none)."""
    return select(ProgramVersion.id).where(ProgramVersion.status == ACTIVE).scalar_subquery()


async def list_versions(db: AsyncSession) -> list[ProgramVersion]:
    found = await db.scalars(select(ProgramVersion).order_by(ProgramVersion.created_at, ProgramVersion.id))
    return list(found)


async def get_version(db: AsyncSession, version_id: str) -> ProgramVersion | None:
    return await db.get(ProgramVersion, version_id)


async def active_version(db: AsyncSession) -> ProgramVersion | None:
    return await db.scalar(select(ProgramVersion).where(ProgramVersion.status == ACTIVE))


async def add_candidate(
    db: AsyncSession,
    text: str,
    *,
    created_by: str,
    parent_id: str | None = None,
    notes: str | None = None,
    validation: dict[str, Any] | None = None,
) -> ProgramVersion:
    """A new candidate (never active); committed by the caller. Its text is kept as a signature's
    instructions are read (inspect.cleandoc), so the stored bytes are the ones the RLM runs."""
    text = inspect.cleandoc(text)
    version = ProgramVersion(
        id=str(uuid.uuid4()),
        parent_id=parent_id,
        text=text,
        text_sha256=text_sha256(text),
        status=CANDIDATE,
        created_by=created_by,
        notes=notes,
        validation=validation,
        created_at=utcnow(),
    )
    db.add(version)
    await db.flush()
    return version


async def exclusive(db: AsyncSession) -> None:
    """Activations and seeds one at a time across every process: a transaction-long advisory
    lock on PostgreSQL, SQLite's write lock (taken by a write that changes nothing) there."""
    if db.get_bind().dialect.name == "postgresql":
        await db.execute(select(func.pg_advisory_xact_lock(PROGRAMS_LOCK)))
    else:
        await db.execute(update(ProgramVersion).where(false()).values(status=ProgramVersion.status))


async def activate_on(db: AsyncSession, version_id: str, *, rollback: bool = False) -> ProgramVersion | None:
    """Make `version_id` the active version (the one active so far is retired), in the caller's
    transaction; None when no such version exists. Runs already started keep theirs. A version
    active for the first time remembers the one it replaced; a rollback's does not change."""
    await exclusive(db)
    version = await db.get(ProgramVersion, version_id, populate_existing=True)
    if version is None:
        return None
    if version.status != ACTIVE:
        current = await active_version(db)
        if current is not None:
            current.status = RETIRED
            await db.flush()  # before the new one: one active version at any moment
        if not rollback and version.replaced_id is None and current is not None:
            version.replaced_id = current.id
        version.status, version.activated_at = ACTIVE, utcnow()
        await db.flush()
    return version


async def previous_version(db: AsyncSession) -> ProgramVersion | None:
    """What a rollback activates: the version the active one replaced when it first became active."""
    current = await active_version(db)
    if current is None or current.replaced_id is None:
        return None
    return await db.get(ProgramVersion, current.replaced_id)


async def seed_on(db: AsyncSession, text: str = SHIPPED_INSTRUCTIONS) -> Seeded:
    """The shipped instructions as a version, once per text: the active one of a database with
    none, else a candidate (a new release's text waits for an operator to activate it)."""
    await exclusive(db)
    digest = text_sha256(inspect.cleandoc(text))
    present = await db.scalar(
        select(ProgramVersion).where(
            ProgramVersion.text_sha256 == digest, ProgramVersion.created_by == SHIPPED_BY
        )
    )
    if present is not None:
        return Seeded(present.id, "present")
    version = await add_candidate(db, text, created_by=SHIPPED_BY, notes="the instructions fleet ships")
    if await active_version(db) is None:
        version.status, version.activated_at = ACTIVE, utcnow()
    await db.commit()
    return Seeded(version.id, "active" if version.status == ACTIVE else "candidate")


def seed_program(database_url: str) -> Seeded:
    """`seed_on` for synchronous callers (`fleet db upgrade`, `fleet up`, test fixtures)."""
    from fleet_shared.db.engine import create_engine, session_factory

    async def run() -> Seeded:
        engine = create_engine(database_url)
        try:
            async with session_factory(engine)() as db:
                return await seed_on(db)
        finally:
            await engine.dispose()

    return asyncio.run(run())
