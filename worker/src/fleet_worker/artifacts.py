"""Artifacts: what a Run leaves under `/workspace/artifacts/`, kept at settlement.

Each regular file whose stamp (size, mtime) moved during the Run is copied out (no link
followed, size-capped, hashed on the way). One whose content is what the session last stored
under its name is dropped: touching a file, or writing the same bytes again, stores nothing and
announces nothing. The others are stored as `artifacts/<id>` in the blob store within the
session's and the deployment's quotas (fleet_shared.db.files), and announced with
`data-artifact`; the rows are written by the same commit as the Turn (from those events). What
comes out of a sandbox is hostile: names are workspace-relative and checked, sizes are capped
while copying, and a file refused by a quota is never copied when its stamp already says so.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import mimetypes
import tempfile
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.blobs import BlobStore, artifact_key
from fleet_shared.config_file import QuotaLimits, StorageSection
from fleet_shared.db.files import (
    StorageQuota,
    StoredBytes,
    latest_checksums_on,
    quota_refusal,
    stored_bytes_on,
)
from fleet_shared.events import ArtifactCreated, RunWarning
from fleet_shared.ids import new_id
from fleet_worker.publisher import EventSink
from fleet_worker.sandbox.provider import FileStamp, SandboxLease
from fleet_worker.settlement import run_whole_with_retry

ARTIFACTS = "artifacts"
MAX_NAME_CHARS = 1024
NAMES_SHOWN = 5  # of the files a quota refused, in its warning


@dataclass(frozen=True)
class ArtifactLimits:
    max_count: int
    max_bytes: int
    quota: StorageQuota

    @classmethod
    def of(cls, storage: StorageSection, tenant: QuotaLimits | None = None) -> ArtifactLimits:
        quota = StorageQuota.of(storage, tenant)
        return cls(storage.max_artifacts_per_run, storage.max_artifact_mb * 2**20, quota)


@dataclass
class Stored:
    """What the session holds already: the checksum last stored under each name, and the bytes
    the quotas count (this Run's stored artifacts added as they are stored)."""

    checksums: dict[str, str]
    usage: StoredBytes


@dataclass(frozen=True)
class Copied:
    size: int
    sha256: str


class HashingSink:
    """A file that hashes what is written to it."""

    def __init__(self, target: IO[bytes]) -> None:
        self.target = target
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.target.write(data)


def stamp_limit(max_count: int) -> int:
    """How many files of artifacts/ are looked at: enough to see past a few thousand old ones."""
    return 10 * max_count + 1000


def changed_files(before: dict[str, FileStamp], after: dict[str, FileStamp]) -> list[str]:
    """Files that are new or different since the Run began, in name order."""
    return sorted(name for name, stamp in after.items() if before.get(name) != stamp)


async def collect_artifacts(
    *,
    db_sessions: async_sessionmaker[AsyncSession],
    blobs: BlobStore,
    executor: Executor,
    lease: SandboxLease,
    before: dict[str, FileStamp],
    session_id: str,
    limits: ArtifactLimits,
    sink: EventSink,
    deadline: float,
) -> None:
    """Store what the Run wrote under `artifacts/` and announce each file. The session's stored
    checksums and usage are read first (retried through a database outage until `deadline`)."""
    loop = asyncio.get_running_loop()
    changed = await loop.run_in_executor(executor, changed_stamps, lease, before, limits, sink)
    if not changed:
        return
    read = functools.partial(stored_on, session_id=session_id, names=list(changed))
    stored = await run_whole_with_retry(db_sessions, read, deadline=deadline, what="artifacts_read")
    keeper = Keeper(blobs, lease, stored, limits, sink)
    await loop.run_in_executor(executor, keeper.store_changed, changed)


def changed_stamps(
    lease: SandboxLease, before: dict[str, FileStamp], limits: ArtifactLimits, sink: EventSink
) -> dict[str, FileStamp]:
    """The files whose stamp moved during the Run, in name order, at most `max_count` of them
    (a warning names the limit when there were more); blocking."""
    after = lease.files.stamps(ARTIFACTS, stamp_limit(limits.max_count) + len(before))
    names = [n for n in changed_files(before, after) if len(n) <= MAX_NAME_CHARS]
    if len(names) > limits.max_count:
        message = (
            f"the Run wrote {len(names)} files under artifacts/; only the first {limits.max_count} "
            "were kept (storage.max_artifacts_per_run)"
        )
        truncated = RunWarning(run_id=sink.sequencer.run_id, code="artifacts_truncated", message=message)
        sink.emit_threadsafe(truncated)
        names = names[: limits.max_count]
    return {name: after[name] for name in names}


def stored_on(db: OrmSession, *, session_id: str, names: list[str]) -> Stored:
    """What the session holds already, for `names` (fleet_shared.db.engine.run_whole)."""
    return Stored(latest_checksums_on(db, session_id, names), stored_bytes_on(db, session_id))


class QuotaRefused(Exception):
    """Storing a file would pass a quota; the message says which."""


@dataclass
class Keeper:
    """One Run's collection: where the files come from and go, what the session holds already,
    the limits, and where the announcements go."""

    blobs: BlobStore
    lease: SandboxLease
    stored: Stored
    limits: ArtifactLimits
    sink: EventSink

    def store_changed(self, changed: dict[str, FileStamp]) -> None:
        """Keep each changed file whose content the session does not have yet, within the
        quotas, and announce it (blocking). One warning names what a quota refused."""
        run_id = self.sink.sequencer.run_id
        refused: list[str] = []
        reason = ""
        for name, stamp in changed.items():
            try:
                if name not in self.stored.checksums:  # its stamp may say already: then no copy
                    self.check_quota(stamp.size)
                event = self.keep_one(name)
            except FileNotFoundError:
                continue  # removed (or swapped for a link) since it was seen: nothing to keep
            except ValueError:
                limit = self.limits.max_bytes
                message = f"artifacts/{name} was not kept: larger than {limit} bytes "
                message += " (storage.max_artifact_mb)"
                self.sink.emit_threadsafe(
                    RunWarning(run_id=run_id, code="artifact_too_large", message=message)
                )
                continue
            except QuotaRefused as exc:
                refused.append(name)
                reason = reason or str(exc)
                continue
            if event is not None:
                self.sink.emit_threadsafe(event)
        if refused:
            message = refusal(refused, reason)
            self.sink.emit_threadsafe(
                RunWarning(run_id=run_id, code="storage_quota_exceeded", message=message)
            )

    def check_quota(self, size: int) -> None:
        if why := quota_refusal(self.limits.quota, self.stored.usage, size):
            raise QuotaRefused(why)

    def keep_one(self, name: str) -> ArtifactCreated | None:
        """Copy one file out and store it; None when the session has these bytes under this
        name already. FileNotFoundError (gone, or not a regular file), ValueError (too large)
        or QuotaRefused when it is not kept."""
        with tempfile.NamedTemporaryFile(prefix="fleet-artifact-") as copy:
            copied = copy_out(self.lease, name, self.limits.max_bytes, copy)
            if self.stored.checksums.get(name) == copied.sha256:
                return None
            self.check_quota(copied.size)
            artifact_id = new_id()
            self.blobs.put_file(artifact_key(artifact_id), Path(copy.name))
        self.stored.usage = self.stored.usage.plus(copied.size)
        self.stored.checksums[name] = copied.sha256
        return announcement(self.sink.sequencer.run_id, artifact_id, name, copied)


def copy_out(lease: SandboxLease, name: str, max_bytes: int, target: IO[bytes]) -> Copied:
    """Copy one file out into `target`, hashing it; FileNotFoundError if it is gone or not a
    regular file, ValueError if it is larger than `max_bytes`."""
    hashing = HashingSink(target)
    size = lease.files.export(f"{ARTIFACTS}/{name}", hashing, max_bytes)
    target.flush()
    return Copied(size, hashing.sha256.hexdigest())


def announcement(run_id: str, artifact_id: str, name: str, copied: Copied) -> ArtifactCreated:
    media_type = mimetypes.guess_type(name, strict=False)[0] or "application/octet-stream"
    return ArtifactCreated(
        run_id=run_id,
        artifact_id=artifact_id,
        name=name,
        media_type=media_type,
        byte_size=copied.size,
        checksum_sha256=copied.sha256,
    )


def refusal(names: list[str], reason: str) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    if len(names) > NAMES_SHOWN:
        shown += f" and {len(names) - NAMES_SHOWN} more"
    count = "1 file" if len(names) == 1 else f"{len(names)} files"
    return f"{count} under artifacts/ not kept ({shown}): {reason}"
