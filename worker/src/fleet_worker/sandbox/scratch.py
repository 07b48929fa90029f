"""Child RLMs' scratch workspaces: who holds one, and the sweep that removes those nobody holds.

A scratch workspace is the folder `scratch-<key>` beside the session workspaces, with a lock
file `scratch-<key>.lock` next to it (out of the sandbox's sight). Its lease holds an exclusive
flock on the lock file from before the folder exists until the folder is gone; a process that
dies lets go of it with its last fd. So "nobody holds the lock" means "no live lease owns the
folder", on this host or (on a shared volume whose locks are shared) any other.

The sweep takes the lock of each scratch key it finds without waiting: a held one is in use and
skipped; a free one is left over (its worker crashed, or its removal failed) and is removed, the
lock file last. Several workers may sweep the same folder at once: only one gets a lock, and
whoever gets it after a removal finds the lock file replaced or gone and does nothing.

Where flock is emulated by POSIX record locks (NFS), a lock is per process and is dropped when
the process closes any fd of that file: the sweep therefore never opens the lock file of a
lease of its own process (`LIVE`, set before the lock file is made), and such a lease is never
mistaken for a free one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import structlog

from fleet_worker.sandbox.errors import SandboxError
from fleet_worker.sandbox.removal import remove_tree

log = structlog.get_logger(__name__)
PREFIX = "scratch-"
LOCK_SUFFIX = ".lock"
LOCK_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
CLAIM_ATTEMPTS = 5
# A scratch folder with no lock file was made by a worker older than these locks; it is removed
# once nothing has changed at its top for this long (no Turn, hence no child, lasts a day).
UNLOCKED_FOLDER_AGE_SECONDS = 86_400.0


class LiveKeys:
    """The scratch keys held by leases of this process."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.lock = threading.Lock()

    def add(self, key: str) -> None:
        with self.lock:
            self.keys.add(key)

    def discard(self, key: str) -> None:
        with self.lock:
            self.keys.discard(key)

    def __contains__(self, key: object) -> bool:
        with self.lock:
            return key in self.keys


LIVE = LiveKeys()


def folder_of(root: Path, key: str) -> Path:
    return root / f"{PREFIX}{key}"


def lock_of(root: Path, key: str) -> Path:
    return root / f"{PREFIX}{key}{LOCK_SUFFIX}"


def still_named(path: Path, fd: int) -> bool:
    """Whether `path` is still the file open as `fd` (not removed, nor removed and made again)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class ScratchClaim:
    """A scratch folder's name, held (locked) by this lease until `discard`."""

    def __init__(self, root: Path) -> None:
        for _ in range(CLAIM_ATTEMPTS):
            key = uuid.uuid4().hex
            lock = lock_of(root, key)
            LIVE.add(key)  # before the lock file exists: this process's sweep never opens it
            try:
                fd = os.open(lock, LOCK_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
            except BaseException:
                LIVE.discard(key)
                raise
            # Another process's sweep may have seen the new lock file and taken it, or taken and
            # removed it, before our flock: then this key is lost, and another one is made.
            if try_lock(fd) and still_named(lock, fd):
                self.key, self.folder, self.lock_fd = key, folder_of(root, key), fd
                return
            os.close(fd)
            LIVE.discard(key)
        raise OSError(f"no scratch folder could be claimed in {CLAIM_ATTEMPTS} attempts")

    def discard(self) -> None:
        """Remove the folder, then its lock file, and let go; OSError if the folder could not
        be removed (the lock is let go all the same, so the sweep tries again)."""
        try:
            remove_tree(self.folder)
            lock_of(self.folder.parent, self.key).unlink(missing_ok=True)
        finally:
            LIVE.discard(self.key)
            os.close(self.lock_fd)


def scratch_keys(root: Path) -> set[str]:
    """The keys of every scratch folder and lock file in `root`."""
    keys = set()
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith(PREFIX):
                key = entry.name[len(PREFIX) :].removesuffix(LOCK_SUFFIX)
                if key and all(c in "0123456789abcdef" for c in key):
                    keys.add(key)
    return keys


def sweep_scratch(
    root: Path,
    *,
    unlocked_folder_age: float = UNLOCKED_FOLDER_AGE_SECONDS,
    unmount: Callable[[Path], object] | None = None,
) -> int:
    """Remove the scratch folders in `root` that no live lease holds; how many were removed.
    Never raises: what cannot be removed now is logged and tried again at the next sweep."""
    try:
        keys = scratch_keys(root)
    except OSError as exc:
        log.warning("sandbox.scratch_sweep_failed", error=str(exc))
        return 0
    removed = 0
    for key in sorted(keys):
        if key in LIVE:
            continue
        try:
            removed += sweep_one(root, key, unlocked_folder_age, unmount)
        except (OSError, SandboxError) as exc:  # an unmount that failed too: the next sweep tries
            log.warning("sandbox.scratch_sweep_failed", folder=f"{PREFIX}{key}", error=str(exc))
    if removed:
        log.info("sandbox.scratch_swept", folders=removed)
    return removed


def sweep_one(
    root: Path, key: str, unlocked_folder_age: float, unmount: Callable[[Path], object] | None = None
) -> bool:
    folder, lock = folder_of(root, key), lock_of(root, key)
    try:
        fd = os.open(lock, LOCK_FLAGS)
    except FileNotFoundError:
        if not untouched_for(folder, unlocked_folder_age):
            return False
        try:  # a lock of our own, so that no other sweep removes it at the same time
            fd = os.open(lock, LOCK_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
    try:
        if not (try_lock(fd) and still_named(lock, fd)):
            return False  # in use, or removed by another sweep since we looked
        if unmount is not None:
            unmount(folder)  # a volume of its own (a root worker's), left by a worker that died
        remove_tree(folder)
        lock.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def untouched_for(folder: Path, seconds: float) -> bool:
    """Whether `folder` exists and its own entries last changed `seconds` ago or more (its
    ctime: the sandbox may set its mtime, never its ctime)."""
    with contextlib.suppress(FileNotFoundError):
        return time.time() - os.stat(folder, follow_symlinks=False).st_ctime >= seconds
    return False
