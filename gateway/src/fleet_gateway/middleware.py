"""Request ids (every response gets `x-request-id`; matched requests bind it into the log
context), and the API's content-type rule."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import structlog
from litestar import Request
from litestar.enums import ScopeType
from litestar.types import ASGIApp, HTTPResponseStartEvent, Message, Receive, Scope, Send

from fleet_gateway.errors import ApiError

REQUEST_ID_HEADER = b"x-request-id"
SAFE_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


def request_id_of(scope: Scope) -> str:
    """The caller's id when it is safe to echo, else a new one; stored once per request."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        incoming = dict(scope.get("headers", [])).get(REQUEST_ID_HEADER, b"")
        state["request_id"] = incoming.decode() if SAFE_REQUEST_ID.match(incoming) else uuid.uuid4().hex
    return str(state["request_id"])


def header_limit_middleware(limit: int) -> Callable[[ASGIApp], ASGIApp]:
    """Requests whose headers together pass `gateway.limits.max_header_bytes` get 431 in the
    envelope, before the handler reads anything (an unknown route is a 404 first)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == ScopeType.HTTP:
                size = sum(len(name) + len(value) + 4 for name, value in scope.get("headers", []))
                if size > limit:
                    await send_envelope(
                        send, scope, 431, "headers_too_large", f"the request headers are over {limit} bytes"
                    )
                    return
            await app(scope, receive, send)

        return middleware

    return wrap


async def send_envelope(send: Send, scope: Scope, status: int, code: str, message: str) -> None:
    body = json.dumps({"code": code, "message": message}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (REQUEST_ID_HEADER, request_id_of(scope).encode()),
    ]
    start: HTTPResponseStartEvent = {"type": "http.response.start", "status": status, "headers": headers}
    await send(start)
    await send({"type": "http.response.body", "body": body, "more_body": False})


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


JSON_MEDIA_TYPES = ("application/json",)
MULTIPART_PATHS = ("/api/attachments",)  # the one route whose body is a multipart upload


async def require_json_body(request: Request[Any, Any, Any]) -> None:
    """A before_request hook of the API router: a body sent as anything but JSON is a 415 in the
    envelope (not a confusing "not valid JSON" 422). No content-type is taken as JSON."""
    if request.method not in ("POST", "PUT", "PATCH") or request.url.path in MULTIPART_PATHS:
        return
    if request.headers.get("content-length") == "0":  # no body (`curl -X PUT -d ''`, `fetch` with "")
        return
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type in JSON_MEDIA_TYPES or media_type.endswith("+json"):
        return
    raise ApiError(415, "unsupported_media_type", f"send the body as application/json, not {media_type!r}")
