"""The host's side of a workspace, which sandboxed code writes: treated as hostile.

Host code never follows a link inside a workspace (everything goes through directory fds with
`O_NOFOLLOW` / `follow_symlinks=False`), replaces whatever sits where a directory is expected,
strips setuid/setgid bits and removes device, fifo and socket files.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

WORKSPACE_DIRS = ("memory", "skills", "attachments", "artifacts")
SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def opened_dir(path: Path | str, *, dir_fd: int | None = None) -> Iterator[int]:
    fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def prepare_layout(workspace: Path) -> None:
    """`workspace/` and its `memory/ skills/ attachments/ artifacts/`, as real directories.

    The workspace folder itself is created by the host under a root the sandbox never sees; its
    subfolders are the sandbox's to play with, so anything in their place (a symlink to a host
    path, a file) is removed, never followed."""
    workspace.mkdir(mode=0o700, parents=True, exist_ok=True)
    with opened_dir(workspace) as root:
        for name in WORKSPACE_DIRS:
            ensure_dir(root, name)


def ensure_dir(parent: int, name: str) -> None:
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        os.mkdir(name, 0o700, dir_fd=parent)
        return
    if stat.S_ISDIR(info.st_mode):
        return
    os.unlink(name, dir_fd=parent)
    os.mkdir(name, 0o700, dir_fd=parent)


def sanitize(workspace: Path, owner: int | None) -> None:
    """Walk the workspace without following links: strip setuid/setgid bits, remove device,
    fifo and socket files, and (root hosts) hand every entry to the sandbox's uid.

    Hard-linked files keep their owner: a link to a file outside could otherwise redirect the
    chown (the jail cannot link across mounts, but the host never relies on that)."""
    if owner is not None:
        os.chown(workspace, owner, owner, follow_symlinks=False)
    for _top, dirs, files, dir_fd in os.fwalk(workspace, follow_symlinks=False):
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):  # the sandbox may still be changing it
                sanitize_entry(dir_fd, name, owner)


def sanitize_entry(dir_fd: int, name: str, owner: int | None) -> None:
    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    mode = info.st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        os.unlink(name, dir_fd=dir_fd)  # a device, fifo or socket: nothing a workspace needs
        return
    if mode & SPECIAL_BITS and not stat.S_ISLNK(mode):
        flags = (os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC) | (
            os.O_DIRECTORY if stat.S_ISDIR(mode) else 0
        )
        fd = os.open(name, flags, dir_fd=dir_fd)
        try:
            os.fchmod(fd, stat.S_IMODE(mode) & ~SPECIAL_BITS)
        finally:
            os.close(fd)
    if stat.S_ISREG(mode) and info.st_nlink > 1:
        return
    if owner is not None and info.st_uid != owner:
        os.chown(name, owner, owner, dir_fd=dir_fd, follow_symlinks=False)


def unreachable_ancestor(path: Path, uid: int) -> Path | None:
    """The first directory above `path` that `uid` (not owner, not in group) cannot search."""
    for ancestor in reversed(path.parents):
        info = ancestor.stat()
        bit = stat.S_IXUSR if info.st_uid == uid else stat.S_IXOTH
        if not info.st_mode & bit:
            return ancestor
    return None


class HostPaths:
    """Host paths that must never reach a client (or the RLM): replaced in any text shown."""

    def __init__(self) -> None:
        self.prefixes: set[str] = set()

    def add(self, path: Path | str) -> None:
        self.prefixes.add(str(path))

    def scrub(self, text: str) -> str:
        for prefix in sorted(self.prefixes, key=len, reverse=True):
            if prefix and prefix in text:
                text = text.replace(prefix, "<host>")
        return text


HOST_PATHS = HostPaths()


class WorkspaceBudget:
    """How much a workspace may hold on disk. A cell that grows it past the budget is stopped;
    a workspace already over it (an older Run, an attachment) may still shrink, never grow."""

    def __init__(self, workspace: Path, limit_bytes: int) -> None:
        self.workspace = workspace
        self.limit_bytes = limit_bytes
        self.known = self.usage()  # refreshed whenever a cell runs long enough to be watched
        self.allowed = max(limit_bytes, self.known)

    def usage(self) -> int:
        """Bytes allocated under the workspace, without following links (st_blocks, so sparse
        files count for what they really take)."""
        total = 0
        for _top, dirs, files, dir_fd in os.fwalk(self.workspace, follow_symlinks=False):
            for name in (*dirs, *files):
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
        return total

    def begin_cell(self) -> None:
        """No walk per cell (a short cell cannot write much): the last known size stands in."""
        self.allowed = max(self.limit_bytes, self.known)

    def over(self) -> bool:
        self.known = self.usage()
        return self.known > self.allowed
