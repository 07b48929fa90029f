"""How much a workspace may hold, checked by the host while cells run (sandbox/volumes.py makes
it a hard limit on a root worker; this check stays, for apparent sizes and for every mode)."""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from fleet_shared.confined import Unwalkable, opened_inside, walk
from fleet_shared.manifests import WORKSPACE_DIRS

FULL_BYTES = 1 << 20  # less room than this on a workspace's own volume: it is full
# The kernel stamps files from a coarse clock, which may lag the wall clock a cell started by.
CLOCK_SLACK_NS = 20_000_000


class WorkspaceBudget:
    """How much a workspace may hold on disk, in bytes and in files. It is measured when a cell
    ends and about every second while one runs; a cell that grows the workspace past the budget
    is stopped. A workspace already over it (an attachment, say) may shrink, never grow.

    A cell's end skips the walk when the last one is less than a second old and the workspace's
    filesystem has exactly the free blocks and free inodes it had just before it: then nothing on
    it took space (delayed allocation is reserved, and so counted, at write time). One statvfs
    instead of a tree walk per quick cell. A file lengthened without taking blocks (truncate)
    changes neither: the next walk counts it (while the next cell runs, or at its end)."""

    EVERY_SECONDS = 1.0
    # While a cell runs the filesystem's free blocks are looked at on every watch (a statvfs): a
    # drop past the room the workspace has left walks it at once, at most this often. A cell
    # writing fast is stopped within about this long of passing the budget, not a second.
    QUICK_SECONDS = 0.1

    def __init__(self, workspace: Path, limit_bytes: int, limit_files: int, *, slack_bytes: int = 0) -> None:
        """`slack_bytes`: what the check lets pass above `limit_bytes` (a volume of the workspace's
        own enforces the bytes; the check is then for the apparent size of sparse files, and a
        file's extent blocks must not make it fire before the volume refuses a write)."""
        self.workspace = workspace
        self.slack_bytes = slack_bytes
        self.limit_bytes = limit_bytes
        self.limit_files = limit_files
        self.known = (0, 0)
        self.allowed = (limit_bytes + slack_bytes, limit_files)
        self.measured_at = self.cell_started = float("-inf")
        self.cell_started_ns = 0
        self.filesystem: tuple[int, int] | None = None  # free blocks and inodes before the last walk
        with contextlib.suppress(Unwalkable, OSError):
            self.filesystem = self.free_space()
            self.known = self.usage()
            self.allowed = (max(limit_bytes + slack_bytes, self.known[0]), max(limit_files, self.known[1]))

    def free_space(self) -> tuple[int, int]:
        info = os.statvfs(self.workspace)
        return info.f_bfree, info.f_ffree

    def usage(self) -> tuple[int, int]:
        """Bytes and entries. An entry counts for its length or its allocated blocks, whichever
        is larger: a sparse file takes little disk here, but whatever copies it out (an
        artifact, a download) copies its whole length."""
        total = files = 0
        for _fd, _name, info, _path in walk(self.workspace, strict=True):
            total += max(info.st_size, info.st_blocks * 512)
            files += 1
        return total, files

    def begin_cell(self) -> None:
        bytes_allowed = self.limit_bytes + self.slack_bytes
        self.allowed = (max(bytes_allowed, self.known[0]), max(self.limit_files, self.known[1]))
        self.cell_started = time.monotonic()
        self.cell_started_ns = time.time_ns()  # what the cell writes from here on is newer

    def unchanged(self) -> bool:
        """At a cell's end: the last walk is less than a second old and nothing on the
        workspace's filesystem grew since. Hard links (and names that fit a folder's spare
        space) use no block and no inode, so a walk still happens at least once a second."""
        if time.monotonic() - self.measured_at >= self.EVERY_SECONDS:
            return False
        try:
            return self.filesystem is not None and self.free_space() == self.filesystem
        except OSError:
            return False

    def due_in_cell(self) -> bool:
        """While a cell runs: a second after it began, then every second; and at once (within
        QUICK_SECONDS of the last walk) when the filesystem lost more free space than the
        workspace has room left, whoever took it."""
        since = time.monotonic() - max(self.measured_at, self.cell_started)
        if since >= self.EVERY_SECONDS:
            return True
        return since >= self.QUICK_SECONDS and self.took_its_room()

    def took_its_room(self) -> bool:
        if self.filesystem is None:
            return False
        try:
            info = os.statvfs(self.workspace)
        except OSError:
            return False
        taken = (self.filesystem[0] - info.f_bfree) * info.f_frsize
        return taken > self.allowed[0] - self.known[0]

    def overrun(self) -> str | None:
        """Why the workspace is over its budget now, or None."""
        self.measured_at = time.monotonic()
        try:
            self.filesystem = self.free_space()  # before the walk: a write during it changes it
        except OSError:
            self.filesystem = None
        try:
            self.known = self.usage()
        except Unwalkable as exc:
            self.filesystem = None
            return f"the workspace cannot be measured: {exc}"
        size, files = self.known
        if size > self.allowed[0]:
            megabytes = self.limit_bytes // 2**20
            return f"the workspace grew past its {megabytes} MiB budget (sandbox.local.workspace_mb)"
        if files > self.allowed[1]:
            return f"the workspace grew past {self.limit_files} files (sandbox.local.workspace_files)"
        return None

    def full(self) -> bool:
        """The workspace's filesystem has no room left (a volume of its own that refused a
        write: on a shared filesystem there is always room, or the host has bigger trouble)."""
        try:
            info = os.statvfs(self.workspace)
        except OSError:
            return False
        return info.f_bavail * info.f_frsize < FULL_BYTES or info.f_favail == 0

    def describe_full(self) -> str:
        megabytes = self.limit_bytes // 2**20
        return (
            f"the workspace is full: its budget is {megabytes} MiB and {self.limit_files} files "
            "(sandbox.local.workspace_mb, sandbox.local.workspace_files); delete files to make room"
        )

    def prune(self, since_ns: int) -> list[str]:
        """Bring a workspace over its budget back under it by removing what was written since
        `since_ns` (a cell's start, wall clock): entries other than folders, largest first, then
        emptied folders, deepest first; the removed paths. Whether an entry is the cell's is read
        from its ctime, which the sandbox cannot set (`utime` and `rename` move it to now). What
        was there before the cell stays, so a workspace already over may stay over; but what the
        cell left, unremovable, never raises what the next cell is allowed. Call it once nothing
        writes any more (the cell's REPL is gone)."""
        since_ns -= CLOCK_SLACK_NS
        written: list[tuple[int, str]] = []
        folders: list[str] = []
        size = files = 0
        with contextlib.suppress(Unwalkable, OSError):
            for _fd, _name, info, path in walk(self.workspace):
                length = max(info.st_size, info.st_blocks * 512)
                size, files = size + length, files + 1
                if info.st_ctime_ns < since_ns:
                    continue
                if stat.S_ISDIR(info.st_mode):
                    if path not in WORKSPACE_DIRS:  # the layout folders stay
                        folders.append(path)
                else:
                    written.append((length, path))
        removed: list[str] = []
        for length, path in sorted(written, reverse=True):
            if self.within(size, files):
                break
            if self.remove(path, os.unlink):
                removed.append(path)
                size, files = size - length, files - 1
        for path in sorted(folders, key=lambda p: p.count("/"), reverse=True):
            if self.within(size, files):
                break
            if self.remove(path, os.rmdir):  # only an emptied one goes
                removed.append(path)
                files -= 1
        # Never more than the cell was allowed: the next cell's allowance does not grow by it.
        self.known = (min(size, self.allowed[0]), min(files, self.allowed[1]))
        self.measured_at = float("-inf")  # the next check walks again
        return removed

    def within(self, size: int, files: int) -> bool:
        return size <= self.allowed[0] and files <= self.allowed[1]

    def remove(self, path: str, how: Callable[..., None]) -> bool:
        *parents, name = path.split("/")
        try:
            with opened_inside(self.workspace, parents) as (fd, _info):
                how(name, dir_fd=fd)
        except OSError:
            return False
        return True

    def pruned(self) -> str:
        """What a cell over the budget left: the files it wrote past it are removed at once."""
        removed = self.prune(self.cell_started_ns)
        if not removed:
            return "delete files to make room"
        shown = ", ".join(removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
        return f"removed what this cell wrote past it ({shown}); delete files to make room"
