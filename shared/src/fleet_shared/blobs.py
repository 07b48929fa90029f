"""Attachment and artifact bytes, in a folder or an S3-compatible bucket, through obstore.

Keys are `attachments/<id>` and `artifacts/<id>`: ids are server-made UUIDs, never a client's
or a sandbox's file name. Writes are atomic (obstore's put); reads are streamed in chunks, by
byte range, so no file is ever held whole in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import obstore
from obstore.exceptions import BaseError as BlobStoreError
from obstore.exceptions import NotFoundError
from obstore.store import LocalStore, S3Store

from fleet_shared.config import Settings

if TYPE_CHECKING:
    from obstore.store import ObjectStore

CHUNK_BYTES = 256 * 1024


__all__ = ["BlobMissing", "BlobStore", "BlobStoreError", "open_blob_store"]


class Sink(Protocol):
    def write(self, data: memoryview, /) -> int: ...


class BlobMissing(Exception):
    """The store has no object under this key."""


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
