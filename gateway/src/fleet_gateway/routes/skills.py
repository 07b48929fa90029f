"""Skills: the cards a Turn may select, listed and searched, and one card with its body."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.errors import not_found
from fleet_gateway.schemas import NO_NUL, SkillOut, SkillPage, SkillSummary
from fleet_shared.db import skills
from fleet_shared.skills import SKILL_ID

MAX_LISTED = 100


class SkillController(Controller):
    path = "/api/skills"

    @get("/")
    async def list_skills(
        self,
        db: NamedDependency[AsyncSession],
        q: Annotated[str | None, QueryParameter(max_length=200, pattern=NO_NUL)] = None,
    ) -> SkillPage:
        rows = await skills.list_skills(db, q.strip() if q else None, MAX_LISTED)
        return SkillPage([SkillSummary.of(row) for row in rows])

    @get("/{skill_id:str}")
    async def get_skill(self, db: NamedDependency[AsyncSession], skill_id: FromPath[str]) -> SkillOut:
        # A malformed id cannot name a card: the same 404 as an unknown one, without a query.
        row = await skills.get_skill(db, skill_id) if SKILL_ID.fullmatch(skill_id) else None
        if row is None:
            raise not_found("skill")
        return SkillOut.of(row)
