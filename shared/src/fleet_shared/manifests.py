"""A workspace version's manifest: the regular files a workspace held when a Run settled.

Each entry names a file by its workspace-relative path and its content by sha256; the bytes are
the object `workspaces/<sha256>` in the blob store, shared by every version and every session
that holds the same content. A manifest is immutable and named by the sha256 of its canonical
encoding (entries sorted by path), so an unchanged workspace and a fork reuse the same one.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sized
from typing import Generic, Protocol, TypeVar

import msgspec

OBJECT_PREFIX = "workspaces/"
# The layout folders every workspace has, whatever its version holds (a version keeps files only).
WORKSPACE_DIRS = ("memory", "skills", "attachments", "artifacts")


def object_key(sha256: str) -> str:
    """Where a workspace file's content lives in the blob store."""
    return f"{OBJECT_PREFIX}{sha256}"


class FileEntry(msgspec.Struct, frozen=True, array_like=True):
    path: str  # relative, "/"-separated, no "." or ".." part
    size: int
    mode: int  # permission bits only (setuid and setgid are never kept)
    sha256: str
    mtime_ns: int


class Manifest(msgspec.Struct, frozen=True):
    entries: tuple[FileEntry, ...] = ()

    @classmethod
    def of(cls, entries: Iterable[FileEntry]) -> Manifest:
        return cls(tuple(sorted(entries, key=lambda entry: entry.path)))

    @property
    def sha256(self) -> str:
        return manifest_sha256(self.encode())

    @property
    def byte_size(self) -> int:
        return sum(entry.size for entry in self.entries)

    def encode(self) -> bytes:
        return ENCODER.encode(self.entries)

    @classmethod
    def decode(cls, data: bytes | str) -> Manifest:
        return cls(DECODER.decode(data))

    def by_path(self) -> dict[str, FileEntry]:
        return {entry.path: entry for entry in self.entries}


def manifest_sha256(encoded: bytes) -> str:
    return hashlib.sha256(encoded).hexdigest()


EMPTY = Manifest()
ENCODER = msgspec.json.Encoder()
DECODER = msgspec.json.Decoder(tuple[FileEntry, ...])


class WorkspaceState(msgspec.Struct, frozen=True, kw_only=True):
    """A session's workspace as a Run finds it at its claim: its latest committed version."""

    workspace_id: str
    version: int  # 0: nothing committed yet
    manifest: Manifest = EMPTY
    manifest_sha256: str | None = None  # as the database names it (None: no version yet)


class HasEntries(Protocol):
    @property
    def entries(self) -> Sized: ...


T = TypeVar("T", bound=HasEntries)


class ManifestCache(Generic[T]):
    """Decoded manifests (or what is built from one) by sha256, least recently used first out,
    bounded by the entries they hold in all (one larger manifest is kept alone). A manifest is
    immutable, so a cached one is never stale. Safe to share between threads."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.held = 0
        self._items: OrderedDict[str, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, sha256: str) -> T | None:
        with self._lock:
            item = self._items.get(sha256)
            if item is not None:
                self._items.move_to_end(sha256)
            return item

    def put(self, sha256: str, item: T) -> None:
        with self._lock:
            if sha256 in self._items:
                return
            self._items[sha256] = item
            self.held += len(item.entries)
            while self.held > self.max_entries and len(self._items) > 1:
                _sha, dropped = self._items.popitem(last=False)
                self.held -= len(dropped.entries)
