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
# O_NONBLOCK: a FIFO swapped in for a directory fails to open instead of blocking the host.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_DEPTH = 64  # deeper folders are neither walked nor counted (and make the budget refuse)


class Unwalkable(Exception):
    """Part of the workspace cannot be looked into (unreadable, or nested past MAX_DEPTH)."""


def walk(root: Path, *, strict: bool = False) -> Iterator[tuple[int, str, os.stat_result]]:
    """Every entry under `root` as (parent dir fd, name, lstat), depth first.

    Iterative (a deep tree cannot exhaust the stack), holding one fd per level. Each directory is
    opened relative to its parent with O_DIRECTORY|O_NOFOLLOW|O_NONBLOCK: a directory swapped for
    a symlink or a FIFO while the host walks fails to open, and is skipped, never followed.
    `strict` raises Unwalkable for what cannot be looked into instead of skipping it."""
    top = os.open(root, DIR_FLAGS)
    try:
        stack: list[tuple[int, Iterator[str]]] = [(top, iter(os.listdir(top)))]
    except OSError:
        os.close(top)
        raise
    try:
        while stack:
            fd, names = stack[-1]
            name = next(names, None)
            if name is None:
                os.close(stack.pop()[0])
                continue
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield fd, name, info
            if not stat.S_ISDIR(info.st_mode):
                continue
            if len(stack) > MAX_DEPTH:
                if strict:
                    raise Unwalkable(f"folders nested deeper than {MAX_DEPTH} levels")
                continue
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:  # EACCES, ELOOP (swapped for a link), ENXIO
                if strict:
                    raise Unwalkable(f"a folder cannot be read ({os.strerror(exc.errno or 0)})") from None
                continue
            try:
                stack.append((child, iter(os.listdir(child))))
            except OSError:
                os.close(child)
                if strict:
                    raise Unwalkable("a folder cannot be listed") from None
    finally:
        for fd, _names in stack:
            os.close(fd)


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
    for dir_fd, name, info in walk(workspace):
        with contextlib.suppress(FileNotFoundError):  # the sandbox may still be changing it
            sanitize_entry(dir_fd, name, info, owner)


def sanitize_entry(dir_fd: int, name: str, info: os.stat_result, owner: int | None) -> None:
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
    """How much a workspace may hold on disk, in bytes and in files. It is measured when a cell
    ends and about every second while one runs; a cell that grows the workspace past the budget
    is stopped. A workspace already over it (an attachment, say) may shrink, never grow."""

    def __init__(self, workspace: Path, limit_bytes: int, limit_files: int) -> None:
        self.workspace = workspace
        self.limit_bytes = limit_bytes
        self.limit_files = limit_files
        self.known = (0, 0)
        self.allowed = (limit_bytes, limit_files)
        with contextlib.suppress(Unwalkable, OSError):
            self.known = self.usage()
            self.allowed = (max(limit_bytes, self.known[0]), max(limit_files, self.known[1]))

    def usage(self) -> tuple[int, int]:
        """Bytes allocated (st_blocks: a sparse file counts for what it takes) and entries."""
        total = files = 0
        for _fd, _name, info in walk(self.workspace, strict=True):
            total += info.st_blocks * 512
            files += 1
        return total, files

    def begin_cell(self) -> None:
        self.allowed = (max(self.limit_bytes, self.known[0]), max(self.limit_files, self.known[1]))

    def overrun(self) -> str | None:
        """Why the workspace is over its budget now, or None."""
        try:
            self.known = self.usage()
        except Unwalkable as exc:
            return f"the workspace cannot be measured: {exc}"
        size, files = self.known
        if size > self.allowed[0]:
            megabytes = self.limit_bytes // 2**20
            return f"the workspace grew past its {megabytes} MiB budget (sandbox.local.workspace_mb)"
        if files > self.allowed[1]:
            return f"the workspace grew past {self.limit_files} files (sandbox.local.workspace_files)"
        return None
