"""Turns: POST claims a Run and streams it; GET pages the committed history."""

from __future__ import annotations

import functools
import hashlib
import time
from typing import Annotated, Any, assert_never

import structlog
from litestar import Controller, Request, Response, get, post
from litestar.datastructures import ResponseHeader
from litestar.di import NamedDependency
from litestar.openapi import ResponseSpec
from litestar.params import FromPath, HeaderParameter, JSONBody, QueryParameter
from opentelemetry.trace import Span
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.cancellation import CANCEL_WAIT_SECONDS, interrupt
from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.litestar_compat import EventStream
from fleet_gateway.quotas import counted_refusal, over_active_turns
from fleet_gateway.routes.programs import checked_program
from fleet_gateway.routes.sessions import load_session
from fleet_gateway.routes.webhooks import checked_target
from fleet_gateway.schemas import MAX_INT32, TurnAccepted, TurnPage, TurnRequest, UIMessage
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import SSE_HEADERS, RunView, iso, stream_run
from fleet_shared.config_file import QuotaLimits
from fleet_shared.db import claims, queries, runs, scoped, skills
from fleet_shared.db.models import Attachment, Run, Skill
from fleet_shared.followups import start_promoted
from fleet_shared.ids import parse_uuid
from fleet_shared.run_state import RunStatus, is_terminal
from fleet_shared.skills import SKILL_ID
from fleet_shared.tenancy import Principal
from fleet_shared.tracing import child_span, inbound, traceparent_of

log = structlog.get_logger(__name__)
TURN_STREAM_DESCRIPTION = (
    "The Turn as an AI SDK UI message stream v1 (`x-vercel-ai-ui-message-stream: v1`): frames "
    "`id: <seq>.<k>` (control frames `<seq>.<k>.<n>`) + `data: <one JSON chunk>`: optional "
    "`data-status` heartbeats, one `start` (messageId = the Run id), the body "
    "(`start-step`/`finish-step`, `reasoning-*`, `tool-input-start`/`tool-input-delta`/"
    "`tool-input-available`/`tool-input-error`, `tool-output-available`/`tool-output-error`, "
    "`text-*`, `data-skill`, "
    "`data-attachment`, `data-artifact`, `data-child-progress`, `data-approval`, `data-warning`, "
    "`data-usage`), one "
    "terminal (`finish`, `error` + `finish`, or `abort`), then `data: [DONE]`. docs/api.md has "
    "every field."
)

# Never refused: a malformed one is ignored, as W3C Trace Context asks (fleet_shared.tracing).
TraceParent = Annotated[
    str | None,
    HeaderParameter(
        name="traceparent",
        required=False,
        description="W3C trace context of the caller's span; with tracing on, the Turn's trace links "
        "to it (or continues it, with observability.tracing.trust_inbound_context)",
    ),
]
Prefer = Annotated[
    str | None,
    HeaderParameter(
        name="Prefer",
        required=False,
        description="`respond-async` (RFC 7240): answer 202 with the Run's id and `Location`, and no "
        "stream; the stream stays at `GET /api/runs/{id}/stream`",
    ),
]
# Litestar validates it (a 422 `validation_error` in the envelope): 1-128 printable ASCII
# characters, not all of them spaces.
IdempotencyKey = Annotated[
    str,
    HeaderParameter(
        name="Idempotency-Key",
        required=True,
        min_length=1,
        max_length=128,
        pattern=r"^[ -~]*[!-~][ -~]*$",
        description="1-128 printable ASCII characters; the same key and body replays the same Run",
    ),
]


async def check_attachments(
    db: AsyncSession, data: TurnRequest, limit: int, caller: Principal
) -> list[Attachment]:
    """The Turn's attachments, each the caller's own, none twice: checked before the stream
    opens. Another user's or tenant's attachment is as unknown as a made-up id."""
    ids = [str(i) for i in data.attachment_ids]
    if len(ids) > limit:
        raise ApiError(422, "validation_error", f"attachment_ids: at most {limit} per Turn")
    if len(set(ids)) != len(ids):
        raise ApiError(422, "validation_error", "attachment_ids: an attachment is listed twice")
    found = await scoped.get_attachments(db, ids, caller)
    known = {a.id for a in found}
    for attachment_id in ids:
        if attachment_id not in known:
            raise ApiError(422, "validation_error", f"attachment_ids: unknown attachment {attachment_id}")
    return found


async def check_skills(db: AsyncSession, data: TurnRequest) -> list[Skill]:
    """The selected skills, each known, none twice, each at the version the client expects (when
    it says one): checked before the stream opens, so a refusal leaves no Run behind."""
    ids = [selection.id for selection in data.skill_selections]
    for skill_id in ids:
        if ids.count(skill_id) > 1:
            raise invalid_skill(f"skill {skill_id!r} is selected twice")
    well_formed = [skill_id for skill_id in ids if SKILL_ID.fullmatch(skill_id)]  # others name none
    found = {skill.id: skill for skill in await skills.get_skills(db, well_formed)}
    for selection in data.skill_selections:
        skill = found.get(selection.id)
        if skill is None:
            raise invalid_skill(f"unknown skill {selection.id!r}")
        if selection.expected_version is not None and selection.expected_version != skill.version:
            raise invalid_skill(
                f"skill {selection.id!r} is at version {skill.version!r}, "
                f"not {selection.expected_version!r}: read it again and retry"
            )
    return [found[skill_id] for skill_id in ids]


def invalid_skill(problem: str) -> ApiError:
    return ApiError(422, "invalid_skill_selection", f"skill_selections: {problem}")


def check_request(data: TurnRequest, max_text_chars: int) -> None:
    if len(data.text) > max_text_chars:
        raise ApiError(422, "validation_error", f"text: at most {max_text_chars} characters")


class TurnController(Controller):
    path = "/api/sessions/{session_id:str}/turns"

    @post(
        "/",
        status_code=200,
        media_type="text/event-stream",
        response_description=TURN_STREAM_DESCRIPTION,
        response_headers=[
            ResponseHeader(name="X-Fleet-Run-ID", description="the Run's UUID", documentation_only=True),
            ResponseHeader(
                name="Server-Timing",
                description="where the time before the stream went: `claim;dur=<ms>` (the DB) and, "
                "for a new Run, `enqueue;dur=<ms>` (Redis)",
                documentation_only=True,
            ),
        ],
        responses={
            202: ResponseSpec(
                data_container=TurnAccepted,
                generate_examples=False,
                description="with `Prefer: respond-async`: the Turn was accepted (or, with a key already "
                "used, is the Run it made); no stream. `Location` names the Run (`/api/runs/{id}`), as "
                "does `X-Fleet-Run-ID`.",
            )
        },
    )
    async def submit_turn(
        self,
        *,
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        session_id: FromPath[str],
        data: JSONBody[TurnRequest],
        idempotency_key: IdempotencyKey,
        traceparent: TraceParent = None,
        request: Request[Any, Any, Any],
        prefer: Prefer = None,  # documented here; every Prefer line is read from the request
    ) -> EventStream | Response[TurnAccepted]:
        key = idempotency_key
        check_request(data, gw.settings.profile.gateway.limits.max_text_chars)
        webhook_url = checked_target(gw.settings, data.webhook)
        # Plain strings from here on: a lost race rolls the DB session back, expiring ORM objects.
        canonical = parse_uuid(session_id)
        if canonical is None:
            raise not_found("session")
        attachments: list[Attachment] = []
        selected: list[Skill] = []
        if data.attachment_ids or data.skill_selections:
            # An unknown session is a 404 before its attachments or skills are looked at. Without
            # them, the claim's own read finds the session: no ORM session at all before the
            # stream, whose first byte would wait for one to be made and closed (ADR 0015).
            async with gw.db_sessions() as db:
                canonical = (await load_session(db, canonical, caller, write=True)).id
                limit = gw.settings.profile.storage.max_attachments_per_turn
                attachments = await check_attachments(db, data, limit, caller)
                selected = await check_skills(db, data)
        program_version = await checked_program(gw, caller, data.program_version)
        session_id = canonical
        limits = gw.settings.profile.quotas.of(caller.tenant)
        gateway_limits = gw.settings.profile.gateway.limits
        attributes = {"fleet.session_id": session_id, "fleet.tenant": caller.tenant}
        trusted = gw.settings.profile.observability.tracing.trust_inbound_context
        parent, links = inbound(traceparent, trusted)
        with child_span("turn.submit", parent, links, **attributes) as submit:
            started = time.perf_counter()
            claim = functools.partial(
                claims.claim_turn,
                gw.engine,
                session_id=session_id,
                idempotency_key=key,
                fingerprint=hashlib.sha256(data.fingerprint_bytes()).hexdigest(),
                text=data.text,
                model=gw.settings.root_lm.name,
                caller=caller,
                active_limit=limits.active_turns,
                attachments=attachments,
                skills=selected,
                traceparent=traceparent_of(submit),
                waiting_limit=gateway_limits.max_waiting_turns if data.multitask == "enqueue" else 0,
                webhook_url=webhook_url,
                approval=data.approval,
                program_version_id=program_version,
            )
            with child_span("turn.claim", submit):
                outcome = await claim()
            timing = f"claim;dur={(time.perf_counter() - started) * 1000:.3f}"
            running = to_interrupt(outcome, data)
            if running is not None:  # `multitask: interrupt`
                began = time.perf_counter()
                await interrupted(gw, submit, running, caller.tenant, limits)
                timing += f", interrupt;dur={(time.perf_counter() - began) * 1000:.3f}"
                with child_span("turn.claim", submit):
                    outcome = await claim()  # the interrupted Run has ended: this one's turn
            if isinstance(outcome, claims.ClaimRefused):
                submit.set_attribute("fleet.refused", outcome.reason)
                raise refusal(outcome, limits)
            run = outcome.run
            submit.set_attributes({"fleet.run_id": run.id, "fleet.replayed": not outcome.created})
            structlog.contextvars.bind_contextvars(run_id=run.id, session_id=session_id)
            if outcome.created:
                timing += await start(gw, submit, run, caller.tenant, limits)
        if responds_async(request.headers.getall("prefer", [])):
            accepted = TurnAccepted(
                run_id=run.id,
                session_id=session_id,
                status=run.status,
                ahead=outcome.ahead,
                replayed=not outcome.created,
            )
            headers = {
                "Location": f"/api/runs/{run.id}",
                "Preference-Applied": "respond-async",
                "X-Fleet-Run-ID": run.id,
                "Server-Timing": timing,
            }
            return Response(accepted, status_code=202, headers=headers, media_type="application/json")
        settled = is_terminal(run.status)  # a replayed settled Run
        body = stream_run(
            gw.stream_deps,
            RunView.of(run),
            delivery="replay" if settled and not outcome.created else "live",
            idempotent_replay=not outcome.created,
            from_db=settled,
            fresh=outcome.created,
        )
        return EventStream(
            body,
            media_type="text/event-stream",
            headers={**SSE_HEADERS, "X-Fleet-Run-ID": run.id, "Server-Timing": timing},
        )

    @get("/")
    async def list_turns(
        self,
        *,
        db: NamedDependency[AsyncSession],
        caller: NamedDependency[Principal],
        session_id: FromPath[str],
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 100,
        after_sequence: Annotated[int, QueryParameter(ge=0, le=MAX_INT32)] = 0,
    ) -> TurnPage:
        session = await load_session(db, session_id, caller)
        rows = await queries.list_turns(db, session.id, after_sequence=after_sequence, limit=limit)
        ended = [t.run_id for t in rows if t.role == "assistant" and t.status != "completed"]
        failures = (
            {r.id: (r.failure_code, r.failure_message) for r in await runs.get_runs(db, ended)}
            if ended
            else {}
        )
        items = [
            UIMessage.of(
                turn,
                iso,
                failures.get(turn.run_id, (None, None)) if turn.role == "assistant" else (None, None),
            )
            for turn in rows
        ]
        more = len(rows) == limit
        return TurnPage(items, rows[-1].sequence if more and rows else None)


async def start(gw: GatewayState, submit: Span, run: Run, tenant: str, limits: QuotaLimits) -> str:
    """A new Run counted against the tenant's quotas, then its job queued, unless it waits behind
    the session's running Turn (its job is queued when it is promoted). Its Server-Timing entry."""
    claimed = time.perf_counter()
    log.info("turn.claimed", status=run.status)
    if limits.turns_per_minute or limits.lm_tokens_per_day:
        await within_counted_quotas(gw, run, tenant, limits)
    if run.status != RunStatus.QUEUED.value:
        return ""
    with child_span("turn.enqueue", submit):
        await enqueue(gw, run)
    return f", enqueue;dur={(time.perf_counter() - claimed) * 1000:.3f}"


def to_interrupt(outcome: claims.Claimed | claims.ClaimRefused, data: TurnRequest) -> str | None:
    """With `multitask: interrupt`, the session's running Turn that refused this one."""
    if data.multitask != "interrupt" or not isinstance(outcome, claims.ClaimRefused):
        return None
    return outcome.run_id if outcome.reason == "turn_in_progress" else None


async def interrupted(gw: GatewayState, submit: Span, run_id: str, tenant: str, limits: QuotaLimits) -> None:
    """`multitask: interrupt`: unless this Turn would be refused by the tenant's counted quotas
    (then the running one is left alone), the running Turn is cancelled (its abort and tombstone
    as any cancel's); 409 if it did not end in time for this one."""
    with child_span("turn.interrupt", submit, None, **{"fleet.interrupted_run_id": run_id}) as span:
        try:
            refused = await counted_refusal(gw.redis, tenant, limits, count=False)
            if refused is not None:
                raise refused
            ended = await interrupt(gw, run_id)
        except (RedisError, OSError):
            raise redis_down("started (the running Turn could not be interrupted)") from None
        span.set_attribute("fleet.interrupt_ended", ended)
    log.info("turn.interrupted", interrupted_run_id=run_id, ended=ended)
    if not ended:
        message = (
            f"the running Turn was asked to stop but had not ended within {CANCEL_WAIT_SECONDS:g} s; "
            "send this Turn again (the same key is safe)"
        )
        raise ApiError(409, "turn_in_progress", message, **{"Retry-After": "2"})


def responds_async(prefers: list[str]) -> bool:
    """Whether the `Prefer` headers ask for `respond-async` (each a comma-separated list, and
    unknown preferences ignored: RFC 7240)."""
    parts = (part for prefer in prefers for part in prefer.split(","))
    return any(part.split(";", 1)[0].split("=", 1)[0].strip().lower() == "respond-async" for part in parts)


def refusal(outcome: claims.ClaimRefused, limits: QuotaLimits) -> ApiError:
    match outcome.reason:
        case "unknown_session":
            return not_found("session")
        case "turn_in_progress":
            return ApiError(409, "turn_in_progress", "a Turn is already running in this session")
        case "session_archived":
            return ApiError(
                409, "session_archived", "this session is archived: set its status to active to continue"
            )
        case "active_turns_quota":
            return over_active_turns(limits)
        case "queue_full":
            message = "this session's line of waiting Turns is full: wait for one to start, or interrupt"
            return ApiError(409, "queue_full", message)
        case "idempotency_key_mismatch":
            return ApiError(
                409,
                "idempotency_key_mismatch",
                "this Idempotency-Key was already used with a different request body",
            )
        case _:
            assert_never(outcome.reason)


async def within_counted_quotas(gw: GatewayState, run: Run, tenant: str, limits: QuotaLimits) -> None:
    """The tenant's quotas kept in Redis, for the new Turn; over one, or with Redis down, it is
    withdrawn."""
    try:
        refused = await counted_refusal(gw.redis, tenant, limits)
    except (RedisError, OSError) as exc:
        log.warning("turn.quota_unavailable", error_type=type(exc).__name__)
        if await withdraw(gw, run):
            raise ApiError(
                503, "service_unavailable", "the Turn could not be counted (Redis is unavailable); retry"
            ) from None
        return
    if refused is not None and await withdraw(gw, run):
        raise refused


async def enqueue(gw: GatewayState, run: Run) -> None:
    """Queue the job (job id = run id). If Redis refuses, withdraw the claim and answer 503: nothing
    stays committed, and the same Idempotency-Key works once Redis is back."""
    try:
        await gw.jobs.enqueue(run.id)
        return
    except (RedisError, OSError) as exc:
        log.warning("turn.enqueue_failed", error_type=type(exc).__name__)
    if await withdraw(gw, run):
        raise ApiError(
            503, "service_unavailable", "the Turn could not be queued (Redis is unavailable); retry"
        )


def redis_down(step: str) -> ApiError:
    return ApiError(503, "service_unavailable", f"the Turn could not be {step} (Redis is unavailable); retry")


async def withdraw(gw: GatewayState, run: Run) -> bool:
    """The claim undone (the key works again); false when it must be streamed after all."""
    try:
        async with gw.db_sessions() as db:
            withdrawn = await claims.withdraw_claim(db, run.id)
        if withdrawn:  # a follow-up that waited behind it is first now (Redis down: the sweep's)
            await start_promoted(gw.db_sessions, gw.jobs, run.session_id)
        return withdrawn  # false: a sweeper enqueued it, a worker started it
    except Exception as exc:
        # The DB is failing too: the Run stays queued, a sweeper enqueues it once Redis is back,
        # and a retry with the same key attaches to it.
        log.warning("turn.withdraw_failed", error_type=type(exc).__name__)
        return True
