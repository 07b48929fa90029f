"""Attachment and artifact bytes, in a folder or an S3-compatible bucket, through obstore.

Keys are `attachments/<id>` and `artifacts/<id>`: ids are server-made UUIDs, never a client's
or a sandbox's file name. Writes are atomic (obstore's put); reads are streamed in chunks, by
byte range, so no file is ever held whole in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple, Protocol

import obstore
from obstore.exceptions import BaseError as BlobStoreError
from obstore.exceptions import NotFoundError
from obstore.store import LocalStore, S3Store

from fleet_shared.config import Settings

if TYPE_CHECKING:
    from obstore.store import ObjectStore

CHUNK_BYTES = 256 * 1024
LIST_PAGE = 1000  # keys per listing request (S3's own most)
ATTACHMENTS = "attachments/"
ARTIFACTS = "artifacts/"


__all__ = ["BlobMissing", "BlobStore", "BlobStoreError", "StoredObject", "open_blob_store"]


def attachment_key(attachment_id: str) -> str:
    return f"{ATTACHMENTS}{attachment_id}"


def artifact_key(artifact_id: str) -> str:
    return f"{ARTIFACTS}{artifact_id}"


class Sink(Protocol):
    def write(self, data: memoryview, /) -> int: ...


class BlobMissing(Exception):
    """The store has no object under this key."""


class StoredObject(NamedTuple):
    key: str
    size: int
    last_modified: datetime  # when it was last put (tz-aware)


class BlobStore:
    def __init__(self, store: ObjectStore, description: str, folder: Path | None = None) -> None:
        self.store = store
        self.description = description  # for logs: the backend, never a credential
        self.folder = folder  # the local backend's folder: its objects are files there

    def local_path(self, key: str) -> Path | None:
        """The file that holds `key` with the local backend (read it in place), else None."""
        return None if self.folder is None else self.folder / key

    def put_file(self, key: str, source: Path) -> None:
        """Store a file's bytes under `key` (blocking: call it from a thread)."""
        obstore.put(self.store, key, source)

    async def put_file_async(self, key: str, source: Path) -> None:
        await obstore.put_async(self.store, key, source)

    def download(self, key: str, sink: IO[bytes] | Sink) -> int:
        """Copy an object into `sink` chunk by chunk (blocking); its size."""
        try:
            result = obstore.get(self.store, key)
        except (NotFoundError, FileNotFoundError) as exc:
            raise BlobMissing(key) from exc
        total = 0
        for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
            sink.write(memoryview(chunk))
            total += len(chunk)
        return total

    async def read_range(self, key: str, start: int, end: int) -> AsyncIterator[bytes]:
        """Bytes [start, end) of an object, streamed; BlobMissing before the first chunk."""
        if end <= start:
            return
        try:
            result = await obstore.get_async(self.store, key, options={"range": (start, end)})
        except (NotFoundError, FileNotFoundError) as exc:
            raise BlobMissing(key) from exc
        async for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
            yield bytes(chunk)

    def exists(self, key: str) -> bool:
        """Whether the store holds an object under `key` (blocking)."""
        try:
            obstore.head(self.store, key)
        except (NotFoundError, FileNotFoundError):
            return False
        return True

    async def delete(self, key: str) -> None:
        with contextlib.suppress(NotFoundError, FileNotFoundError):
            await obstore.delete_async(self.store, key)

    async def listing(self, prefix: str, page: int = LIST_PAGE) -> AsyncIterator[list[StoredObject]]:
        """The objects under `prefix`, a page at a time (one listing request each): a store of
        any size is listed in bounded memory."""
        async for chunk in obstore.list(self.store, prefix, chunk_size=page):
            yield [StoredObject(meta["path"], meta["size"], meta["last_modified"]) for meta in chunk]

    async def delete_if_older(self, key: str, cutoff: datetime) -> bool:
        """Delete `key` only if it was last put before `cutoff`, as a HEAD just before says;
        whether it was deleted. A put since it was listed (its content needed again) keeps it."""
        try:
            meta = await obstore.head_async(self.store, key)
        except (NotFoundError, FileNotFoundError):
            return False
        if meta["last_modified"] >= cutoff:
            return False
        await self.delete(key)
        return True


def open_blob_store(settings: Settings) -> BlobStore:
    blobs = settings.blobs
    if blobs.backend == "local":
        folder = settings.blobs_dir.resolve()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return BlobStore(LocalStore(prefix=folder, mkdir=True), "local", folder)
    if blobs.from_url:  # endpoint, region, credentials and plain http: the AWS_* variables
        url_store = S3Store(blobs.s3_bucket, prefix=blobs.s3_prefix or None)
        return BlobStore(url_store, f"s3 bucket {blobs.s3_bucket}")
    config: dict[str, Any] = {"region": blobs.s3_region}
    if blobs.s3_endpoint:
        config["endpoint"] = blobs.s3_endpoint
    if blobs.s3_access_key is not None and blobs.s3_secret_key is not None:
        config["access_key_id"] = blobs.s3_access_key.reveal()
        config["secret_access_key"] = blobs.s3_secret_key.reveal()
    store = S3Store(
        blobs.s3_bucket,
        prefix=blobs.s3_prefix or None,
        config=config,  # type: ignore[arg-type]
        client_options={"allow_http": blobs.s3_allow_http},
    )
    return BlobStore(store, f"s3 bucket {blobs.s3_bucket}")
