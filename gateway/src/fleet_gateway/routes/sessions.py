"""Sessions: create, list, read, rename or archive, delete, fork, and the task checkpoint."""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import Controller, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway import cancellation
from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.routes.webhooks import checked_target
from fleet_gateway.schemas import (
    MAX_INT32,
    NO_NUL,
    CreateSession,
    ForkSession,
    SessionDetail,
    SessionOut,
    SessionPage,
    TaskOut,
    UpdateSession,
)
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import iso
from fleet_shared.db import queries, runs, scoped
from fleet_shared.db.files import StorageQuota, quota_refusal, stored_bytes, version_bytes
from fleet_shared.db.forks import fork_session
from fleet_shared.db.models import Session
from fleet_shared.ids import parse_uuid
from fleet_shared.tenancy import Principal


async def load_session(
    db: AsyncSession, session_id: str, caller: Principal, *, write: bool = False
) -> Session:
    """The session, or the same 404 for malformed, missing and foreign ids (another tenant's, or
    another user's without `sessions:read:all`; to change it, only its owner's)."""
    canonical = parse_uuid(session_id)
    session = await scoped.get_session(db, canonical, caller, write=write) if canonical else None
    if session is None:
        raise not_found("session")
    return session


class SessionController(Controller):
    path = "/api/sessions"

    @post("/", status_code=201)
    async def create_session(
        self,
        db: NamedDependency[AsyncSession],
        caller: NamedDependency[Principal],
        data: JSONBody[CreateSession | None] = None,
    ) -> SessionOut:
        title = (data.title if data else "").strip()
        session = await queries.create_session(db, title, caller)
        return SessionOut.of(session, iso)

    @get("/")
    async def list_sessions(
        self,
        *,
        db: NamedDependency[AsyncSession],
        caller: NamedDependency[Principal],
        status: FromQuery[str | None] = None,
        search: Annotated[str | None, QueryParameter(max_length=200, pattern=NO_NUL)] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=100)] = 50,
        offset: Annotated[int, QueryParameter(ge=0, le=MAX_INT32)] = 0,
    ) -> SessionPage:
        if status not in (None, "active", "archived"):
            raise ApiError(422, "validation_error", "status must be 'active' or 'archived'")
        rows, total = await scoped.list_sessions(
            db, caller, status=status, search=search, limit=limit, offset=offset
        )
        return SessionPage([SessionOut.of(s, iso) for s in rows], total)

    @get("/{session_id:str}")
    async def get_session(
        self, db: NamedDependency[AsyncSession], caller: NamedDependency[Principal], session_id: FromPath[str]
    ) -> SessionDetail:
        session = await load_session(db, session_id, caller)
        return SessionDetail.of(session, iso, cost_usd=await runs.session_cost_usd(db, session.id))

    @patch("/{session_id:str}")
    async def update_session(
        self,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        session_id: FromPath[str],
        data: JSONBody[UpdateSession],
    ) -> SessionOut:
        """Rename and/or archive a session, set its Turns' default approval mode, or set (`null`:
        clear) their default webhook. An archived session refuses new Turns (409
        `session_archived`); a Turn already running finishes, and history stays readable."""
        fields = (data.title, data.status, data.webhook, data.approval)
        if all(value is msgspec.UNSET for value in fields):
            message = "body: set at least one of title, status, webhook, approval"
            raise ApiError(422, "validation_error", message)
        webhook = None if data.webhook is msgspec.UNSET else (checked_target(gw.settings, data.webhook),)
        session = await load_session(db, session_id, caller, write=True)
        title = None if data.title is msgspec.UNSET else data.title.strip()
        status = None if data.status is msgspec.UNSET else data.status
        approval = None if data.approval is msgspec.UNSET else data.approval
        updated = await queries.update_session(
            db, session.id, title=title, status=status, webhook=webhook, approval=approval
        )
        if updated is None:
            raise not_found("session")
        return SessionOut.of(updated, iso)

    @delete("/{session_id:str}", status_code=204)
    async def delete_session(
        self,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        session_id: FromPath[str],
    ) -> None:
        """Delete the session: its Runs, events, history, feedback, artifacts, workspace versions,
        and the attachments only it names (docs/api.md). From the answer on, every route of it is
        404; an active Run is cancelled first, and the rows go once it has ended."""
        session = await load_session(db, session_id, caller, write=True)
        await cancellation.delete_session(gw, db, session.id)

    @get("/{session_id:str}/task")
    async def get_task(
        self, db: NamedDependency[AsyncSession], caller: NamedDependency[Principal], session_id: FromPath[str]
    ) -> TaskOut:
        """The bounded goal-and-progress checkpoint, as the last commit wrote it (docs/rlm.md)."""
        return TaskOut.of(await load_session(db, session_id, caller))

    @post("/{session_id:str}/fork", status_code=201)
    async def fork(
        self,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        session_id: FromPath[str],
        data: JSONBody[ForkSession | None] = None,
    ) -> SessionOut:
        """A new session that starts from this one's committed state: the Turns of its ended
        Runs, its task checkpoint and its workspace versions (rows only; no file is copied).
        From then on each has its own history and workspace. A Run still in progress is not
        part of the fork (docs/api.md)."""
        parent = await load_session(db, session_id, caller)  # a reader may fork: the fork is its own
        # The fork's versions count again (fleet_shared.db.files): within the tenant's quota.
        profile = gw.settings.profile
        quota = StorageQuota.of(profile.storage, profile.quotas.of(caller.tenant))
        stored = await stored_bytes(db, tenant=caller.tenant)
        if refusal := quota_refusal(quota, stored, await version_bytes(db, parent.workspace_id)):
            raise ApiError(507, "storage_quota_exceeded", f"the session was not forked: {refusal}")
        await db.commit()  # the fork runs in a transaction of its own (fleet_shared.db.forks)
        title = None if data is None or data.title is msgspec.UNSET else data.title.strip()
        forked = await fork_session(gw.db_sessions, parent.id, title, caller)
        if forked is None:
            raise not_found("session")
        return SessionOut.of(forked, iso)
