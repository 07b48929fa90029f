"""The error envelope `{code, message}` and the handlers that map every failure onto it."""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from typing import Any

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

log = structlog.get_logger(__name__)

STATUS_CODES = {
    400: "bad_request",
    401: "auth_required",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "rate_limited",
    431: "headers_too_large",
    503: "service_unavailable",
}


class ApiError(HTTPException):
    """A failure with a documented code; raised by routes and services."""

    def __init__(self, status_code: int, code: str, message: str, **headers: str) -> None:
        super().__init__(status_code=status_code, detail=message, headers=headers or None)
        self.code = code
        self.message = message


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} not found")


def envelope(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response[Any]:
    return Response({"code": code, "message": message}, status_code=status, headers=headers)


def handle_api_error(_request: Request[Any, Any, Any], exc: ApiError) -> Response[Any]:
    return envelope(exc.status_code, exc.code, exc.message, exc.headers)


def handle_validation(_request: Request[Any, Any, Any], exc: ValidationException) -> Response[Any]:
    return envelope(422, "validation_error", describe_validation(exc))


# Litestar reports a header by its Python parameter name; clients know the header's.
HEADER_PARAMETERS = {"idempotency_key": "Idempotency-Key"}
# msgspec's words for a field the body's type does not have, with where it sits ("$.a[0]").
UNKNOWN_FIELD = re.compile(
    r"Object contains unknown field `(?P<name>[^`]+)`(?: - at `\$\.?(?P<path>[^`]*)`)?"
)


def shown_name(key: str) -> str:
    return HEADER_PARAMETERS.get(key, key)


def describe_validation(exc: ValidationException) -> str:
    extra = exc.extra if isinstance(exc.extra, list) else []
    details = [
        describe_problem(item.get("key") or item.get("source") or "body", str(item.get("message")))
        for item in extra
        if isinstance(item, dict) and item.get("message")
    ]
    if details:
        return "; ".join(details)
    if "decoding" in str(exc.detail).lower() or "json" in str(exc.detail).lower():
        return "the request body is not valid JSON"
    return str(exc.detail)


def describe_problem(key: str, message: str) -> str:
    unknown = UNKNOWN_FIELD.fullmatch(message)
    if unknown is None:
        return f"{shown_name(key)}: {message}"
    field = ".".join(part for part in (unknown["path"], unknown["name"]) if part)
    return f"the request body has a field this endpoint does not take: `{field}`"


def handle_http(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    if isinstance(exc.__cause__, SerializationException):  # the body could not be decoded at all
        return envelope(422, "validation_error", f"the request body is not valid JSON: {exc.detail}")
    code = STATUS_CODES.get(status, "error")
    message = str(exc.detail) if exc.detail else code.replace("_", " ")
    if status == 413:
        limit = request.route_handler.resolve_request_max_body_size()
        message = (
            f"the request body is over the limit of {limit} bytes"
            if limit
            else "the request body is too large"
        )
    return envelope(status, code, message, exc.headers)


def handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    log.error("request.failed", path=request.url.path, error_type=type(exc).__name__, exc_info=exc)
    return envelope(
        HTTP_500_INTERNAL_SERVER_ERROR,
        "internal_error",
        "an internal error occurred; see the server log",
    )


Handler = Callable[[Request[Any, Any, Any], Any], Response[Any]]


def releasing(handler: Handler) -> Handler:
    """The handler, then the failure's finished frames cleared of their locals.

    Litestar throws a handler's exception into the generator dependencies (the database
    session), and the frame that does so keeps it as a local: exception -> traceback -> frame ->
    exception. Left to the cyclic collector, that cycle holds the request; Granian keeps a
    connection whose body was not read open while the request lives, so an upload answered 408
    would keep its socket on a quiet gateway. Frames still running are left as they are."""

    def handle(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        try:
            return handler(request, exc)
        finally:
            release_frames(exc)

    return handle


def release_frames(exc: BaseException) -> None:
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]


EXCEPTION_HANDLERS: dict[Any, Any] = {
    ApiError: releasing(handle_api_error),
    ValidationException: releasing(handle_validation),
    HTTPException: releasing(handle_http),
    Exception: releasing(handle_unexpected),
}
