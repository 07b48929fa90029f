"""The Litestar app factory: lifespan resources, DI, routes, error envelope, auth."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import structlog
from litestar import Litestar, Request, Router
from litestar.config.cors import CORSConfig
from litestar.di import NamedDependency, Provide
from redis.asyncio import ConnectionPool, Redis
from redis.exceptions import RedisError
from sqlalchemy.exc import DataError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.auth import Authenticator, SingleToken, TokenFile, authenticate, provide_caller
from fleet_gateway.errors import EXCEPTION_HANDLERS, envelope, handle_unexpected
from fleet_gateway.fanout import EventFanout
from fleet_gateway.jwt_auth import JwtVerifier
from fleet_gateway.metrics import count_response
from fleet_gateway.middleware import (
    add_request_id_header,
    header_limit_middleware,
    request_id_middleware,
    require_json_body,
)
from fleet_gateway.openapi import document_errors, openapi_config
from fleet_gateway.origins import RequestPolicy, request_policy_middleware
from fleet_gateway.routes.approvals import ApprovalController
from fleet_gateway.routes.artifacts import ArtifactController
from fleet_gateway.routes.attachments import AttachmentController
from fleet_gateway.routes.feedback import FeedbackController
from fleet_gateway.routes.files import FilesController
from fleet_gateway.routes.health import VERSION, health, ready
from fleet_gateway.routes.metrics import metrics
from fleet_gateway.routes.programs import ProgramController
from fleet_gateway.routes.runs import RunController
from fleet_gateway.routes.sessions import SessionController
from fleet_gateway.routes.settings import SettingsController
from fleet_gateway.routes.skills import SkillController
from fleet_gateway.routes.turns import TurnController
from fleet_gateway.routes.usage import get_usage
from fleet_gateway.routes.webhooks import WebhookController
from fleet_gateway.state import GatewayState
from fleet_gateway.upload_gate import UploadGate
from fleet_shared.blobs import open_blob_store
from fleet_shared.config import Settings
from fleet_shared.db.engine import create_engine, dispose_engine, session_factory
from fleet_shared.db.faults import is_unreachable
from fleet_shared.event_log import RunLog
from fleet_shared.jobs import ArqJobQueue
from fleet_shared.recovery import Sweeper
from fleet_shared.redis_conn import CONNECT_TIMEOUT_SECONDS, RETRY_ON_CONNECTION, listener, retry_policy
from fleet_shared.shutdown import bounded, stop_loop
from fleet_shared.tokens_file import load_tokens
from fleet_shared.tracing import shutdown_tracing
from fleet_shared.webhook_delivery import deliverer_for

log = structlog.get_logger(__name__)
REDIS_RETRIES = 3  # 350 ms: a blip is absorbed; an outage is a quick 503 (clients retry)
REQUEST_REDIS_TIMEOUT_SECONDS = 2.0
SWEEP_INTERVAL_SECONDS = 0.5


def create_app(settings: Settings) -> Litestar:
    holder: dict[str, GatewayState] = {}
    limits = settings.profile.gateway.limits

    @asynccontextmanager
    async def resources(_app: Litestar) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:  # teardown in reverse order
            # Last: the spans of every request that ended are exported before the process goes.
            stack.push_async_callback(
                bounded, "tracing.shutdown", partial(asyncio.to_thread, shutdown_tracing)
            )
            engine = create_engine(settings.database_url)
            stack.push_async_callback(bounded, "database.dispose", partial(dispose_engine, engine))
            redis = request_client(settings)
            stack.push_async_callback(bounded, "redis.requests.close", redis.aclose)
            events, probe = listener(settings.redis_url), probe_client(settings.redis_url)
            stack.push_async_callback(bounded, "redis.events.close", events.aclose)
            stack.push_async_callback(bounded, "redis.probe.close", probe.aclose)
            fanout = EventFanout(events)
            await fanout.start()
            stack.push_async_callback(bounded, "fanout.stop", fanout.stop)
            process_id = f"{socket.gethostname()}:{os.getpid()}"
            state = GatewayState(
                settings=settings,
                engine=engine,
                db_sessions=session_factory(engine),
                redis=redis,
                jobs=ArqJobQueue(redis, settings.profile.worker.queue_name),
                fanout=fanout,
                runlog=RunLog(redis),
                process_id=process_id,
                probe=probe,
                blobs=open_blob_store(settings),
                uploads=UploadGate.of(limits),
            )
            holder["state"] = state
            stack.push_async_callback(bounded, "gateway.background", state.stop_background)
            # Gateways sweep for lost Runs too, so a Run is recovered even when no worker is alive.
            await stack.enter_async_context(sweeping(make_sweeper(state)))
            # Deliveries are rows: any gateway or worker with the secret sends the due ones.
            await stack.enter_async_context(delivering(state))
            yield

    def provide_state() -> GatewayState:
        return holder["state"]

    async def provide_db(gw: NamedDependency[GatewayState]) -> AsyncIterator[AsyncSession]:
        async with gw.db_sessions() as session:
            yield session

    api = Router(
        path="/",
        route_handlers=[
            SessionController,
            TurnController,
            RunController,
            WebhookController,
            ApprovalController,
            AttachmentController,
            ArtifactController,
            FilesController,
            SkillController,
            ProgramController,
            SettingsController,
            FeedbackController,
            get_usage,
        ],
        guards=[authenticate(build_authenticator(settings))],
        before_request=require_json_body,
    )
    return Litestar(
        route_handlers=[health, ready, metrics, api],
        lifespan=[resources],
        dependencies={
            "gw": Provide(provide_state, sync_to_thread=False),
            "db": Provide(provide_db),
            "caller": Provide(provide_caller, sync_to_thread=False),
        },
        exception_handlers={
            **EXCEPTION_HANDLERS,
            # Only "cannot reach it" is a 503 (retry); anything else from the DB is a logged 500.
            SQLAlchemyError: database_error,
            DataError: bad_value,
            RedisError: dependency_down("Redis"),
            OSError: dependency_down("a dependency"),  # e.g. a refused connection, unwrapped
        },
        middleware=[
            request_id_middleware,
            header_limit_middleware(settings.profile.gateway.limits.max_header_bytes),
            request_policy_middleware(RequestPolicy.of(settings)),
        ],
        cors_config=cors_config(settings),
        before_send=[add_request_id_header, count_response],
        request_max_body_size=limits.max_body_bytes,
        openapi_config=openapi_config(VERSION),
        on_startup=[document_errors],
        logging_config=None,  # structlog (configure_logging) owns logging in every process
    )


def cors_config(settings: Settings) -> CORSConfig | None:
    """CORS for the web origins the operator allowed (none by default: no page may call the API)."""
    origins = list(settings.profile.gateway.cors.allowed_origins)
    if not origins:
        return None
    return CORSConfig(
        allow_origins=origins,
        allow_methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
        allow_headers=[
            "authorization",
            "content-type",
            "idempotency-key",
            "last-event-id",
            "x-requested-with",
        ],
        expose_headers=["x-fleet-run-id", "x-request-id", "etag", "content-length"],
    )


def request_client(settings: Settings) -> Redis:
    """Commands for requests: quick to give up on a hung Redis (a 503 the client retries)."""
    pool = ConnectionPool.from_url(
        settings.redis_url,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_timeout=REQUEST_REDIS_TIMEOUT_SECONDS,
        retry=retry_policy(REDIS_RETRIES),
        retry_on_error=list(RETRY_ON_CONNECTION),
    )
    client: Redis = Redis.from_pool(pool)  # its close closes the pool (the job queue shares it)
    return client


def probe_client(url: str) -> Redis:
    """No retries, a short timeout: readiness reports an outage at once."""
    client: Redis = Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    return client


def make_sweeper(state: GatewayState) -> Sweeper:
    return Sweeper(
        db_sessions=state.db_sessions,
        redis=state.redis,
        runlog=state.runlog,
        lease_seconds=state.settings.profile.worker.lease_seconds,
        owner=f"gateway:{state.process_id}",
        jobs=state.jobs,
    )


@asynccontextmanager
async def sweeping(sweeper: Sweeper) -> AsyncIterator[None]:
    """The sweep loop for the app's lifetime; at shutdown it finishes the sweep it is in."""
    task = asyncio.create_task(sweeper.run_forever(SWEEP_INTERVAL_SECONDS), name="fleet-sweep")
    try:
        yield
    finally:
        await stop_loop("sweep", task, sweeper.stopping)


@asynccontextmanager
async def delivering(state: GatewayState) -> AsyncIterator[None]:
    """The webhook delivery loop for the app's lifetime, with FLEET_WEBHOOK_SECRET set."""
    deliverer = deliverer_for(state.settings, state.db_sessions, f"gateway:{state.process_id}")
    if deliverer is None:
        yield
        return
    task = asyncio.create_task(deliverer.run_forever(), name="fleet-webhooks")
    try:
        yield
    finally:
        await stop_loop("webhooks", task, deliverer.stopping)


def dependency_down(what: str) -> Any:
    def handler(request: Request[Any, Any, Any], exc: Exception) -> Any:
        log.warning(
            "dependency.unavailable", dependency=what, path=request.url.path, error_type=type(exc).__name__
        )
        return envelope(503, "service_unavailable", f"{what} is unavailable; retry shortly")

    return handler


def database_error(request: Request[Any, Any, Any], exc: SQLAlchemyError) -> Any:
    if is_unreachable(exc):
        return dependency_down("the database")(request, exc)
    return handle_unexpected(request, exc)


def bad_value(request: Request[Any, Any, Any], exc: DataError) -> Any:
    log.info("request.bad_value", path=request.url.path, error_type=type(exc.orig).__name__)
    return envelope(422, "validation_error", "a value is out of range or not representable")


def build_authenticator(settings: Settings) -> Authenticator:
    """The caller's identity by `gateway.auth.mode` (the file's problems were checked at start)."""
    auth = settings.profile.gateway.auth
    if auth.mode == "tokens":
        assert settings.tokens_file is not None  # load_settings checked it
        return TokenFile(load_tokens(settings.tokens_file))
    if auth.mode == "jwt":
        return JwtVerifier(auth.jwt)
    return SingleToken(settings.api_token.reveal().encode() if settings.api_token else None)
