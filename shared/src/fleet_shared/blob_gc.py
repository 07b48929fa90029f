"""Garbage collection: what the blob store and the manifests table hold that nothing refers to.

It removes, in this order:
0. sessions: those idle past `storage.session_ttl_days` are marked deleted, and every deleted
   session without an active Run is purged (fleet_shared.db.purge), which frees what follows;
1. manifest rows no workspace version refers to (versions go when a commit drops the oldest;
   see `storage.workspace_versions_kept`);
2. `workspaces/<sha256>` objects that no remaining manifest names;
3. `attachments/<id>` objects without an attachment row, and `artifacts/<id>` objects without
   an artifact row (an upload whose row insert failed, a Run whose commit did not happen).

Only what was last put (an object) or last recorded (a manifest) before a cutoff goes: an upload
whose commit is still under way is younger than the grace period. A worker puts every file a
Run changed again before the commit that refers to it, renewing the object's age, and a commit
that refers to an existing manifest renews the row (fleet_shared.db.workspace_versions).

Memory: the store is listed a page at a time, and manifests are read in chunks of a bounded
number of entries; what is held whole is the set of referenced contents (a 32-byte digest per
distinct object, about 100 bytes each with the set's own overhead).

Left open: an object that is old and unreferenced when gc checks it (a HEAD just before its
delete) and is put again by a Run in the instant between that HEAD and the delete is removed,
and that Run's commit then refers to a missing object. S3 has no delete conditional on age.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import structlog
from redis.asyncio import Redis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError, RedisError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared import redis_keys
from fleet_shared.blobs import ARTIFACTS, ATTACHMENTS, BlobStore, StoredObject
from fleet_shared.config_file import StorageSection
from fleet_shared.db import purge, workspace_versions
from fleet_shared.db.models import Artifact, Attachment
from fleet_shared.ids import parse_uuid
from fleet_shared.manifests import OBJECT_PREFIX

log = structlog.get_logger(__name__)
MANIFEST_PAGE = 1000  # manifest ids read (or deleted) per query
ENTRIES_PER_CHUNK = 100_000  # manifest entries decoded at once (one manifest may hold more)
DELETES_AT_ONCE = 16
LOCK_SECONDS = 60.0  # the gc lock's TTL; renewed every third of it while the gc runs
JITTER = 0.2  # a worker's scheduled gc waits its interval, give or take this share
QUIET_SHARE = 0.75  # after a gc, no scheduled one starts for this share of the interval
SHA256_HEX = 64

# Only the digest of each entry is needed: a manifest entry is [path, size, mode, sha256, mtime].
DIGESTS = msgspec.json.Decoder(list[tuple[Any, Any, Any, str, Any]])


@dataclass
class Removed:
    count: int = 0
    bytes: int = 0

    def add(self, size: int) -> None:
        self.count += 1
        self.bytes += size


@dataclass
class Collected:
    """What one gc removed (or, in a dry run, would remove)."""

    dry_run: bool
    sessions_expired: int = 0  # idle past storage.session_ttl_days (marked deleted)
    sessions: int = 0  # deleted sessions purged
    manifests: int = 0
    workspace_objects: Removed = field(default_factory=Removed)
    attachments: Removed = field(default_factory=Removed)
    artifacts: Removed = field(default_factory=Removed)
    unknown_keys: int = 0  # objects under our prefixes whose names we do not make: left alone
    finished: bool = True  # False: stopped before the end (shutdown, or the lock was lost)

    @property
    def freed_bytes(self) -> int:
        return self.workspace_objects.bytes + self.attachments.bytes + self.artifacts.bytes

    def summary(self) -> dict[str, Any]:
        """The figures, for a log line or a JSON report."""
        return {
            "dry_run": self.dry_run,
            "finished": self.finished,
            "sessions_expired": self.sessions_expired,
            "sessions": self.sessions,
            "manifests": self.manifests,
            "workspace_objects": self.workspace_objects.count,
            "workspace_bytes": self.workspace_objects.bytes,
            "attachments": self.attachments.count,
            "attachment_bytes": self.attachments.bytes,
            "artifacts": self.artifacts.count,
            "artifact_bytes": self.artifacts.bytes,
            "freed_bytes": self.freed_bytes,
            "unknown_keys": self.unknown_keys,
        }


# Told of each thing removed (or to remove, in a dry run): a key or `manifest <sha256>`, a size.
Listener = Callable[[str, int], None]


class Stopped(Exception):
    """The gc was asked to stop between two units of work."""


class Collector:
    def __init__(
        self,
        db_sessions: async_sessionmaker[AsyncSession],
        blobs: BlobStore,
        *,
        older_than: datetime,
        dry_run: bool = False,
        on_removed: Listener | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        session_ttl: timedelta | None = None,
        redis: Redis | None = None,
    ) -> None:
        self.db_sessions = db_sessions
        self.blobs = blobs
        self.session_ttl = session_ttl  # None: sessions never expire
        self.redis = redis  # for a purged Run's keys (without it they expire on their own)
        self.older_than = older_than
        self.on_removed = on_removed or (lambda key, size: None)
        self.should_stop = should_stop
        self.collected = Collected(dry_run=dry_run)
        self.deletes = asyncio.Semaphore(DELETES_AT_ONCE)

    async def run(self) -> Collected:
        """One whole gc; what it removed. Stops early (finished=False) when asked to."""
        try:
            await self.remove_sessions()
            await self.drop_manifests()
            referenced = await self.referenced_contents()
            await self.sweep_workspace_objects(referenced)
            referenced.clear()
            await self.sweep_rowed(ATTACHMENTS, Attachment, self.collected.attachments)
            await self.sweep_rowed(ARTIFACTS, Artifact, self.collected.artifacts)
        except Stopped:
            self.collected.finished = False
        return self.collected

    def check_stop(self) -> None:
        if self.should_stop():
            raise Stopped

    async def remove_sessions(self) -> None:
        """Expire idle sessions, then purge the deleted ones (a dry run only counts them)."""
        expired, purged = await purge.sweep_sessions(
            self.db_sessions,
            self.redis,
            self.blobs,
            ttl=self.session_ttl,
            dry_run=self.collected.dry_run,
            check_stop=self.check_stop,
        )
        self.collected.sessions_expired, self.collected.sessions = expired, purged

    async def drop_manifests(self) -> None:
        after = ""
        while page := await self.unreferenced_manifests(after):
            after = page[-1]
            if not self.collected.dry_run:
                self.collected.manifests += await self.delete_manifests(page)
                continue
            self.collected.manifests += len(page)
            for sha256 in page:
                self.on_removed(f"manifest {sha256}", 0)

    async def unreferenced_manifests(self, after: str) -> list[str]:
        self.check_stop()
        async with self.db_sessions() as db:
            return await workspace_versions.unreferenced_manifests(
                db, self.older_than, after=after, limit=MANIFEST_PAGE
            )

    async def delete_manifests(self, sha256s: list[str]) -> int:
        async with self.db_sessions() as db:
            try:
                return await workspace_versions.delete_manifests(db, sha256s, self.older_than)
            except IntegrityError:  # a version came to refer to one meanwhile: the next gc's
                await db.rollback()
                log.info("gc.manifests_in_use", count=len(sha256s))
                return 0

    async def referenced_contents(self) -> set[bytes]:
        """The digests of every object a manifest gc keeps names, read in bounded chunks. A dry
        run leaves the manifests it would remove, so it leaves them out here."""
        referenced: set[bytes] = set()
        kept_from = self.older_than if self.collected.dry_run else None
        after = ""
        while True:
            self.check_stop()
            async with self.db_sessions() as db:
                page = await workspace_versions.manifest_sizes(
                    db, after=after, limit=MANIFEST_PAGE, kept_from=kept_from
                )
            if not page:
                return referenced
            after = page[-1][0]
            for chunk in chunks_of_entries(page):
                async with self.db_sessions() as db:
                    encoded = await workspace_versions.encoded_manifests(db, chunk)
                # Decoding is CPU work: off the event loop, which a worker shares with its Turns.
                await asyncio.to_thread(add_digests, referenced, encoded)
                del encoded

    async def sweep_workspace_objects(self, referenced: set[bytes]) -> None:
        async for page in self.blobs.listing(OBJECT_PREFIX):
            self.check_stop()
            doomed = []
            for stored in page:
                digest = digest_of(stored.key[len(OBJECT_PREFIX) :])
                if digest is None:
                    self.collected.unknown_keys += 1
                elif stored.last_modified < self.older_than and digest not in referenced:
                    doomed.append(stored)
            await self.remove(doomed, self.collected.workspace_objects)

    async def sweep_rowed(self, prefix: str, model: type[Attachment] | type[Artifact], into: Removed) -> None:
        """Objects `<prefix><id>` whose row is not there (nor was, for the old enough)."""
        async for page in self.blobs.listing(prefix):
            self.check_stop()
            old: dict[str, StoredObject] = {}
            for stored in page:
                object_id = stored.key[len(prefix) :]
                if parse_uuid(object_id) != object_id:
                    self.collected.unknown_keys += 1
                elif stored.last_modified < self.older_than:
                    old[object_id] = stored
            if not old:
                continue
            async with self.db_sessions() as db:
                rows = await db.scalars(select(model.id).where(model.id.in_(list(old))))
                recorded = set(rows.all())
            await self.remove([s for i, s in old.items() if i not in recorded], into)

    async def remove(self, doomed: Sequence[StoredObject], into: Removed) -> None:
        if self.collected.dry_run:
            for stored in doomed:
                into.add(stored.size)
                self.on_removed(stored.key, stored.size)
            return

        async def one(stored: StoredObject) -> None:
            async with self.deletes:
                if await self.blobs.delete_if_older(stored.key, self.older_than):
                    into.add(stored.size)
                    self.on_removed(stored.key, stored.size)

        await asyncio.gather(*(one(stored) for stored in doomed))


async def collect_once(
    redis: Redis | None,
    queue: str,
    collector: Collector,
) -> Collected | None:
    """Run `collector` as the deployment's one gc: under a Redis lock (redis-py's, with a TTL
    renewed while it runs), or None at once when another gc holds it. Without Redis (`fleet gc
    --no-lock`) it just runs. A lock lost midway (Redis lost it, or this process stalled past
    its TTL) stops the gc at its next page."""
    if redis is None:
        return await finished(collector)
    lock = Lock(redis, redis_keys.gc_lock(queue), timeout=LOCK_SECONDS, blocking=False, thread_local=False)
    if not await lock.acquire():
        log.info("gc.busy", detail="another gc holds the lock")
        return None
    lost = asyncio.Event()
    earlier = collector.should_stop
    collector.should_stop = lambda: lost.is_set() or earlier()
    keeper = asyncio.create_task(keep_lock(lock, lost), name="fleet-gc-lock")
    try:
        return await finished(collector)
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        with contextlib.suppress(LockError, RedisError, OSError):
            await lock.release()


async def keep_lock(lock: Lock, lost: asyncio.Event) -> None:
    while True:
        await asyncio.sleep(LOCK_SECONDS / 3)
        try:
            await lock.reacquire()
        except (LockError, RedisError, OSError) as exc:
            log.warning("gc.lock_lost", error_type=type(exc).__name__)
            lost.set()
            return


async def finished(collector: Collector) -> Collected:
    collected = await collector.run()
    log.info("gc.finished", **collected.summary())
    return collected


async def collect_on_schedule(
    redis: Redis,
    db_sessions: async_sessionmaker[AsyncSession],
    blobs: BlobStore,
    *,
    queue: str,
    storage: StorageSection,
    stopping: asyncio.Event,
) -> None:
    """A worker's gc: every `gc_interval_seconds` (with jitter, so workers do not all ask at
    once) it offers to run one; the lock makes it one at a time across the deployment, and a
    gc finished recently (by any worker) makes the others skip their turn."""
    interval = storage.gc_interval_seconds
    while not stopping.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), interval * random.uniform(1 - JITTER, 1 + JITTER))
        if stopping.is_set():
            return
        try:
            if await redis.exists(redis_keys.gc_done(queue)):
                continue
            older_than = datetime.now(UTC) - timedelta(seconds=storage.gc_grace_seconds)
            collector = Collector(
                db_sessions,
                blobs,
                older_than=older_than,
                should_stop=stopping.is_set,
                session_ttl=session_ttl(storage),
                redis=redis,
            )
            collected = await collect_once(redis, queue, collector)
            if collected is not None and collected.finished:
                quiet = max(1, int(interval * QUIET_SHARE))
                await redis.set(redis_keys.gc_done(queue), "1", ex=quiet)
        except Exception as exc:  # never die: the next turn tries again
            log.warning("gc.failed", error_type=type(exc).__name__, error=str(exc))


def session_ttl(storage: StorageSection) -> timedelta | None:
    return timedelta(days=storage.session_ttl_days) if storage.session_ttl_days else None


def add_digests(referenced: set[bytes], encoded: Sequence[str]) -> None:
    for entries in encoded:
        referenced.update(bytes.fromhex(entry[3]) for entry in DIGESTS.decode(entries))


def digest_of(name: str) -> bytes | None:
    """The content digest an object's name says, or None for a name gc never makes."""
    if len(name) != SHA256_HEX or name != name.lower():
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


def chunks_of_entries(page: Sequence[tuple[str, int]]) -> list[list[str]]:
    """The manifests of `page` in chunks of at most ENTRIES_PER_CHUNK entries together (a bigger
    manifest makes a chunk of its own)."""
    chunks: list[list[str]] = []
    current: list[str] = []
    entries = 0
    for sha256, file_count in page:
        if current and entries + file_count > ENTRIES_PER_CHUNK:
            chunks.append(current)
            current, entries = [], 0
        current.append(sha256)
        entries += file_count
    if current:
        chunks.append(current)
    return chunks
