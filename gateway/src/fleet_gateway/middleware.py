"""Request ids: every response gets `x-request-id`; matched requests bind it into the log context."""

from __future__ import annotations

import re
import uuid

import structlog
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
SAFE_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


def request_id_of(scope: Scope) -> str:
    """The caller's id when it is safe to echo, else a new one; stored once per request."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        incoming = dict(scope.get("headers", [])).get(REQUEST_ID_HEADER, b"")
        state["request_id"] = incoming.decode() if SAFE_REQUEST_ID.match(incoming) else uuid.uuid4().hex
    return str(state["request_id"])


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        with structlog.contextvars.bound_contextvars(request_id=request_id_of(scope)):
            await app(scope, receive, send)

    return middleware


async def add_request_id_header(message: Message, scope: Scope) -> None:
    """A before_send hook, so unmatched routes (404/405) get the header too."""
    if message["type"] == "http.response.start":
        headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
        headers.append((REQUEST_ID_HEADER, request_id_of(scope).encode()))
        message["headers"] = headers
