"""A workspace folder on this worker and the session's versions in the store, kept in step.

`materialise` turns the folder into exactly what a version's manifest holds before a Run, and
`capture` turns what the Run left into the next manifest, storing each file it changed. The
folder is the worker's scratch: another worker, or this one after a restart, rebuilds it from
the store.

What the host knows of a file it wrote or hashed is its `Known` record: size, mtime, ctime,
inode and sha256. A file whose lstat still shows the same size, mtime, ctime and inode holds
the same bytes (any write, chmod, chown or rename changes the ctime, which no process can set),
so it is neither hashed nor stored again, and a folder some other process changed (another
worker on this host, a Run that ended without its commit) is corrected file by file. Without
a record (a worker that restarted), every file is replaced from the store.

The folder is hostile, as everywhere: entries are reached through directory fds, no link is
followed, only regular files are kept, and what the walk refuses (too deep, unreadable) never
reaches a manifest.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

from fleet_shared.confined import DIR_FLAGS, FILE_FLAGS, opened_dir, opened_inside, walk
from fleet_shared.manifests import WORKSPACE_DIRS, CaptureBound, FileEntry, Manifest
from fleet_worker.sandbox.provider import Captured, OverQuota, Room, no_quota
from fleet_worker.sandbox.removal import empty_folder
from fleet_worker.sandbox.workspace import ensure_dir, prepare_layout
from fleet_worker.workspace_objects import COPY_CHUNK, WorkspaceObjects

log = structlog.get_logger(__name__)
MODE_BITS = 0o777  # what a manifest keeps of a file's mode: never setuid, setgid or sticky
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Known:
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    sha256: str

    @classmethod
    def of(cls, info: os.stat_result, sha256: str) -> Known:
        return cls(info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, sha256)

    def holds(self, info: os.stat_result) -> bool:
        """The file is still the one this record describes (its bytes unchanged)."""
        return (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino) == (
            self.size,
            self.mtime_ns,
            self.ctime_ns,
            self.ino,
        )


Baseline = dict[str, Known]


def materialise(
    folder: Path, manifest: Manifest, baseline: Baseline, objects: WorkspaceObjects, owner: int | None
) -> Baseline:
    """Make `folder` hold exactly the manifest's files (the layout folders besides), every entry
    owned by `owner` (None: this process) with no setuid or setgid bit: what a sanitize pass
    would leave, so the lease needs none. What the host knows of the folder afterwards."""
    prepare_layout(folder)
    with opened_dir(folder) as top:
        own(top, os.fstat(top), owner)
    wanted = manifest.by_path()
    needed = {"", *WORKSPACE_DIRS, *(parent for path in wanted for parent in parents_of(path))}
    kept: Baseline = {}
    folders: list[str] = []
    for dir_fd, name, info, relative in walk(folder):
        if stat.S_ISDIR(info.st_mode):
            folders.append(relative)
            if relative in needed:
                with contextlib.suppress(OSError), opened_dir(name, dir_fd=dir_fd) as child:
                    own(child, os.fstat(child), owner)
            continue
        entry, known = wanted.get(relative), baseline.get(relative)
        if (
            stat.S_ISREG(info.st_mode)
            and entry
            and known
            and known.holds(info)
            and known.sha256 == entry.sha256
        ):
            kept[relative] = keep(dir_fd, name, info, entry, known, owner=owner)
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)  # changed, unknown, not regular, or not in this version
    for relative in folders:
        parent = relative.rpartition("/")[0]
        if relative not in needed and parent in needed:
            remove_folder(folder, relative)
    missing = [entry for entry in manifest.entries if entry.path not in kept]
    objects.prefetch(entry.sha256 for entry in missing)
    with ParentFolder(folder, owner) as parents:
        for entry in missing:  # in path order: files of one folder follow each other
            folder_path, _slash, name = entry.path.rpartition("/")
            kept[entry.path] = write(parents.at(folder_path), name, entry, objects, owner)
    return kept


class ParentFolder:
    """The open folder the last file was written in, kept for the next file of the same folder
    (opening each file's folder from the root would cost an open per level per file)."""

    def __init__(self, root: Path, owner: int | None) -> None:
        self.root, self.owner = root, owner
        self.path: str | None = None
        self.fd = -1

    def __enter__(self) -> ParentFolder:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def at(self, path: str) -> int:
        if path != self.path:
            self.close()
            parts = path.split("/") if path else []
            with opened_inside_dirs(self.root, parts, create=True, owner=self.owner) as fd:
                self.fd, self.path = os.dup(fd), path
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.path = -1, None


def keep(
    dir_fd: int, name: str, info: os.stat_result, entry: FileEntry, known: Known, *, owner: int | None
) -> Known:
    """A file that already holds the entry's bytes, with the entry's mode and owner (a chmod or
    chown changes its ctime: the record is taken again)."""
    if stat.S_IMODE(info.st_mode) == entry.mode and (owner is None or info.st_uid == owner):
        return known
    fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, entry.mode)
        if owner is not None:
            os.fchown(fd, owner, owner)
        return Known.of(os.fstat(fd), known.sha256)
    finally:
        os.close(fd)


def own(fd: int, info: os.stat_result, owner: int | None) -> None:
    """A folder of the workspace: the sandbox's, with no setuid or setgid bit."""
    if stat.S_IMODE(info.st_mode) & (stat.S_ISUID | stat.S_ISGID):
        os.fchmod(fd, stat.S_IMODE(info.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
    if owner is not None and info.st_uid != owner:
        os.fchown(fd, owner, owner)


def parents_of(path: str) -> Iterator[str]:
    parts = path.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        yield "/".join(parts[:depth])


def remove_folder(folder: Path, relative: str) -> None:
    """A folder no version file lives in, and all below it (at any depth)."""
    *parents, name = relative.split("/")
    with (
        contextlib.suppress(FileNotFoundError, NotADirectoryError),
        opened_inside_dirs(folder, parents) as fd,
    ):
        empty_folder(fd, name)
        os.rmdir(name, dir_fd=fd)


@contextlib.contextmanager
def opened_inside_dirs(
    folder: Path, parts: list[str], *, create: bool = False, owner: int | None = None
) -> Iterator[int]:
    """An fd of the folder at `folder/parts`, never through a link (with `create`, missing folders
    are made, owned by `owner`, and anything else in their place removed)."""
    with opened_dir(folder) as top:
        fd = os.dup(top)
    try:
        for part in parts:
            if create:
                ensure_dir(fd, part)
            child = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            if create:
                own(fd, os.fstat(fd), owner)
        yield fd
    finally:
        os.close(fd)


def write(parent: int, name: str, entry: FileEntry, objects: WorkspaceObjects, owner: int | None) -> Known:
    """One manifest file, written in the open folder `parent` from the store's bytes, with its
    mode and mtime."""
    clear_name(parent, name)
    fd = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=parent)
    try:
        with objects.opened(entry.sha256) as source:
            while chunk := source.read(COPY_CHUNK):
                write_all(fd, chunk)
        os.fchmod(fd, entry.mode)
        if owner is not None:
            os.fchown(fd, owner, owner)
        os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
        return Known.of(os.fstat(fd), entry.sha256)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def clear_name(parent: int, name: str) -> None:
    """Nothing left where a file is to be written (a folder of that name goes, with its tree)."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        empty_folder(parent, name)
        os.rmdir(name, dir_fd=parent)
    else:
        os.unlink(name, dir_fd=parent)


def capture(
    folder: Path,
    baseline: Baseline,
    objects: WorkspaceObjects,
    max_files: int,
    *,
    room: Room = no_quota,
    counted: frozenset[str] = frozenset(),
) -> Captured:
    """The manifest of what `folder` holds now, storing every file not known unchanged. `room`
    says why storing that many bytes is refused (OverQuota, and nothing is stored); files in
    `counted` (the Run's artifacts, which the quotas count already) are left out of it."""
    entries: dict[str, FileEntry] = {}
    known: Baseline = {}
    changed: list[tuple[str, int]] = []  # relative path, mode
    bound = CaptureBound(max_files)
    for _fd, _name, info, relative in walk(folder):
        if not stat.S_ISREG(info.st_mode) or relative in WORKSPACE_DIRS or not bound.keeps(relative):
            continue  # a file where a layout folder belongs goes at the next lease, as ever
        if not bound.takes(relative):
            break
        mode = stat.S_IMODE(info.st_mode) & MODE_BITS
        record = baseline.get(relative)
        if record is not None and record.holds(info):
            known[relative] = record
            entries[relative] = FileEntry(relative, record.size, mode, record.sha256, record.mtime_ns)
        else:
            changed.append((relative, mode))
    bound.report()
    adding = sum(size_of(folder, relative) for relative, _mode in changed if relative not in counted)
    refusal = room(adding) if adding else None
    if refusal is not None:
        raise OverQuota(refusal)
    added = 0
    for relative, mode in changed:
        record = store_file(folder, relative, objects)
        if record is None:
            continue  # gone, or no longer a regular file
        known[relative] = record
        added += 0 if relative in counted else record.size
        entries[relative] = FileEntry(relative, record.size, mode, record.sha256, record.mtime_ns)
    return Captured(Manifest.of(entries.values()), added, known)


def size_of(folder: Path, relative: str) -> int:
    """A file's length, as it would be stored (0 if it is gone)."""
    try:
        with opened_inside(folder, relative.split("/")) as (_fd, info):
            return info.st_size
    except (FileNotFoundError, NotADirectoryError):
        return 0


def store_file(folder: Path, relative: str, objects: WorkspaceObjects) -> Known | None:
    try:
        with opened_inside(folder, relative.split("/")) as (fd, before):
            if not stat.S_ISREG(before.st_mode):
                return None
            with os.fdopen(os.dup(fd), "rb") as handle:
                sha256, size = objects.store(handle)
            after = os.fstat(fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if after.st_size != size or not Known.of(before, sha256).holds(after):
        # It changed while it was read: stored as read, and hashed again next time.
        return Known(size, after.st_mtime_ns, -1, after.st_ino, sha256)
    return Known.of(after, sha256)


class VersionedFolders:
    """This worker's workspace folders and what it knows of each: what leases sync and capture
    through. A record outlives its lease (the folder's next Run here starts from it), and is
    checked file by file before it is trusted."""

    def __init__(self, objects: WorkspaceObjects, max_files: int) -> None:
        self.objects = objects
        self.max_files = max_files
        self._known: dict[Path, Baseline] = {}
        self._lock = threading.Lock()

    def materialise(self, folder: Path, manifest: Manifest, owner: int | None) -> Baseline:
        with self._lock:
            baseline = self._known.pop(folder, {})  # none while a lease holds the folder
        return materialise(folder, manifest, baseline, self.objects, owner)

    def capture(self, folder: Path, baseline: Baseline, room: Room, counted: frozenset[str]) -> Captured:
        return capture(folder, baseline, self.objects, self.max_files, room=room, counted=counted)

    def remember(self, folder: Path, baseline: Baseline) -> None:
        with self._lock:
            self._known[folder] = baseline
