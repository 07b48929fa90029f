"""Removing a tree that sandboxed code wrote: any depth, no link followed, a bounded number of fds.

`shutil.rmtree` recurses once per level (on Python 3.11 a chain of about a thousand folders ends
it with RecursionError) and `os.fwalk` both recurses and holds an fd per level. Here one loop
holds the fd of the folder it is emptying and, per level above it, only a name, an identity
(device, inode) and the subfolders still to empty. It goes up through `..` and checks that it
arrives where it came from: a folder moved away meanwhile stops the removal instead of taking
it somewhere else. Nothing is followed: entries are unlinked or opened with O_NOFOLLOW relative
to their folder's fd. It never crosses into another filesystem.

Folders a sandbox made unreadable or unwritable (its own uid is the worker's when the worker is
not root) are given back to their owner first: the removal finishes whatever modes it finds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from fleet_shared.confined import DIR_FLAGS, opened_dir

# How often a folder found not empty at its rmdir (something appeared in it) is emptied again.
MAX_REFILLS = 100


@dataclass
class Level:
    """A folder being emptied: its name in the folder above, its identity, what is left in it."""

    name: str
    identity: tuple[int, int]
    subfolders: list[str] = field(default_factory=list)


def remove_tree(path: Path) -> None:
    """`path` (a folder, a file or a link) and everything below it, gone; OSError if it could
    not be. A missing `path` is not an error."""
    with opened_dir(path.parent) as parent:
        try:
            info = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(path.name, dir_fd=parent)
            return
        empty_folder(parent, path.name)
        os.rmdir(path.name, dir_fd=parent)


def empty_folder(parent: int, name: str) -> None:
    """Remove everything inside the folder `name` of `parent`, depth first, without recursion."""
    opened = open_folder(parent, name)
    if opened is None:
        return
    fd, top = opened
    try:
        levels = [Level(name, (top.st_dev, top.st_ino), clear_files(fd))]
        refills = 0
        while levels:
            level = levels[-1]
            if level.subfolders:
                child_name = level.subfolders.pop()
                opened = open_folder(fd, child_name)
                if opened is None:
                    continue
                child, info = opened
                if info.st_dev != top.st_dev:
                    os.close(child)
                    raise OSError(errno.EXDEV, f"another filesystem is mounted inside {name}")
                os.close(fd)
                fd = child
                levels.append(Level(child_name, (info.st_dev, info.st_ino), clear_files(fd)))
                continue
            levels.pop()
            if not levels:
                return  # the top folder is empty; the caller removes it
            up = os.open("..", DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = up
            arrived = os.fstat(fd)
            if (arrived.st_dev, arrived.st_ino) != levels[-1].identity:
                raise OSError(errno.ESTALE, f"a folder inside {name} was moved while it was removed")
            try:
                os.rmdir(level.name, dir_fd=fd)
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY or refills >= MAX_REFILLS:
                    raise
                refills += 1
                levels[-1].subfolders.append(level.name)  # something appeared in it: again
    finally:
        os.close(fd)


def clear_files(fd: int) -> list[str]:
    """Unlink every entry of the folder `fd` that is not a folder; the names of its subfolders."""
    subfolders = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    subfolders.append(entry.name)
                else:
                    os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                continue
    return subfolders


def open_folder(parent: int, name: str) -> tuple[int, os.stat_result] | None:
    """An fd of the folder `name`, its owner able to list and change it, and its fstat. None if
    it is gone, or if it is no folder now (then it is unlinked like one)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        return None
    except PermissionError:  # a folder the sandbox made unreadable
        grant_owner(parent, name)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        with contextlib.suppress(FileNotFoundError):  # swapped for a link or a file: it goes like one
            os.unlink(name, dir_fd=parent)
        return None
    try:
        info = os.fstat(fd)
        if stat.S_IMODE(info.st_mode) & stat.S_IRWXU != stat.S_IRWXU:  # e.g. made read-only
            os.fchmod(fd, stat.S_IMODE(info.st_mode) | stat.S_IRWXU)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def grant_owner(parent: int, name: str) -> None:
    """Give the folder `name` of `parent` read, write and search for its owner, through an
    O_PATH fd of the folder itself (no link followed, nothing swapped in between): /proc's
    name for that fd is the only way to chmod an inode that cannot be opened for reading."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(info.st_mode) | stat.S_IRWXU)
    finally:
        os.close(fd)
