"""Who is calling (`gateway.auth.mode`, docs/security.md): a bearer credential becomes a
Principal (fleet_shared.tenancy), or the request is a 401 before any route runs."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Protocol

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from fleet_gateway.errors import ApiError
from fleet_shared.tenancy import OPERATOR, Principal

PRINCIPAL_STATE = "principal"


class Authenticator(Protocol):
    async def principal(self, token: str | None) -> Principal:
        """The caller, or an ApiError 401 (503 when what vouches for tokens is down)."""
        ...


def refused(reason: str) -> ApiError:
    return ApiError(401, "auth_required", reason, **{"WWW-Authenticate": "Bearer"})


class SingleToken:
    """`mode = "token"`: one shared token, compared in constant time; none set, no check."""

    def __init__(self, expected: bytes | None) -> None:
        self.expected = expected

    async def principal(self, token: str | None) -> Principal:
        if self.expected is None:
            return OPERATOR
        if token is None or not hmac.compare_digest(token.encode(), self.expected):
            raise refused("a valid bearer token is required")
        return OPERATOR


class TokenFile:
    """`mode = "tokens"`: each token's sha256 (never the token) bound to a tenant, a user and
    scopes (fleet_shared.tokens_file), read once at start."""

    def __init__(self, by_hash: dict[str, Principal]) -> None:
        self.by_hash = by_hash

    async def principal(self, token: str | None) -> Principal:
        # A dict lookup by the hash: timing can reveal at most a hash's prefix, never the token.
        found = self.by_hash.get(hashlib.sha256(token.encode()).hexdigest()) if token else None
        if found is None:
            raise refused("a valid bearer token is required")
        return found


def bearer_token(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def authenticate(authenticator: Authenticator) -> Any:
    """The API router's guard: every `/api/*` request names its caller before its route runs."""

    # async, like every guard and hook: Litestar runs a sync one in a thread pool, per request.
    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _handler: BaseRouteHandler) -> None:
        connection.state[PRINCIPAL_STATE] = await authenticator.principal(bearer_token(connection))

    return guard


def provide_caller(request: Request[Any, Any, Any]) -> Principal:
    principal: Principal = request.state[PRINCIPAL_STATE]
    return principal
