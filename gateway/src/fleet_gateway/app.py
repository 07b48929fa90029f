"""The Litestar app factory: lifespan resources, DI, routes, error envelope, auth."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from arq.connections import ArqRedis
from litestar import Litestar, Request, Router
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide
from litestar.handlers.base import BaseRouteHandler
from redis.asyncio import ConnectionPool
from redis.exceptions import RedisError
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.errors import EXCEPTION_HANDLERS, ApiError, envelope
from fleet_gateway.fanout import EventFanout
from fleet_gateway.middleware import add_request_id_header, request_id_middleware
from fleet_gateway.routes.health import health, ready
from fleet_gateway.routes.sessions import SessionController
from fleet_gateway.routes.turns import TurnController
from fleet_gateway.state import GatewayState
from fleet_shared.config import Settings
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.queue import deserialize_job, serialize_job

log = structlog.get_logger(__name__)


def create_app(settings: Settings) -> Litestar:
    holder: dict[str, GatewayState] = {}

    @asynccontextmanager
    async def resources(_app: Litestar) -> AsyncIterator[None]:
        engine = create_engine(settings.database_url)
        arq = ArqRedis(
            ConnectionPool.from_url(settings.redis_url, socket_connect_timeout=5),
            job_serializer=serialize_job,
            job_deserializer=deserialize_job,
            default_queue_name=settings.profile.worker.queue_name,
        )
        fanout = EventFanout(arq)
        await fanout.start()
        holder["state"] = GatewayState(settings, engine, session_factory(engine), arq, fanout)
        try:
            yield
        finally:
            await fanout.stop()
            await arq.aclose()
            await engine.dispose()

    def provide_state() -> GatewayState:
        return holder["state"]

    async def provide_db(gw: NamedDependency[GatewayState]) -> AsyncIterator[AsyncSession]:
        async with gw.sessions() as session:
            yield session

    api = Router(
        path="/",
        route_handlers=[SessionController, TurnController],
        guards=[require_token(settings)],
    )
    return Litestar(
        route_handlers=[health, ready, api],
        lifespan=[resources],
        dependencies={
            "gw": Provide(provide_state, sync_to_thread=False),
            "db": Provide(provide_db),
        },
        exception_handlers={
            **EXCEPTION_HANDLERS,
            # Only "cannot reach it" is a 503 (retry); anything else from the DB is a logged 500.
            OperationalError: dependency_down("the database"),
            InterfaceError: dependency_down("the database"),
            DataError: bad_value,
            RedisError: dependency_down("Redis"),
        },
        middleware=[request_id_middleware],
        before_send=[add_request_id_header],
        request_max_body_size=settings.profile.gateway.limits.max_body_bytes,
        openapi_config=None,
        logging_config=None,  # structlog (configure_logging) owns logging in every process
    )


def dependency_down(what: str) -> Any:
    def handler(request: Request[Any, Any, Any], exc: Exception) -> Any:
        log.warning(
            "dependency.unavailable", dependency=what, path=request.url.path, error_type=type(exc).__name__
        )
        return envelope(503, "service_unavailable", f"{what} is unavailable; retry shortly")

    return handler


def bad_value(request: Request[Any, Any, Any], exc: DataError) -> Any:
    log.info("request.bad_value", path=request.url.path, error_type=type(exc.orig).__name__)
    return envelope(422, "validation_error", "a value is out of range or not representable")


def require_token(settings: Settings) -> Any:
    """Bearer auth when FLEET_API_TOKEN is set, compared in constant time."""

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _handler: BaseRouteHandler) -> None:
        if settings.api_token is None:
            return
        header = connection.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        expected = settings.api_token.reveal().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise ApiError(
                401,
                "auth_required",
                "a valid bearer token is required",
                **{"WWW-Authenticate": "Bearer"},
            )

    return guard
