"""A workspace version's manifest: the regular files a workspace held when a Run settled.

Each entry names a file by its workspace-relative path and its content by sha256; the bytes are
the object `workspaces/<sha256>` in the blob store, shared by every version and every session
that holds the same content. A manifest is immutable and named by the sha256 of its canonical
encoding (entries sorted by path), so an unchanged workspace and a fork reuse the same one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

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
