"""Runs: read one, resume its stream from any frame, cancel it."""

from __future__ import annotations

from typing import Annotated

import structlog
from litestar import Controller, Response, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath, HeaderParameter
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.cancellation import request_cancellation
from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.frames import START, parse_last_event_id
from fleet_gateway.litestar_compat import EventStream
from fleet_gateway.schemas import CancellationOut, RunOut
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import SSE_HEADERS, RunView, iso, stream_run
from fleet_shared.db import scoped
from fleet_shared.db.models import Run
from fleet_shared.ids import parse_uuid
from fleet_shared.run_state import is_terminal
from fleet_shared.tenancy import Principal

log = structlog.get_logger(__name__)

LastEventId = Annotated[
    str | None,
    HeaderParameter(
        name="Last-Event-ID",
        required=False,
        description="the id of the last frame received: `<seq>.<k>[.<n>]`",
    ),
]


async def find_run(db: AsyncSession, run_id: str, caller: Principal, *, write: bool = False) -> Run | None:
    """The Run, if its session is the caller's to read (or with `write`, to change)."""
    canonical = parse_uuid(run_id)
    return await scoped.get_run(db, canonical, caller, write=write) if canonical else None


class RunController(Controller):
    path = "/api/runs/{run_id:str}"

    @get("/")
    async def get_run(
        self, db: NamedDependency[AsyncSession], caller: NamedDependency[Principal], run_id: FromPath[str]
    ) -> RunOut:
        run = await find_run(db, run_id, caller)
        if run is None:
            raise not_found("run")
        return RunOut.of(run, iso)

    @get("/stream", status_code=200)
    async def resume_stream(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        run_id: FromPath[str],
        last_event_id: LastEventId = None,
    ) -> EventStream | Response[None]:
        # No header, or an empty one (EventSource sends none before its first id): from the start.
        after = START if not (last_event_id or "").strip() else parse_last_event_id(last_event_id or "")
        if after is None:
            raise ApiError(422, "validation_error", "Last-Event-ID must be a frame id of this stream")
        run = await find_run(db, run_id, caller)
        if run is None:
            return Response(None, status_code=204)
        view = RunView.of(run)
        settled = is_terminal(run.status)
        await db.close()  # the stream may be long: hold no DB connection while it runs
        if settled and after.seq > run.last_seq:  # an active Run may still get there
            raise ApiError(422, "validation_error", "Last-Event-ID is past the end of this Run's stream")
        body = stream_run(gw.stream_deps, view, delivery="resume", from_db=settled, after=after)
        return EventStream(
            body, media_type="text/event-stream", headers={**SSE_HEADERS, "X-Fleet-Run-ID": run.id}
        )

    @put("/cancellation", status_code=200)
    async def cancel(
        self,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        run_id: FromPath[str],
    ) -> CancellationOut:
        run = await find_run(db, run_id, caller, write=True)
        if run is None:
            raise not_found("run")
        return CancellationOut(run.id, await request_cancellation(gw, db, run))
