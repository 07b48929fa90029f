"""A workspace version as the files API reads it: its manifest's paths, sorted, searched by bisect.

A version keeps regular files only. A folder exists when a file's path lies under it, and the
layout folders always do. Everything under `a/b/` is one run of consecutive paths in sorted
order, found with two binary searches; a listing steps from one child to the next with one
more, never reading what lies deeper. So a request costs what it shows (times log n), however
many files the version holds.

Manifests are immutable and named by their sha256, so a gateway process keeps the indexes it
built, least recently used first out, within a bound on the entries they hold in all.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import pairwise

from fleet_shared.manifests import WORKSPACE_DIRS, FileEntry, Manifest, ManifestCache

# One past "/" in code point order: every path under `folder/` sorts before `folder` + AFTER_SLASH,
# and nothing else does that sorts after `folder/`.
AFTER_SLASH = chr(ord("/") + 1)
# What the cache holds at most, weighed as its manifests' encodings (entry_bytes each; in memory
# an index takes a few times that); one manifest larger than that is still kept, alone.
CACHED_BYTES = 64 * 2**20

LAYOUT = tuple(sorted(WORKSPACE_DIRS))
Child = tuple[str, FileEntry | None]  # a name, and its file (None: a folder)


class WorkspaceIndex:
    __slots__ = ("entries", "paths")

    def __init__(self, entries: tuple[FileEntry, ...]) -> None:
        paths = [entry.path for entry in entries]
        if any(earlier >= later for earlier, later in pairwise(paths)):
            # Manifest.of sorts by path; a manifest written otherwise is sorted here, once.
            entries = tuple(sorted({entry.path: entry for entry in entries}.values(), key=lambda e: e.path))
            paths = [entry.path for entry in entries]
        self.entries = entries
        self.paths = paths

    @classmethod
    def decode(cls, encoded: str) -> WorkspaceIndex:
        return cls(Manifest.decode(encoded).entries)

    def file(self, path: str) -> FileEntry | None:
        at = bisect_left(self.paths, path)
        return self.entries[at] if at < len(self.paths) and self.paths[at] == path else None

    def is_folder(self, path: str) -> bool:
        """`path` ("" = the workspace itself) is a folder: the root, a layout folder, or one a
        file lies under."""
        if path in ("", *WORKSPACE_DIRS):
            return True
        prefix = f"{path}/"
        at = bisect_left(self.paths, prefix)
        return at < len(self.paths) and self.paths[at].startswith(prefix)

    def children(self, folder: str, limit: int) -> tuple[list[Child], bool]:
        """The first `limit` files and folders directly in `folder`, sorted by name, and whether
        more remain. They are taken in path order (a folder `a` sorts as `a/`), a step each."""
        found: dict[str, FileEntry | None] = {}
        if not folder:
            found.update(dict.fromkeys(LAYOUT[:limit]))  # always there, so taken first
        prefix = f"{folder}/" if folder else ""
        paths = self.paths
        at = bisect_left(paths, prefix)
        end = bisect_left(paths, f"{folder}{AFTER_SLASH}") if folder else len(paths)
        while at < end:
            name, slash, _rest = paths[at].removeprefix(prefix).partition("/")
            if name not in found:
                if len(found) >= limit:
                    return sorted_children(found), True
                found[name] = None if slash else self.entries[at]
            # Past this child: the next path, or everything under the folder it names.
            at = bisect_left(paths, f"{prefix}{name}{AFTER_SLASH}", at + 1, end) if slash else at + 1
        more = not folder and len(LAYOUT) > limit
        return sorted_children(found), more


def sorted_children(found: dict[str, FileEntry | None]) -> list[Child]:
    return sorted(found.items(), key=lambda child: child[0])


EMPTY_INDEX = WorkspaceIndex(())


class IndexCache(ManifestCache[WorkspaceIndex]):
    """Indexes by manifest sha256, in this process (an immutable manifest is never stale)."""

    def __init__(self, max_bytes: int = CACHED_BYTES) -> None:
        super().__init__(max_bytes)
