"""A Daytona sandbox's `/workspace` and the session's versions in the store, kept in step.

The store holds every version; a session's sandbox (its own disk, reused by the session's
sequential Turns) is a cache of the latest. At a lease's start `materialise` makes `/workspace`
hold exactly the version the Run starts from, sending only the files the sandbox lacks; at its
end `capture` lists `/workspace` and downloads, hashes and stores only the files that changed.

What the worker knows of a sandbox file is its `Known` record: the size and time the daemon
listed after fleet wrote or read it, and the sha256 of those bytes. A file listed with that size
and time again holds those bytes; anything else is sent again (at a lease's start) or read
again (at its end). A sandbox someone else touched (another worker ran a Turn in it, a Turn
ended without its commit) is so corrected file by file. The SDK cannot set a file's time, so a
version names each file's time as the sandbox lists it: without a record (a worker that
restarted, or the session's last Turn ran on another worker), a file listed with the size and
time its version names was captured so and holds that version's bytes; every other file is
sent again.

Worst case: the SDK lists no inode or change time. A file rewritten with the same size while
keeping its time (a program that restores times: `cp -p`, `tar`, `os.utime`) is taken as
unchanged, and its new bytes are not kept.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from daytona import DaytonaNotFoundError, FileUpload

from fleet_shared.manifests import WORKSPACE_DIRS, CaptureBound, FileEntry, Manifest
from fleet_worker.sandbox.daytona.files import DaytonaWorkspaceFiles, RemoteReader
from fleet_worker.sandbox.daytona.listing import Listed, plain_name, walk
from fleet_worker.sandbox.errors import SandboxError
from fleet_worker.sandbox.provider import Captured, OverQuota, Room, no_quota
from fleet_worker.sandbox.sync import parents_of
from fleet_worker.workspace_objects import WorkspaceObjects

log = structlog.get_logger(__name__)
SMALL_FILE = 1 << 20  # sent in memory, many to one request; a larger file is streamed alone
BATCH_BYTES = 16 << 20
BATCH_FILES = 256
UPLOAD_TIMEOUT_SECONDS = 1800


@dataclass(frozen=True)
class Known:
    size: int
    stamp: int | None  # the file's time as the daemon listed it; None: to be read again
    sha256: str

    def entry(self, relative: str, mode: int) -> FileEntry:
        """The file as a version names it: with the sandbox's time (0 when unknown), which any
        worker can compare with a listing."""
        return FileEntry(relative, self.size, mode, self.sha256, self.stamp if self.stamp is not None else 0)

    def holds(self, listed: Listed) -> bool:
        same = (listed.size, listed.stamp) == (self.size, self.stamp)
        return same and self.stamp is not None


Record = dict[str, Known]


def holds_entry(listed: Listed, entry: FileEntry, known: Known | None) -> bool:
    """The listed file holds the entry's bytes, as far as sizes and times can tell."""
    if listed.kind != "file" or listed.stamp is None or listed.size != entry.size:
        return False
    if known is not None and known.sha256 == entry.sha256 and known.holds(listed):
        return True
    return listed.stamp == entry.mtime_ns


def materialise(
    files: DaytonaWorkspaceFiles, manifest: Manifest, record: Record, objects: WorkspaceObjects, limit: int
) -> Record:
    """Make the sandbox's workspace hold exactly the manifest's files; what is known of them
    afterwards. Folders no version file lives in go whole, without being walked; a workspace
    with more than `limit` entries besides is emptied and written again."""
    wanted = manifest.by_path()
    needed = {"", *WORKSPACE_DIRS, *(parent for path in wanted for parent in parents_of(path))}
    bound = limit + len(wanted) + len(needed)
    listed: dict[str, Listed] = {}
    for item in walk(files.sandbox, files.root, descend=needed.__contains__):
        if len(listed) >= bound:
            log.warning("daytona.workspace_reset", entries=bound)
            files.sandbox.fs.delete_file(files.root, recursive=True)
            listed = {}
            break
        listed[item.relative] = item
    kept: Record = {}
    for relative, item in listed.items():
        entry = wanted.get(relative)
        if item.kind == "dir" and relative in needed:
            continue
        if entry is not None and holds_entry(item, entry, record.get(relative)):
            kept[relative] = Known(item.size, item.stamp, entry.sha256)
            set_mode(files, item, entry)
            continue
        if entry is None or item.kind != "file":  # a regular file in the way is replaced by the upload
            remove(files, relative, recursive=item.kind == "dir")
    missing = [entry for entry in manifest.entries if entry.path not in kept]
    upload(files, missing, objects)
    kept.update(recorded(files, missing))
    return kept


def remote_path(files: DaytonaWorkspaceFiles, relative: str) -> str:
    """Where a workspace file is in the sandbox. Its names were listed one by one (or come from
    a manifest made so), and each is checked again to be one plain component."""
    parts = relative.split("/")
    if not all(plain_name(part) for part in parts):
        raise SandboxError(f"not a workspace path: {relative!r}")
    return "/".join([files.root, *parts])


def set_mode(files: DaytonaWorkspaceFiles, item: Listed, entry: FileEntry) -> None:
    if item.mode != entry.mode:
        files.sandbox.fs.set_file_permissions(remote_path(files, entry.path), mode=f"{entry.mode:o}")


def remove(files: DaytonaWorkspaceFiles, relative: str, *, recursive: bool) -> None:
    with contextlib.suppress(DaytonaNotFoundError):  # gone already
        files.sandbox.fs.delete_file(remote_path(files, relative), recursive=recursive)


def upload(files: DaytonaWorkspaceFiles, entries: Iterable[FileEntry], objects: WorkspaceObjects) -> None:
    """The entries' bytes from the store, small files many to a request, large ones streamed."""
    batch: list[FileUpload] = []
    batched = 0
    for entry in entries:
        with objects.opened(entry.sha256) as source:
            if entry.size > SMALL_FILE:
                remote = remote_path(files, entry.path)
                files.sandbox.fs.upload_file_stream(source, remote, timeout=UPLOAD_TIMEOUT_SECONDS)
                continue
            data = source.read()
        batch.append(FileUpload(source=data, destination=remote_path(files, entry.path)))
        batched += len(data)
        if batched >= BATCH_BYTES or len(batch) >= BATCH_FILES:
            files.sandbox.fs.upload_files(batch, timeout=UPLOAD_TIMEOUT_SECONDS)
            batch, batched = [], 0
    if batch:
        files.sandbox.fs.upload_files(batch, timeout=UPLOAD_TIMEOUT_SECONDS)


def recorded(files: DaytonaWorkspaceFiles, sent: list[FileEntry]) -> Record:
    """What the daemon lists of the files just sent (their modes set as the version says): one
    listing per folder they went to. A file not listed as sent is left unknown, so the next
    capture reads it."""
    known: Record = {}
    by_folder: dict[str, list[FileEntry]] = {}
    for entry in sent:
        by_folder.setdefault(entry.path.rpartition("/")[0], []).append(entry)
    for folder, entries in by_folder.items():
        base = remote_path(files, folder) if folder else files.root
        listed = {item.relative: item for item in walk(files.sandbox, base, descend=lambda _relative: False)}
        for entry in entries:
            item = listed.get(entry.path.rpartition("/")[2])
            if item is None or item.kind != "file":
                continue
            set_mode(files, item, entry)
            if item.stamp is not None and item.size == entry.size:
                known[entry.path] = Known(item.size, item.stamp, entry.sha256)
    return known


def capture(
    files: DaytonaWorkspaceFiles,
    record: Record,
    objects: WorkspaceObjects,
    max_files: int,
    *,
    room: Room = no_quota,
    counted: frozenset[str] = frozenset(),
) -> Captured:
    """The manifest of what the sandbox's workspace holds now, storing every file not known
    unchanged. `room` says why storing that many bytes is refused (OverQuota, and nothing is
    stored); files in `counted` (the Run's artifacts) are left out of it."""
    entries: dict[str, FileEntry] = {}
    known: Record = {}
    changed: list[Listed] = []
    bound = CaptureBound(max_files)
    for walked, item in enumerate(walk(files.sandbox, files.root), start=1):
        if walked > max_files:  # folders too: each is a request to the daemon
            log.warning("workspace.capture_truncated", files=bound.files, entries_walked=max_files)
            break
        if item.kind != "file" or item.relative in WORKSPACE_DIRS or not bound.keeps(item.relative):
            continue  # a file where a layout folder belongs goes at the next lease
        if not bound.takes(item.relative):
            break
        record_of = record.get(item.relative)
        if record_of is not None and record_of.holds(item):
            known[item.relative] = record_of
            entries[item.relative] = record_of.entry(item.relative, item.mode)
        else:
            changed.append(item)
    bound.report()
    adding = sum(item.size for item in changed if item.relative not in counted)
    refusal = room(adding) if adding else None  # the usage is read only when something is stored
    if refusal is not None:
        raise OverQuota(refusal)
    added = 0
    for item in changed:
        stored = store_file(files, item, objects)
        if stored is None:  # gone, or still being written: as the last version had it
            if (previous := record.get(item.relative)) is not None:
                known[item.relative] = previous
                entries[item.relative] = previous.entry(item.relative, item.mode)
            continue
        known[item.relative] = stored
        added += 0 if item.relative in counted else stored.size
        entries[item.relative] = stored.entry(item.relative, item.mode)
    return Captured(Manifest.of(entries.values()), added, known)


def store_file(files: DaytonaWorkspaceFiles, item: Listed, objects: WorkspaceObjects) -> Known | None:
    """One changed file, downloaded into the store; None when it is gone, or grew past its
    listed size while it was read (a writer still at work: the next capture reads it)."""
    try:
        with RemoteReader(files.sandbox, remote_path(files, item.relative), item.size, item.size) as reader:
            sha256, size = objects.store(reader)
    except DaytonaNotFoundError:
        return None
    except ValueError:
        log.warning("daytona.capture_still_growing", path=item.relative)
        return None
    return Known(size, item.stamp if size == item.size else None, sha256)  # None: it changed while read


class DaytonaVersions:
    """This worker's records of the session sandboxes it synced: what leases materialise and
    capture through. A record outlives its lease (the sandbox's next Run here starts from it),
    and is checked file by file against the daemon's listing before it is trusted."""

    def __init__(self, objects: WorkspaceObjects, max_files: int) -> None:
        self.objects = objects
        self.max_files = max_files
        self._known: dict[str, Record] = {}
        self._lock = threading.Lock()

    def materialise(self, files: DaytonaWorkspaceFiles, manifest: Manifest) -> Record:
        with self._lock:
            record = self._known.pop(sandbox_key(files.sandbox), {})  # none while a lease holds it
        return materialise(files, manifest, record, self.objects, self.max_files)

    def capture(
        self, files: DaytonaWorkspaceFiles, record: Record, room: Room, counted: frozenset[str]
    ) -> Captured:
        return capture(files, record, self.objects, self.max_files, room=room, counted=counted)

    def remember(self, sandbox: Any, record: Record) -> None:
        with self._lock:
            self._known[sandbox_key(sandbox)] = record

    def forget(self, sandbox: Any) -> None:
        with self._lock:
            self._known.pop(sandbox_key(sandbox), None)


def sandbox_key(sandbox: Any) -> str:
    return str(sandbox.id)
