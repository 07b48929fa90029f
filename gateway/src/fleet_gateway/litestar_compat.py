"""The private names of Litestar that fleet uses, pinned to litestar 2.25 (gateway/pyproject.toml)
and checked by `tests/unit/gateway/test_litestar_compat.py`: `ASGIStreamingResponse._stream`,
overridden, and `Stream.to_asgi_response`, rebuilt with another response class.

The SSE response: its body chunks go straight to the server's `send`.

Litestar wraps the server's `send` for every message of every response: the exception
middleware's wrapper (it notes when the response started) and the app's `before_send` hooks
(the request id and the response counter, `fleet_gateway.middleware`, `fleet_gateway.metrics`).
All of them act on `http.response.start` only, yet a Turn stream sends one body message per
wake-up, so with many streams they are a share of the gateway's CPU per delivered event that
buys nothing (ADR 0030).

`with_direct_send` (what Granian serves) leaves the server's own `send` in the request's scope;
`EventStream` sends its start and its last message through Litestar's wrapped `send`, as any
response does, and the chunks in between through the server's. Where no server put it there
(Litestar's test client), every message takes the wrapped `send`.

So a wrapper that needs a response's body messages (compression, a response cache, a body
logger) would not see a stream's chunks: `with_direct_send` refuses an app that compresses, and
anything of the kind added later must leave the Turn streams out.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any, cast

from litestar import Litestar, Request
from litestar.background_tasks import BackgroundTask, BackgroundTasks
from litestar.datastructures import Cookie
from litestar.enums import MediaType, ScopeType
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import ASGIApp, HTTPResponseBodyEvent, Receive, Scope, Send, TypeEncodersMap
from litestar.utils.helpers import get_enum_string_value

DIRECT_SEND = "fleet.direct_send"  # the scope key of the server's own send
ITERABLES = (Iterable, Iterator, AsyncIterable, AsyncIterator)
END: HTTPResponseBodyEvent = {"type": "http.response.body", "body": b"", "more_body": False}


def with_direct_send(app: Litestar) -> ASGIApp:
    """The app, with the server's `send` left in each HTTP request's scope for `EventStream`.

    Refused for an app that compresses responses: Litestar's compression holds a response's
    start back until its first body message passes its wrapper, and a stream's chunks no longer
    do. (A middleware added later that needs every body message has the same problem; the
    module's docstring and ADR 0030 say so.)"""
    if app.compression_config is not None:
        raise ValueError("with_direct_send: the app compresses responses, and EventStream's chunks skip that")

    async def direct_send_scope(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP:
            scope[DIRECT_SEND] = send  # type: ignore[literal-required]
        await app(scope, receive, send)

    return direct_send_scope


class DirectStreamingResponse(ASGIStreamingResponse):
    """Litestar's streaming response, with its body chunks sent by the server's `send`."""

    __slots__ = ("direct_send",)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.direct_send = cast("Send | None", scope.get(DIRECT_SEND))
        await super().__call__(scope, receive, send)

    async def _stream(self, send: Send) -> None:
        direct = self.direct_send or send
        async for chunk in self.iterator:
            body = chunk if isinstance(chunk, bytes) else chunk.encode(self.encoding)
            await direct({"type": "http.response.body", "body": body, "more_body": True})
        await send(END)  # the end passes the app's wrappers, as the start did


class EventStream(Stream):
    """A `Stream` whose ASGI response is a `DirectStreamingResponse`; otherwise the same."""

    def to_asgi_response(
        self,
        app: Litestar | None,
        request: Request[Any, Any, Any],
        *,
        background: BackgroundTask | BackgroundTasks | None = None,
        cookies: Iterable[Cookie] | None = None,
        encoded_headers: Iterable[tuple[bytes, bytes]] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: MediaType | str | None = None,
        status_code: int | None = None,
        type_encoders: TypeEncodersMap | None = None,
    ) -> ASGIResponse:
        # As Stream.to_asgi_response builds its response, with this class instead.
        merged = {**headers, **self.headers} if headers is not None else self.headers
        iterator = self.iterator
        if not isinstance(iterator, ITERABLES) and callable(iterator):
            iterator = iterator()
        return DirectStreamingResponse(
            background=self.background or background,
            content_length=0,
            cookies=self.cookies if cookies is None else itertools.chain(self.cookies, cookies),
            encoded_headers=encoded_headers,
            encoding=self.encoding,
            headers=merged,
            is_head_response=is_head_response,
            iterator=iterator,
            media_type=get_enum_string_value(media_type or self.media_type or MediaType.JSON),
            status_code=self.status_code or status_code,
        )
