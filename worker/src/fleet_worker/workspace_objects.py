"""Workspace file contents in the blob store (`workspaces/<sha256>`), through a local cache.

The store is the one home of every byte a workspace version holds. A worker keeps a
content-addressed copy of what it fetched or stored in `<data_dir>/cache/workspaces/`, bounded
in bytes and evicted least recently used first, so a warm worker downloads nothing. The cache
is this worker's scratch: losing it costs downloads, never data. With the `local` backend the
store is a folder on this machine already, and is read in place.

- Every byte is hashed on its way in: a cache file is named by the sha256 of what it holds,
  and an object read from the store must hold what its name says.
- A file a Run changed is always put in the store, never skipped because the store may hold
  its content already: the put renews the object's age, so `fleet gc` (which removes only
  unreferenced objects older than its grace period) cannot remove it before the commit that
  refers to it. Files a Run did not change are referred to by the latest version already.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Protocol

from fleet_shared.blobs import BlobStore
from fleet_shared.manifests import object_key

COPY_CHUNK = 1 << 20
PREFETCH_THREADS = 8  # downloads in flight at once when a lease fills a cold folder
SHA256_HEX = 64


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class ContentMismatch(Exception):
    """The store's object does not hold the bytes its name says."""


class WorkspaceObjects:
    def __init__(self, blobs: BlobStore, cache_dir: Path, cache_bytes: int) -> None:
        self.blobs = blobs
        self.cache_dir = cache_dir
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cached: OrderedDict[str, int] = OrderedDict()  # sha256 -> size, least recent first
        self._total = 0
        self.cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._load_cache()

    @property
    def cached_bytes(self) -> int:
        return self._total

    def _load_cache(self) -> None:
        """What an earlier run of this worker left in the cache, least recently used first."""
        for leftover in self.cache_dir.glob(".incoming-*"):  # a copy a crash cut short
            leftover.unlink(missing_ok=True)
        found = []
        for path in self.cache_dir.glob("*/*"):
            with contextlib.suppress(OSError):
                info = path.stat()
                if len(path.name) == SHA256_HEX and path.parent.name == path.name[:2]:
                    found.append((info.st_atime_ns, path.name, info.st_size))
                else:
                    path.unlink()  # not a cache file
        for _used, sha256, size in sorted(found):
            self._cached[sha256] = size
            self._total += size
        self._evict(keep=None)

    def cache_path(self, sha256: str) -> Path:
        return self.cache_dir / sha256[:2] / sha256

    @contextlib.contextmanager
    def opened(self, sha256: str) -> Iterator[IO[bytes]]:
        """The content named `sha256`, open for reading: in place with the local backend, else
        from the cache, else downloaded (and checked) from the store."""
        local = self.blobs.local_path(object_key(sha256))
        if local is not None:
            with open(local, "rb") as handle:
                yield handle
            return
        path = self.cache_path(sha256)
        with self._lock:
            hit = sha256 in self._cached
            if hit:
                self._cached.move_to_end(sha256)
        if hit:
            try:
                cached: IO[bytes] = open(path, "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError:  # evicted meanwhile
                hit = False
            else:
                with cached:
                    yield cached
                return
        with self._incoming() as (handle, temp):
            writer = HashingWriter(handle)
            self.blobs.download(object_key(sha256), writer)
            handle.flush()
            if writer.sha256.hexdigest() != sha256:
                raise ContentMismatch(f"workspace object {sha256} does not hold its content")
            with open(temp, "rb") as reader:  # before the cache may take the file away
                self._admit(sha256, temp, writer.size)
                yield reader

    def prefetch(self, wanted: Iterable[str]) -> None:
        """Bring contents the cache lacks from the store, several at once (a cold lease start
        would otherwise wait for one download after another). Only what the cache can hold."""
        if self.blobs.folder is not None or self.cache_bytes <= 0:
            return
        with self._lock:
            missing = sorted({sha256 for sha256 in wanted if sha256 not in self._cached})
        if not missing:
            return
        with ThreadPoolExecutor(
            min(PREFETCH_THREADS, len(missing)), thread_name_prefix="fleet-fetch"
        ) as pool:
            for _done in pool.map(self._fetch, missing):
                pass  # map re-raises a download's error here

    def _fetch(self, sha256: str) -> None:
        with self._incoming() as (handle, temp):
            writer = HashingWriter(handle)
            self.blobs.download(object_key(sha256), writer)
            handle.flush()
            if writer.sha256.hexdigest() != sha256:
                raise ContentMismatch(f"workspace object {sha256} does not hold its content")
            self._admit(sha256, temp, writer.size)

    def store(self, source: Readable) -> tuple[str, int]:
        """Copy `source` (a workspace file, open) into the store by its sha256: (sha256, size).
        It is read once, into a private copy: what is stored is exactly what was hashed."""
        with self._incoming() as (handle, temp):
            writer = HashingWriter(handle)
            while chunk := source.read(COPY_CHUNK):
                writer.write(chunk)
            handle.flush()
            sha256 = writer.sha256.hexdigest()
            self.blobs.put_file(object_key(sha256), temp)
            if self.blobs.local_path(object_key(sha256)) is None:
                self._admit(sha256, temp, writer.size)
        return sha256, writer.size

    @contextlib.contextmanager
    def _incoming(self) -> Iterator[tuple[IO[bytes], Path]]:
        fd, name = tempfile.mkstemp(dir=self.cache_dir, prefix=".incoming-")
        temp = Path(name)
        try:
            with os.fdopen(fd, "wb") as handle:
                yield handle, temp
        finally:
            temp.unlink(missing_ok=True)  # gone already when the cache took it

    def _admit(self, sha256: str, temp: Path, size: int) -> None:
        """Move a checked copy into the cache (if it fits at all), then evict past the bound."""
        if size > self.cache_bytes:
            return
        target = self.cache_path(sha256)
        target.parent.mkdir(mode=0o700, exist_ok=True)
        os.chmod(temp, 0o400)
        os.replace(temp, target)
        with self._lock:
            if sha256 not in self._cached:
                self._total += size
            self._cached[sha256] = size
            self._cached.move_to_end(sha256)
        self._evict(keep=sha256)

    def _evict(self, keep: str | None) -> None:
        with self._lock:
            while self._total > self.cache_bytes and self._cached:
                oldest, size = next(iter(self._cached.items()))
                if oldest == keep:
                    break
                del self._cached[oldest]
                self._total -= size
                self.cache_path(oldest).unlink(missing_ok=True)


class HashingWriter:
    """A file that hashes and counts what is written to it."""

    def __init__(self, target: IO[bytes]) -> None:
        self.target = target
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.target.write(data)
