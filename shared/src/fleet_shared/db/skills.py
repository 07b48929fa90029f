"""Skill cards as stored: listing, search and lookup (seeding lives in `fleet_shared.skills`)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db.models import Skill
from fleet_shared.db.queries import contains_pattern


async def list_skills(db: AsyncSession, q: str | None, limit: int) -> Sequence[Skill]:
    """Skills ordered by id; with `q`, those whose id, name or description contains it
    (ignoring case)."""
    query = select(Skill)
    if q:
        pattern = contains_pattern(q)
        query = query.where(
            or_(
                Skill.id.ilike(pattern, escape="\\"),
                Skill.name.ilike(pattern, escape="\\"),
                Skill.description.ilike(pattern, escape="\\"),
            )
        )
    rows = await db.scalars(query.order_by(Skill.id).limit(limit))
    return rows.all()


async def get_skill(db: AsyncSession, skill_id: str) -> Skill | None:
    return await db.get(Skill, skill_id)


async def get_skills(db: AsyncSession, ids: Sequence[str]) -> list[Skill]:
    """The skills with these ids, in the order asked (unknown ids are left out)."""
    return await db.run_sync(get_skills_on, ids) if ids else []


def get_skills_on(db: OrmSession, ids: Sequence[str]) -> list[Skill]:
    """get_skills on a synchronous session (fleet_shared.db.engine.run_whole)."""
    if not ids:
        return []
    rows = db.scalars(select(Skill).where(Skill.id.in_(list(ids)))).all()
    found = {row.id: row for row in rows}
    return [found[i] for i in ids if i in found]
