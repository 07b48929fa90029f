"""What an upload in progress may hold in one gateway process: how long it may send nothing, and
how many one client may have at once.

A client is the socket peer's address, never a forwarded-for header a client could set itself.
Behind a proxy every client is the proxy, so the per-client cap becomes the proxy's cap. The
count lives in this process by nature: it bounds the sockets and temporary files this process
holds, and a deployment of N gateway processes lets one client hold N times as many.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import Any

from litestar import Request

from fleet_gateway.errors import ApiError
from fleet_shared.config import LimitsSection

RETRY_AFTER_SECONDS = "1"
UNKNOWN_PEER = "unknown"  # a Unix socket or a server that does not say: all such share one count


def client_of(request: Request[Any, Any, Any]) -> str:
    client = request.client
    return client.host if client is not None and client.host else UNKNOWN_PEER


class UploadGate:
    def __init__(self, idle_seconds: float, per_client: int) -> None:
        self.idle_seconds = idle_seconds
        self.per_client = per_client
        self.in_progress: Counter[str] = Counter()

    @classmethod
    def of(cls, limits: LimitsSection) -> UploadGate:
        return cls(limits.upload_idle_seconds, limits.max_concurrent_uploads_per_client)

    @contextlib.contextmanager
    def slot(self, client: str) -> Iterator[None]:
        """One of the client's uploads, for as long as its body is being received."""
        if self.in_progress[client] >= self.per_client:
            raise ApiError(
                429,
                "too_many_uploads",
                f"this client already has {self.per_client} uploads in progress; retry when one ends",
                **{"Retry-After": RETRY_AFTER_SECONDS},
            )
        self.in_progress[client] += 1
        try:
            yield
        finally:
            self.in_progress[client] -= 1
            if self.in_progress[client] <= 0:
                del self.in_progress[client]  # the counter holds only clients uploading now

    async def chunks(self, stream: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """The body's chunks; 408 when none comes for `idle_seconds` (a slow but steady client is
        never cut off: each chunk starts the wait again)."""
        iterator = aiter(stream)
        while True:
            try:
                async with asyncio.timeout(self.idle_seconds):
                    chunk = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise ApiError(
                    408,
                    "upload_timeout",
                    f"the upload sent nothing for {self.idle_seconds:g} s and was closed; send it again",
                    Connection="close",
                ) from None
            yield chunk
