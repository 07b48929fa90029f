"""ASGI middleware: an `x-request-id` on every response, bound into the log context."""

from __future__ import annotations

import re
import uuid

import structlog
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
SAFE_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        incoming = dict(scope.get("headers", [])).get(REQUEST_ID_HEADER, b"")
        request_id = incoming if SAFE_REQUEST_ID.match(incoming) else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, request_id))
                message["headers"] = headers
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id.decode()):
            await app(scope, receive, send_with_id)

    return middleware
