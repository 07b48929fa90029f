"""Program versions over HTTP, for callers with the `admin` scope: list them, read one, store a
candidate, and choose the active one (what `fleet program` does on the database). A Turn may
name a version to run (`program_version`, admin only): how candidates are evaluated on real
Turns before anyone activates them."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import msgspec
from litestar import Controller, get, patch, post, put
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.auth import PRINCIPAL_STATE
from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.origins import from_this_host
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import iso
from fleet_shared.db import programs
from fleet_shared.db.models import ProgramVersion
from fleet_shared.ids import parse_uuid
from fleet_shared.program_text import MAX_INSTRUCTIONS_CHARS
from fleet_shared.tenancy import ADMIN, Principal

NO_NUL = r"^[^\x00]*$"


class ProgramSummary(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    parent_id: str | None
    status: str  # candidate, active or retired
    created_by: str
    notes: str | None
    text_sha256: str
    validation: dict[str, Any] | None  # a candidate's scores beside the active version's
    created_at: str
    activated_at: str | None

    @classmethod
    def of(cls, row: ProgramVersion) -> ProgramSummary:
        return cls(
            id=row.id, parent_id=row.parent_id, status=row.status, created_by=row.created_by,
            notes=row.notes, text_sha256=row.text_sha256, validation=row.validation,
            created_at=iso(row.created_at), activated_at=iso(row.activated_at) if row.activated_at else None,
        )  # fmt: skip


class ProgramOut(ProgramSummary, frozen=True, kw_only=True):
    text: str  # the RLM's instructions

    @classmethod
    def of(cls, row: ProgramVersion) -> ProgramOut:
        return cls(**msgspec.structs.asdict(ProgramSummary.of(row)), text=row.text)


class ProgramPage(msgspec.Struct, frozen=True):
    items: list[ProgramSummary]


class NewProgram(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A candidate: never active until a `PUT /api/programs/active` names it."""

    text: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_INSTRUCTIONS_CHARS, pattern=NO_NUL)]
    notes: Annotated[str, msgspec.Meta(max_length=4000, pattern=NO_NUL)] | None = None
    parent_id: uuid.UUID | None = None
    validation: dict[str, Any] | None = None


class ProgramNotes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What may change on a version: its notes and validation scores (never its text)."""

    notes: Annotated[str, msgspec.Meta(max_length=4000, pattern=NO_NUL)] | msgspec.UnsetType = msgspec.UNSET
    validation: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class ActiveProgram(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: uuid.UUID


async def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _handler: BaseRouteHandler) -> None:
    """The `admin` scope; and a change never from a web page, even an allowed origin's: the
    text every tenant's Runs follow is as much the operator's as the settings are."""
    principal = connection.state.get(PRINCIPAL_STATE)
    if not isinstance(principal, Principal) or not principal.may(ADMIN):
        raise ApiError(403, "forbidden", "program versions need the `admin` scope")
    if connection.scope.get("method", "GET") != "GET" and not from_this_host(connection.headers.items()):
        raise ApiError(403, "origin_not_allowed", "program versions are never changed from a web page")


class ProgramController(Controller):
    path = "/api/programs"
    guards = [require_admin]

    @get("/")
    async def list_programs(self, db: NamedDependency[AsyncSession]) -> ProgramPage:
        """Every program version, oldest first, without its text."""
        return ProgramPage([ProgramSummary.of(row) for row in await programs.list_versions(db)])

    @get("/{version_id:str}")
    async def get_program(self, db: NamedDependency[AsyncSession], version_id: FromPath[str]) -> ProgramOut:
        """One version with its text; 404 for an unknown or malformed id."""
        canonical = parse_uuid(version_id)
        row = await programs.get_version(db, canonical) if canonical else None
        if row is None:
            raise not_found("program version")
        return ProgramOut.of(row)

    @post("/")
    async def add_program(
        self,
        db: NamedDependency[AsyncSession],
        caller: NamedDependency[Principal],
        data: JSONBody[NewProgram],
    ) -> ProgramOut:
        """Store a candidate (201); it runs only in Turns that name it until it is activated."""
        parent = str(data.parent_id) if data.parent_id else None
        if parent is not None and await programs.get_version(db, parent) is None:
            raise ApiError(422, "validation_error", "parent_id: no such program version")
        row = await programs.add_candidate(
            db,
            data.text,
            created_by=caller.user,
            parent_id=parent,
            notes=data.notes,
            validation=data.validation,
        )
        await db.commit()
        return ProgramOut.of(row)

    @patch("/{version_id:str}")
    async def annotate_program(
        self, db: NamedDependency[AsyncSession], version_id: FromPath[str], data: JSONBody[ProgramNotes]
    ) -> ProgramOut:
        """Set a version's notes or validation scores (an optimizer records them); its text and
        status never change here."""
        canonical = parse_uuid(version_id)
        row = await programs.get_version(db, canonical) if canonical else None
        if row is None:
            raise not_found("program version")
        if data.notes is not msgspec.UNSET:
            row.notes = data.notes
        if data.validation is not msgspec.UNSET:
            row.validation = data.validation
        await db.commit()
        return ProgramOut.of(row)

    @put("/active")
    async def activate_program(
        self, db: NamedDependency[AsyncSession], data: JSONBody[ActiveProgram]
    ) -> ProgramOut:
        """Make a version the active one (the one active so far is retired): Runs that start from
        now on run it; Runs already started keep theirs. Naming a retired version rolls back."""
        row = await programs.activate_on(db, str(data.id))
        if row is None:
            raise not_found("program version")
        await db.commit()
        return ProgramOut.of(row)


async def checked_program(gw: GatewayState, caller: Principal, version: uuid.UUID | None) -> str | None:
    """A Turn's `program_version`: only an admin may name one, and it must exist (one read,
    only for a Turn that names one)."""
    if version is None:
        return None
    if not caller.may(ADMIN):
        raise ApiError(403, "forbidden", "program_version needs the `admin` scope")
    async with gw.db_sessions() as db:
        if await programs.get_version(db, str(version)) is None:
            raise ApiError(422, "validation_error", "program_version: no such program version")
    return str(version)
