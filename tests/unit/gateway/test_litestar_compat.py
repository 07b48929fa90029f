"""The SSE response: behind `with_direct_send` (as Granian serves the gateway), a stream's body
chunks go to the server's `send` and skip the app's send wrappers; its start (with the hooks'
headers) and its end still pass them. Without it (Litestar's test client), every message does.
The app here is a real Litestar app driven at the ASGI boundary."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from litestar import Litestar, get

from fleet_gateway.litestar_compat import EventStream, with_direct_send

CHUNKS = [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"]


def build_app(wrapped: list[dict[str, Any]]) -> Litestar:
    async def frames() -> AsyncIterator[bytes]:
        for chunk in CHUNKS:
            yield chunk

    @get("/stream")
    async def stream() -> EventStream:
        return EventStream(frames(), media_type="text/event-stream")

    async def hook(message: Any, scope: Any) -> None:
        wrapped.append(dict(message))
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), (b"x-hook", b"seen")]

    return Litestar([stream], before_send=[hook], openapi_config=None)


async def call(app: Any) -> list[dict[str, Any]]:
    """GET /stream at the ASGI boundary: what the server's `send` received."""
    sent: list[dict[str, Any]] = []
    ended = asyncio.Event()

    async def send(message: Any) -> None:
        sent.append(dict(message))
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            ended.set()

    async def receive() -> dict[str, Any]:
        await ended.wait()  # the client hangs up once the response ended
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": "/stream", "raw_path": b"/stream", "root_path": "",
             "query_string": b"", "headers": [], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


def bodies(messages: list[dict[str, Any]]) -> list[bytes]:
    return [m["body"] for m in messages if m["type"] == "http.response.body"]


async def test_behind_with_direct_send_the_chunks_skip_the_send_wrappers() -> None:
    wrapped: list[dict[str, Any]] = []
    sent = await call(with_direct_send(build_app(wrapped)))
    start = sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"x-hook", b"seen") in start["headers"]  # the start passed the hooks
    assert bodies(sent) == [*CHUNKS, b""]  # every chunk reached the server, in order, then the end
    assert sent[-1]["more_body"] is False
    # The hooks saw the start and the end, and none of the chunks.
    assert [m["type"] for m in wrapped] == ["http.response.start", "http.response.body"]
    assert bodies(wrapped) == [b""]


async def test_without_it_every_message_passes_the_send_wrappers() -> None:
    wrapped: list[dict[str, Any]] = []
    sent = await call(build_app(wrapped))
    assert bodies(sent) == [*CHUNKS, b""]
    assert bodies(wrapped) == [*CHUNKS, b""]


def test_an_app_that_compresses_responses_is_refused() -> None:
    # Litestar's compression holds the start back until the first body message passes it.
    from litestar.config.compression import CompressionConfig

    app = Litestar([], compression_config=CompressionConfig(backend="gzip"), openapi_config=None)
    with pytest.raises(ValueError, match="compresses"):
        with_direct_send(app)


def test_the_private_names_litestar_compat_overrides_are_still_litestar_s() -> None:
    """An upgrade that renames `_stream` or changes `to_asgi_response` fails here, not in a stream."""
    import inspect

    from litestar.response import Stream
    from litestar.response.streaming import ASGIStreamingResponse

    from fleet_gateway.litestar_compat import DirectStreamingResponse

    assert inspect.iscoroutinefunction(ASGIStreamingResponse._stream)
    assert list(inspect.signature(ASGIStreamingResponse._stream).parameters) == ["self", "send"]
    ours = inspect.signature(EventStream.to_asgi_response).parameters
    assert list(inspect.signature(Stream.to_asgi_response).parameters) == list(ours)
    assert "iterator" in ASGIStreamingResponse.__slots__
    assert "direct_send" in DirectStreamingResponse.__slots__
