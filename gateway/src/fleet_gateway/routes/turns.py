"""Turns: POST claims a Run and streams it; GET pages the committed history."""

from __future__ import annotations

import hashlib
from typing import Annotated

import structlog
from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, HeaderParameter, JSONBody, QueryParameter
from litestar.response import Stream
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.errors import ApiError
from fleet_gateway.routes.sessions import load_session
from fleet_gateway.schemas import MAX_INT32, TurnPage, TurnRequest, UIMessage
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import SSE_HEADERS, RunView, iso, stream_run
from fleet_shared.db import queries
from fleet_shared.db.models import Run
from fleet_shared.queue import RUN_TURN
from fleet_shared.run_state import is_terminal

log = structlog.get_logger(__name__)

IdempotencyKey = Annotated[
    str | None, HeaderParameter(name="Idempotency-Key", required=False, description="1-128 characters")
]


def check_idempotency_key(key: str | None) -> str:
    if key is None or not key.strip():
        raise ApiError(422, "validation_error", "the Idempotency-Key header is required")
    if len(key) > 128 or not key.isprintable():
        raise ApiError(422, "validation_error", "Idempotency-Key must be 1-128 printable characters")
    return key


def check_request(data: TurnRequest, max_text_chars: int) -> None:
    if len(data.text) > max_text_chars:
        raise ApiError(422, "validation_error", f"text: at most {max_text_chars} characters")
    if data.attachment_ids:
        raise ApiError(
            422, "validation_error", f"attachment_ids: unknown attachment {data.attachment_ids[0]}"
        )
    if data.skill_selections:
        raise ApiError(
            422,
            "validation_error",
            f"skill_selections: unknown skill {data.skill_selections[0].id!r}",
        )


class TurnController(Controller):
    path = "/api/sessions/{session_id:str}/turns"

    @post("/", status_code=200)
    async def submit_turn(
        self,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        session_id: FromPath[str],
        data: JSONBody[TurnRequest],
        idempotency_key: IdempotencyKey = None,
    ) -> Stream:
        key = check_idempotency_key(idempotency_key)
        check_request(data, gw.settings.profile.gateway.limits.max_text_chars)
        # Plain strings from here on: a lost race rolls the DB session back, expiring ORM objects.
        session_id = (await load_session(db, session_id)).id
        outcome = await queries.claim_turn(
            db,
            session_id=session_id,
            idempotency_key=key,
            fingerprint=hashlib.sha256(data.fingerprint_bytes()).hexdigest(),
            text=data.text,
            model=gw.settings.root_lm.name,
        )
        if isinstance(outcome, queries.ClaimRefused):
            raise refusal(outcome)
        run = outcome.run
        structlog.contextvars.bind_contextvars(run_id=run.id, session_id=session_id)
        if outcome.created:
            log.info("turn.claimed")
            await enqueue(db, gw, run)
        settled = is_terminal(run.status)  # a replayed settled Run, or one that failed to enqueue
        body = stream_run(
            gw.stream_deps,
            RunView.of(run),
            delivery="replay" if settled and not outcome.created else "live",
            idempotent_replay=not outcome.created,
            from_db=settled,
        )
        return Stream(
            body,
            media_type="text/event-stream",
            headers={**SSE_HEADERS, "X-Fleet-Run-ID": run.id},
        )

    @get("/")
    async def list_turns(
        self,
        db: NamedDependency[AsyncSession],
        session_id: FromPath[str],
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 100,
        after_sequence: Annotated[int, QueryParameter(ge=0, le=MAX_INT32)] = 0,
    ) -> TurnPage:
        session = await load_session(db, session_id)
        rows = await queries.list_turns(db, session.id, after_sequence=after_sequence, limit=limit)
        items = [UIMessage.of(turn, iso) for turn in rows]
        more = len(rows) == limit
        return TurnPage(items, rows[-1].sequence if more and rows else None)


def refusal(outcome: queries.ClaimRefused) -> ApiError:
    if outcome.reason == "turn_in_progress":
        return ApiError(409, "turn_in_progress", "a Turn is already running in this session")
    return ApiError(
        409,
        "idempotency_key_mismatch",
        "this Idempotency-Key was already used with a different request body",
    )


async def enqueue(db: AsyncSession, gw: GatewayState, run: Run) -> None:
    """Enqueue with job id = run id; if Redis refuses, the Run fails now instead of idling queued."""
    try:
        await gw.arq.enqueue_job(RUN_TURN, run.id, _job_id=run.id)
    except (RedisError, OSError) as exc:
        log.error("turn.enqueue_failed", error=str(exc))
        message = "the Turn could not be queued (Redis unavailable); send it again"
        if await queries.fail_queued_run(db, run.id, "enqueue_failed", message) is not None:
            run.status = "failed"
