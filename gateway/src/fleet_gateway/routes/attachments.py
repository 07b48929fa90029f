"""Attachments: upload a file (multipart, streamed to disk under a size cap), read its metadata."""

from __future__ import annotations

import asyncio
import hashlib
import mimetypes
import os
import re
import tempfile
import unicodedata
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from multipart import MultipartError, MultipartSegment, PushMultipartParser, parse_options_header
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.schemas import AttachmentOut
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import iso
from fleet_gateway.upload_gate import UploadGate, client_of
from fleet_shared.blobs import attachment_key
from fleet_shared.db import files, scoped
from fleet_shared.db.files import StorageQuota, quota_refusal, stored_bytes
from fleet_shared.ids import new_id, parse_uuid
from fleet_shared.tenancy import Principal

log = structlog.get_logger(__name__)
FIELD = "attachment"
FLUSH_BYTES = 1 << 20  # written to disk (off the event loop) in pieces of about this size
FORM_OVERHEAD_BYTES = 64 * 1024  # headers, boundaries and a small extra field or two
SAFE_NAME = re.compile(r"[^A-Za-z0-9._ ()+-]")
MEDIA_TYPE = re.compile(r"^[A-Za-z0-9!#$&^_.+-]{1,100}/[A-Za-z0-9!#$&^_.+-]{1,100}$")


def clean_filename(raw: str | None) -> str:
    """A name that is safe as one path component in a workspace and in a header: the last
    component of what the client sent, NFC, without control or shell-unfriendly characters."""
    name = unicodedata.normalize("NFKC", raw or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = SAFE_NAME.sub("_", name).strip(" .")[:200]
    return name or "attachment"


def clean_media_type(raw: str | None) -> str:
    media_type = (raw or "").strip().lower()
    return media_type if MEDIA_TYPE.match(media_type) else "application/octet-stream"


# Python's own table (never the host's /etc/mime.types: the same answer on every pod), with the
# text formats an RLM is most often given that it lacks.
MEDIA_TYPES = mimetypes.MimeTypes(filenames=())
for extension, known in {
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".yaml": "application/yaml",
    ".yml": "application/yaml",
    ".toml": "application/toml",
    ".jsonl": "application/jsonl",
    ".log": "text/plain",
}.items():
    MEDIA_TYPES.add_type(known, extension)


def media_type_of(raw: str | None, filename: str) -> str:
    """What the client said, unless it said nothing useful (`curl -F` sends octet-stream for
    any file): then what the file's name says, if anything."""
    media_type = clean_media_type(raw)
    if media_type == "application/octet-stream":
        guessed, _encoding = MEDIA_TYPES.guess_type(filename, strict=False)
        if guessed and MEDIA_TYPE.match(guessed):
            return guessed
    return media_type


@dataclass
class Received:
    filename: str
    media_type: str
    size: int
    sha256: str
    path: Path


class Upload:
    """One request's file, from the multipart stream to a temporary file, hashed on the way."""

    def __init__(self, limit: int, folder: Path) -> None:
        self.limit = limit
        self.folder = folder
        self.hasher = hashlib.sha256()
        self.size = 0
        self.buffer = bytearray()
        self.segment: MultipartSegment | None = None
        self.handle: Any = None
        self.path: Path | None = None
        self.done: Received | None = None

    async def start(self, segment: MultipartSegment) -> None:
        if segment.name != FIELD or self.done is not None or self.segment is not None:
            return  # other fields are ignored; a second file field is too
        self.segment = segment
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="upload-", dir=self.folder)
        self.path = Path(name)
        self.handle = os.fdopen(fd, "wb")

    async def add(self, chunk: bytes) -> None:
        if self.segment is None:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            raise ApiError(413, "payload_too_large", f"an attachment may be at most {self.limit} bytes")
        self.hasher.update(chunk)
        self.buffer += chunk
        if len(self.buffer) >= FLUSH_BYTES:
            await self.flush()

    async def flush(self) -> None:
        data, self.buffer = bytes(self.buffer), bytearray()
        if data:
            await asyncio.to_thread(self.handle.write, data)

    async def end(self) -> None:
        if self.segment is None:
            return
        await self.flush()
        await asyncio.to_thread(self.handle.close)
        assert self.path is not None
        segment, self.segment, self.handle = self.segment, None, None
        filename = clean_filename(segment.filename)
        self.done = Received(
            filename=filename,
            media_type=media_type_of(segment.content_type, filename),
            size=self.size,
            sha256=self.hasher.hexdigest(),
            path=self.path,
        )

    def discard(self) -> None:
        if self.handle is not None:
            self.handle.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


async def receive(request: Request[Any, Any, Any], limit: int, folder: Path, gate: UploadGate) -> Received:
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    if kind != "multipart/form-data" or not options.get("boundary"):
        raise ApiError(415, "unsupported_media_type", "send multipart/form-data with a field 'attachment'")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + FORM_OVERHEAD_BYTES:
        raise ApiError(413, "payload_too_large", f"an attachment may be at most {limit} bytes")
    with gate.slot(client_of(request)):
        upload = Upload(limit, folder)
        try:
            await read_form(upload, gate.chunks(request.stream()), options["boundary"], limit)
        except MultipartError as exc:
            upload.discard()
            raise ApiError(422, "validation_error", f"the multipart body is malformed: {exc}") from None
        except BaseException:
            upload.discard()
            raise
    if upload.done is None:
        upload.discard()
        raise ApiError(422, "validation_error", f"the form has no file field {FIELD!r}")
    return upload.done


async def read_form(upload: Upload, chunks: AsyncIterator[bytes], boundary: str, limit: int) -> None:
    received = 0
    # Not strict: bytes after the closing boundary (a trailing CRLF in a later chunk) are
    # ignored; the limits below still bound headers and parts.
    with PushMultipartParser(boundary, max_segment_count=8, strict=False) as parser:
        async for chunk in chunks:
            received += len(chunk)
            if received > limit + FORM_OVERHEAD_BYTES:
                raise ApiError(413, "payload_too_large", f"an attachment may be at most {limit} bytes")
            for event in parser.parse(chunk):
                if isinstance(event, MultipartSegment):
                    await upload.start(event)
                elif event is None:
                    await upload.end()
                else:
                    await upload.add(bytes(event))


async def refuse_past_quota(db: AsyncSession, quota: StorageQuota, size: int, tenant: str) -> None:
    """507 when storing `size` more bytes would pass the tenant's or the deployment's quota."""
    refusal = quota_refusal(quota, await stored_bytes(db, tenant=tenant), size)
    if refusal is not None:
        raise ApiError(507, "storage_quota_exceeded", f"the attachment was not stored: {refusal}")


class AttachmentController(Controller):
    path = "/api/attachments"

    # The body is streamed to disk under the attachment cap, not Litestar's general body limit.
    @post("/", status_code=201, request_max_body_size=None)
    async def upload(
        self,
        request: Request[Any, Any, Any],
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
    ) -> AttachmentOut:
        storage = gw.settings.profile.storage
        limit = storage.max_attachment_mb * 2**20
        received = await receive(request, limit, gw.settings.data_dir / "uploads", gw.uploads)
        try:
            quota = StorageQuota.of(storage, gw.settings.profile.quotas.of(caller.tenant))
            await refuse_past_quota(db, quota, received.size, caller.tenant)
        except BaseException:
            received.path.unlink(missing_ok=True)
            raise
        attachment_id = new_id()
        try:
            await gw.blobs.put_file_async(attachment_key(attachment_id), received.path)
        except Exception as exc:
            log.warning("attachment.store_failed", error_type=type(exc).__name__, store=gw.blobs.description)
            raise ApiError(503, "service_unavailable", "the attachment could not be stored; retry") from None
        finally:
            received.path.unlink(missing_ok=True)
        row = await files.add_attachment(
            db,
            attachment_id=attachment_id,
            filename=received.filename,
            media_type=received.media_type,
            byte_size=received.size,
            checksum_sha256=received.sha256,
            owner=caller,
        )
        log.info("attachment.stored", attachment_id=attachment_id, byte_size=received.size)
        return AttachmentOut.of(row, iso)

    @get("/{attachment_id:str}")
    async def get_attachment(
        self,
        db: NamedDependency[AsyncSession],
        caller: NamedDependency[Principal],
        attachment_id: FromPath[str],
    ) -> AttachmentOut:
        canonical = parse_uuid(attachment_id)
        row = await scoped.get_attachment(db, canonical, caller) if canonical else None
        if row is None:
            raise not_found("attachment")
        return AttachmentOut.of(row, iso)
