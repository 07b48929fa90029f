"""Artifacts: metadata, and the bytes streamed from the blob store (ETag, Range, 304)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated
from urllib.parse import quote

import structlog
from litestar import Controller, Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath, HeaderParameter
from litestar.response import Stream
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.schemas import ArtifactOut
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import iso
from fleet_shared.blobs import BlobMissing, BlobStore, BlobStoreError, artifact_key
from fleet_shared.db import scoped
from fleet_shared.db.models import Artifact
from fleet_shared.ids import parse_uuid
from fleet_shared.tenancy import Principal

log = structlog.get_logger(__name__)
RANGE = re.compile(r"^bytes=(\d{0,18})-(\d{0,18})$")
ASCII_NAME = re.compile(r"[^A-Za-z0-9._ ()+-]")

IfNoneMatch = Annotated[str | None, HeaderParameter(name="If-None-Match", required=False)]
RangeHeader = Annotated[str | None, HeaderParameter(name="Range", required=False)]


async def load_artifact(db: AsyncSession, artifact_id: str, caller: Principal) -> Artifact:
    canonical = parse_uuid(artifact_id)
    row = await scoped.get_artifact(db, canonical, caller) if canonical else None
    if row is None:
        raise not_found("artifact")
    return row


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a single `bytes=` range; None for the whole file. A multi-range or
    malformed header is ignored (the whole file, as RFC 9110 allows); one that cannot be
    satisfied is a 416."""
    if header is None:
        return None
    match = RANGE.match(header.strip())
    if match is None or (not match[1] and not match[2]):
        return None
    if not match[1]:  # the last N bytes
        suffix = int(match[2])
        if suffix == 0 or size == 0:
            raise unsatisfiable(size)
        return max(0, size - suffix), size
    start = int(match[1])
    if match[2] and int(match[2]) < start:
        return None  # not a valid range (RFC 9110): ignored, the whole file
    end = min(int(match[2]) + 1, size) if match[2] else size
    if start >= size:
        raise unsatisfiable(size)
    return start, end


def unsatisfiable(size: int) -> ApiError:
    return ApiError(
        416, "range_not_satisfiable", "the range is outside the file", **{"Content-Range": f"bytes */{size}"}
    )


def disposition(name: str) -> str:
    """`attachment` with an ASCII fallback name and the exact name in RFC 5987 form."""
    base = name.rsplit("/", 1)[-1] or "artifact"
    fallback = ASCII_NAME.sub("_", base) or "artifact"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(base, safe='')}"


def etag_matches(header: str | None, etag: str) -> bool:
    if header is None:
        return False
    candidates = [tag.strip().removeprefix("W/") for tag in header.split(",")]
    return "*" in candidates or etag in candidates


async def opened(
    blobs: BlobStore, key: str, start: int, end: int, *, what: str = "artifact"
) -> AsyncIterator[bytes]:
    """The bytes, with the first chunk already read: a missing object is a 404 (`what` not
    found) before any header is sent, not a response cut short."""
    chunks = blobs.read_range(key, start, end)
    try:
        first = await anext(chunks, b"")
    except BlobMissing:
        log.error("blob.bytes_missing", what=what, key=key)  # the row outlived its bytes
        raise not_found(what) from None
    except BlobStoreError as exc:  # the store is away, throttling or refusing: retry later
        log.warning("blob.store_failed", what=what, key=key, error_type=type(exc).__name__)
        raise ApiError(503, "service_unavailable", "the blob store is unavailable; retry") from None

    async def rest() -> AsyncIterator[bytes]:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk

    return rest()


class ArtifactController(Controller):
    path = "/api/artifacts"

    @get("/{artifact_id:str}")
    async def get_artifact(
        self,
        db: NamedDependency[AsyncSession],
        caller: NamedDependency[Principal],
        artifact_id: FromPath[str],
    ) -> ArtifactOut:
        return ArtifactOut.of(await load_artifact(db, artifact_id, caller), iso)

    @get("/{artifact_id:str}/content")
    async def get_content(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        artifact_id: FromPath[str],
        if_none_match: IfNoneMatch = None,
        range_header: RangeHeader = None,
    ) -> Response[None] | Stream:
        row = await load_artifact(db, artifact_id, caller)
        etag = f'"{row.checksum_sha256}"'
        headers = {
            "ETag": etag,
            "Accept-Ranges": "bytes",
            "X-Content-Type-Options": "nosniff",
            "Content-Disposition": disposition(row.name),
            "Cache-Control": "private, max-age=0, must-revalidate",
        }
        if etag_matches(if_none_match, etag):
            return Response(None, status_code=304, headers=headers)
        size = row.byte_size
        span = byte_range(range_header, size)
        start, end = span or (0, size)
        headers["Content-Length"] = str(end - start)
        status = 200
        if span is not None:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        key = artifact_key(row.id)
        content = await opened(gw.blobs, key, start, end)
        return Stream(content, status_code=status, media_type=row.media_type, headers=headers)
