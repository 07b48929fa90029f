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
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

import msgspec
import structlog

log = structlog.get_logger()

OBJECT_PREFIX = "workspaces/"
# The layout folders every workspace has, whatever its version holds (a version keeps files only).
WORKSPACE_DIRS = ("memory", "skills", "attachments", "artifacts")
# What a sandbox can make a manifest cost every reader (the worker's next claim, the files API):
# a path a version keeps is at most MAX_PATH_BYTES of UTF-8 (a longer one is not kept), and a
# manifest at most MAX_MANIFEST_BYTES encoded (a capture stops there, as at its file count).
MAX_PATH_BYTES = 1024
MAX_MANIFEST_BYTES = 32 * 2**20
ENTRY_BYTES = 128  # an entry's encoding besides its path: size, mode, sha256, mtime, punctuation


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


def entry_bytes(path: str) -> int:
    """What one entry costs a manifest's encoding, at most (and a cache that holds it, about):
    the path as JSON encodes it, where a control character takes six bytes."""
    try:
        return len(ENCODER.encode(path)) + ENTRY_BYTES
    except UnicodeEncodeError:  # a path no manifest keeps (CaptureBound.keeps): as if all escaped
        return 6 * len(path) + ENTRY_BYTES


class CaptureBound:
    """What one capture may still put in its manifest: `max_files` entries and MAX_MANIFEST_BYTES
    encoded. `keeps` says whether a path can be kept at all; `takes` counts one entry in, or
    says the manifest is full (then the capture stops, and the version is logged truncated)."""

    def __init__(self, max_files: int, max_bytes: int | None = None) -> None:
        self.max_files = max_files
        self.max_bytes = MAX_MANIFEST_BYTES if max_bytes is None else max_bytes
        self.files = 0
        self.bytes = 0
        self.refused = 0  # paths no manifest keeps

    def keeps(self, relative: str) -> bool:
        """A path a manifest (UTF-8 JSON) and a client can hold: no undecodable bytes, and no
        longer than MAX_PATH_BYTES."""
        try:
            size = len(relative.encode("utf-8"))
        except UnicodeEncodeError:
            size = MAX_PATH_BYTES + 1
        if size > MAX_PATH_BYTES:
            self.refused += 1
            return False
        return True

    def takes(self, relative: str) -> bool:
        cost = entry_bytes(relative)
        if self.files >= self.max_files or self.bytes + cost > self.max_bytes:
            log.warning(
                "workspace.capture_truncated",
                files=self.files,
                max_files=self.max_files,
                bytes=self.bytes,
                max_bytes=self.max_bytes,
            )
            return False
        self.files += 1
        self.bytes += cost
        return True

    def report(self) -> None:
        if self.refused:
            log.warning("workspace.paths_not_kept", count=self.refused, max_path_bytes=MAX_PATH_BYTES)


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
    def entries(self) -> tuple[FileEntry, ...]: ...


T = TypeVar("T", bound=HasEntries)


class ManifestCache(Generic[T]):
    """Decoded manifests (or what is built from one) by sha256, least recently used first out,
    bounded by the bytes their entries hold in all (one larger manifest is kept alone): long
    paths weigh what they cost. A manifest is immutable, so a cached one is never stale. Safe to
    share between threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._items: OrderedDict[str, tuple[T, int]] = OrderedDict()  # and its weight
        self._lock = threading.Lock()

    def get(self, sha256: str) -> T | None:
        with self._lock:
            held = self._items.get(sha256)
            if held is None:
                return None
            self._items.move_to_end(sha256)
            return held[0]

    def put(self, sha256: str, item: T) -> None:
        weight = sum(entry_bytes(entry.path) for entry in item.entries)  # outside the lock
        with self._lock:
            if sha256 in self._items:
                return
            self._items[sha256] = (item, weight)
            self.held += weight
            while self.held > self.max_bytes and len(self._items) > 1:
                _sha, (_dropped, dropped_weight) = self._items.popitem(last=False)
                self.held -= dropped_weight
