"""Reading a folder that hostile code writes (a session's workspace) without ever leaving it.

Everything goes through directory fds opened relative to their parent with
O_DIRECTORY|O_NOFOLLOW|O_NONBLOCK, and files with O_NOFOLLOW|O_NONBLOCK and an fstat check:
a symlink is never followed (not even one swapped in while we look), a FIFO never blocks us,
and only regular files are read. The worker walks workspaces this way to sanitise and measure
them; the gateway's files API reads them this way.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_DEPTH = 64  # deeper folders are neither walked nor counted
MAX_COMPONENTS = 64


class Unwalkable(Exception):
    """Part of the tree cannot be looked into (unreadable, or nested past MAX_DEPTH)."""


class OutsideTree(ValueError):
    """A relative path that is not a plain path inside the tree (absolute, `..`, NUL, too deep)."""


def parts_of(relative: str) -> list[str]:
    """The components of a client's relative path; `""`, `.` and `/` mean the root itself."""
    if "\x00" in relative or "\\" in relative:
        raise OutsideTree("the path holds a forbidden character")
    path = PurePosixPath(relative.strip("/") or ".")
    parts = [part for part in path.parts if part != "."]
    if any(part == ".." for part in parts) or len(parts) > MAX_COMPONENTS:
        raise OutsideTree("the path leaves the workspace")
    return parts


@contextlib.contextmanager
def opened_dir(path: Path | str, *, dir_fd: int | None = None) -> Iterator[int]:
    fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def opened_inside(root: Path, parts: list[str]) -> Iterator[tuple[int, os.stat_result]]:
    """An fd of the entry at `root/parts` (a directory or a regular file) and its fstat.

    FileNotFoundError for anything else: a symlink at any level, a FIFO, a device, a missing
    name. The caller never learns which, and neither does a client."""
    fd = os.open(root, DIR_FLAGS)
    try:
        for index, name in enumerate(parts):
            last = index == len(parts) - 1
            try:
                child = os.open(name, FILE_FLAGS if last else DIR_FLAGS, dir_fd=fd)
            except OSError as exc:  # ELOOP (a link), ENOTDIR, ENXIO, EACCES …
                raise FileNotFoundError(name) from exc
            os.close(fd)
            fd = child
        info = os.fstat(fd)
        if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
            raise FileNotFoundError(parts[-1] if parts else ".")
        yield fd, info
    finally:
        os.close(fd)


def walk(root: Path | int, *, strict: bool = False) -> Iterator[tuple[int, str, os.stat_result, str]]:
    """Every entry under `root` as (parent dir fd, name, lstat, relative path), depth first.

    Iterative (a deep tree cannot exhaust the stack), holding one fd per level. A directory
    swapped for a symlink or a FIFO while we walk fails to open, and is skipped, never followed.
    `strict` raises Unwalkable for what cannot be looked into instead of skipping it. `root` may
    be an open directory fd (it is duplicated, and stays open)."""
    top = os.dup(root) if isinstance(root, int) else os.open(root, DIR_FLAGS)
    try:
        stack: list[tuple[int, Iterator[str], str]] = [(top, iter(os.listdir(top)), "")]
    except OSError:
        os.close(top)
        raise
    try:
        while stack:
            fd, names, prefix = stack[-1]
            name = next(names, None)
            if name is None:
                os.close(stack.pop()[0])
                continue
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            relative = f"{prefix}{name}"
            yield fd, name, info, relative
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
                stack.append((child, iter(os.listdir(child)), f"{relative}/"))
            except OSError:
                os.close(child)
                if strict:
                    raise Unwalkable("a folder cannot be listed") from None
    finally:
        for fd, _names, _prefix in stack:
            os.close(fd)
