"""Workspace versions in the database: the latest one a Run starts from, one a reader asks for,
and the new one a Run's commit records (fleet_shared.manifests says what a version is)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import (
    ColumnElement,
    String,
    and_,
    delete,
    exists,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db.models import Session, Workspace, WorkspaceManifest, WorkspaceVersion, utcnow
from fleet_shared.manifests import EMPTY, Manifest, ManifestCache, WorkspaceState, manifest_sha256


class WorkspaceChange(msgspec.Struct, frozen=True, kw_only=True):
    """What a Run's commit records of its workspace: the version it read, and what it left."""

    workspace_id: str
    seen_version: int
    manifest: Manifest
    added_bytes: int = 0  # what the Run put in the store for it
    seen_manifest_sha256: str | None = None  # the manifest of the version the Run read
    manifest_sha256: str = ""  # the manifest's own (computed from it when empty)
    # How many versions the commit leaves (storage.workspace_versions_kept); None keeps all.
    versions_kept: int | None = None


def session_state_on(
    db: OrmSession, session_id: str, cache: ManifestCache[Manifest] | None = None
) -> tuple[Session, WorkspaceState] | None:
    """A session and its workspace's latest committed version, with that version's manifest (a
    Run's claim reads them on its way to the first cell): one statement, and one more for the
    manifest's entries unless `cache` holds it already."""
    latest = and_(
        WorkspaceVersion.workspace_id == Workspace.id, WorkspaceVersion.version == Workspace.version
    )
    row = db.execute(
        select(Session, Workspace.version, WorkspaceVersion.manifest_sha256)
        .join(Workspace, Workspace.id == Session.workspace_id)
        .outerjoin(WorkspaceVersion, latest)
        .where(Session.id == session_id)
    ).one_or_none()
    if row is None:
        return None
    session, version, sha256 = row
    manifest = EMPTY
    if sha256 is not None:
        cached = cache.get(sha256) if cache is not None else None
        if cached is None:
            entries = db.scalar(select(WorkspaceManifest.entries).where(WorkspaceManifest.sha256 == sha256))
            cached = Manifest.decode(entries) if entries is not None else EMPTY
            if cache is not None and entries is not None:
                cache.put(sha256, cached)
        manifest = cached
    state = WorkspaceState(
        workspace_id=session.workspace_id, version=version, manifest=manifest, manifest_sha256=sha256
    )
    return session, state


async def version_row(
    db: AsyncSession, workspace_id: str, *, version: int | None = None, run_id: str | None = None
) -> WorkspaceVersion | None:
    """One version of the workspace: the one numbered `version`, the one `run_id` left, or (with
    neither) the latest."""
    query = select(WorkspaceVersion).where(WorkspaceVersion.workspace_id == workspace_id)
    if version is not None:
        query = query.where(WorkspaceVersion.version == version)
    elif run_id is not None:
        query = query.where(WorkspaceVersion.run_id == run_id)
    else:
        latest = select(Workspace.version).where(Workspace.id == workspace_id).scalar_subquery()
        query = query.where(WorkspaceVersion.version == latest)
    row: WorkspaceVersion | None = await db.scalar(query)
    return row


def record_on(db: OrmSession, change: WorkspaceChange, run_id: str | None) -> bool:
    """The next version, in the caller's transaction, only over the version the Run read: a
    stale version never overwrites a newer one (False, and nothing is recorded)."""
    moved = db.execute(
        update(Workspace)
        .where(Workspace.id == change.workspace_id, Workspace.version == change.seen_version)
        .values(version=change.seen_version + 1)
    )
    if moved.rowcount != 1:  # type: ignore[attr-defined]
        return False
    sha256 = change.manifest_sha256 or change.manifest.sha256
    if sha256 == change.seen_manifest_sha256:
        renew_manifest_on(db, sha256)  # unchanged: renewed, not sent again
    else:
        add_manifest_on(db, change.manifest)
    db.add(
        WorkspaceVersion(
            workspace_id=change.workspace_id,
            version=change.seen_version + 1,
            manifest_sha256=sha256,
            run_id=run_id,
            added_bytes=change.added_bytes,
            created_at=utcnow(),
        )
    )
    if change.versions_kept is not None:
        db.flush()  # the new version first: with one version kept it is the oldest one kept
        newest, kept = change.seen_version + 1, change.versions_kept
        drop_old_versions_on(db, change.workspace_id, newest=newest, kept=kept)
    return True


def add_manifest_on(db: OrmSession, manifest: Manifest) -> str:
    """The manifest's row, unless one with its sha256 is there already (the same content): then
    its `created_at` is renewed, which locks the row until the caller's commit, so a gc that
    found it unreferenced and old leaves it (see manifest_unreferenced)."""
    encoded = manifest.encode()
    sha256 = manifest_sha256(encoded)
    values: dict[str, Any] = {
        "sha256": sha256,
        "file_count": len(manifest.entries),
        "byte_size": manifest.byte_size,
        "entries": encoded.decode(),
        "created_at": utcnow(),
    }
    dialect = db.get_bind().dialect.name
    insert = postgresql_insert if dialect == "postgresql" else sqlite_insert
    statement = insert(WorkspaceManifest).values(**values)
    db.execute(
        statement.on_conflict_do_update(
            index_elements=["sha256"], set_={"created_at": statement.excluded.created_at}
        )
    )
    return sha256


class VersionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One version as a listing shows it: its number, the Run that left it, and its size."""

    version: int
    run_id: str | None
    created_at: datetime
    file_count: int
    byte_size: int


async def version_page(
    db: AsyncSession, workspace_id: str, *, before_version: int | None, limit: int
) -> list[VersionSummary]:
    """The workspace's versions below `before_version` (all, without it), newest first."""
    query = (
        select(
            WorkspaceVersion.version,
            WorkspaceVersion.run_id,
            WorkspaceVersion.created_at,
            WorkspaceManifest.file_count,
            WorkspaceManifest.byte_size,
        )
        .join(WorkspaceManifest, WorkspaceManifest.sha256 == WorkspaceVersion.manifest_sha256)
        .where(WorkspaceVersion.workspace_id == workspace_id)
        .order_by(WorkspaceVersion.version.desc())
        .limit(limit)
    )
    if before_version is not None:
        query = query.where(WorkspaceVersion.version < before_version)
    rows = await db.execute(query)
    return [
        VersionSummary(version=v, run_id=r, created_at=c, file_count=f, byte_size=b) for v, r, c, f, b in rows
    ]


def copy_versions_on(db: OrmSession, source_id: str, target_id: str, up_to: int) -> None:
    """A fork's versions: the source's first `up_to`, same numbers, manifests and Runs, in the
    caller's transaction. Rows only: the manifests and their objects are shared. The copies
    count the bytes their originals count: each session's quota counts what it refers to, and
    a fork outlives its parent's versions (retention, the parent's deletion) with nothing
    uncounted. The deployment's total counts shared bytes once per session, never less."""
    copied = select(
        literal(target_id, String),
        WorkspaceVersion.version,
        WorkspaceVersion.manifest_sha256,
        WorkspaceVersion.run_id,
        WorkspaceVersion.added_bytes,
        WorkspaceVersion.created_at,
    ).where(WorkspaceVersion.workspace_id == source_id, WorkspaceVersion.version <= up_to)
    columns = ["workspace_id", "version", "manifest_sha256", "run_id", "added_bytes", "created_at"]
    db.execute(insert(WorkspaceVersion).from_select(columns, copied))


def drop_old_versions_on(db: OrmSession, workspace_id: str, *, newest: int, kept: int) -> int:
    """Delete the rows of the workspace's versions older than its `kept` newest, in the caller's
    transaction; how many went. Their objects stay until gc finds nothing refers to them.

    The quotas count each version's `added_bytes`. The oldest version kept takes over what the
    dropped ones counted, capped at its own whole size: the bytes it refers to were added by
    it or by versions before it, so every byte a kept version refers to stays counted, and
    what only dropped versions referred to stops counting."""
    last_dropped = newest - kept
    if last_dropped < 1:
        return 0
    dropped = (
        db.execute(
            delete(WorkspaceVersion)
            .where(WorkspaceVersion.workspace_id == workspace_id, WorkspaceVersion.version <= last_dropped)
            .returning(WorkspaceVersion.added_bytes)
            .execution_options(synchronize_session=False)
        )
        .scalars()
        .all()
    )
    if not dropped:
        return 0
    oldest_kept = (
        WorkspaceVersion.workspace_id == workspace_id,
        WorkspaceVersion.version == last_dropped + 1,
    )
    oldest = db.execute(
        select(WorkspaceVersion.added_bytes, WorkspaceManifest.byte_size)
        .join(WorkspaceManifest, WorkspaceManifest.sha256 == WorkspaceVersion.manifest_sha256)
        .where(*oldest_kept)
    ).one_or_none()
    if oldest is not None:
        counted = min(oldest.added_bytes + sum(dropped), oldest.byte_size)
        db.execute(
            update(WorkspaceVersion)
            .where(*oldest_kept)
            .values(added_bytes=counted)
            .execution_options(synchronize_session=False)
        )
    return len(dropped)


def renew_manifest_on(db: OrmSession, sha256: str) -> bool:
    """Mark an existing manifest as just recorded, in the caller's transaction (False: there is
    none). Whoever makes a new version point at a manifest it did not add (a fork) calls this
    first: like add_manifest_on, it keeps a concurrent gc from removing the row."""
    renewed = db.execute(
        update(WorkspaceManifest).where(WorkspaceManifest.sha256 == sha256).values(created_at=utcnow())
    )
    return bool(renewed.rowcount == 1)  # type: ignore[attr-defined]


def renew_manifests_of_on(db: OrmSession, workspace_id: str, up_to: int) -> None:
    """renew_manifest_on for every manifest the workspace's first `up_to` versions name."""
    named = select(WorkspaceVersion.manifest_sha256).where(
        WorkspaceVersion.workspace_id == workspace_id, WorkspaceVersion.version <= up_to
    )
    db.execute(
        update(WorkspaceManifest).where(WorkspaceManifest.sha256.in_(named)).values(created_at=utcnow())
    )


def manifest_unreferenced(older_than: datetime) -> ColumnElement[bool]:
    """A manifest no version refers to, last recorded before `older_than`: what gc removes. A
    commit that refers to it again renews it first (and locks its row), so a delete guarded by
    this condition leaves it."""
    referenced = exists().where(WorkspaceVersion.manifest_sha256 == WorkspaceManifest.sha256)
    return and_(WorkspaceManifest.created_at < older_than, ~referenced)


async def unreferenced_manifests(
    db: AsyncSession, older_than: datetime, *, after: str, limit: int
) -> list[str]:
    """The next `limit` sha256s (in order, after `after`) of manifests gc may remove."""
    rows = await db.scalars(
        select(WorkspaceManifest.sha256)
        .where(WorkspaceManifest.sha256 > after, manifest_unreferenced(older_than))
        .order_by(WorkspaceManifest.sha256)
        .limit(limit)
    )
    return list(rows.all())


async def delete_manifests(db: AsyncSession, sha256s: Sequence[str], older_than: datetime) -> int:
    """Delete these manifests, each only if it is still unreferenced and old; how many went."""
    result = await db.execute(
        delete(WorkspaceManifest)
        .where(WorkspaceManifest.sha256.in_(sha256s), manifest_unreferenced(older_than))
        .execution_options(synchronize_session=False)
    )
    await db.commit()
    return int(result.rowcount)  # type: ignore[attr-defined]


async def manifest_sizes(
    db: AsyncSession, *, after: str, limit: int, kept_from: datetime | None = None
) -> list[tuple[str, int]]:
    """(sha256, file count) of the next `limit` manifests in order after `after`; with
    `kept_from`, only those a gc with that cutoff keeps."""
    query = select(WorkspaceManifest.sha256, WorkspaceManifest.file_count)
    query = query.where(WorkspaceManifest.sha256 > after)
    if kept_from is not None:
        query = query.where(~manifest_unreferenced(kept_from))
    rows = await db.execute(query.order_by(WorkspaceManifest.sha256).limit(limit))
    return [(sha256, file_count) for sha256, file_count in rows.all()]


async def encoded_manifests(db: AsyncSession, sha256s: Sequence[str]) -> list[str]:
    """The stored encodings of these manifests (those still there)."""
    rows = await db.scalars(select(WorkspaceManifest.entries).where(WorkspaceManifest.sha256.in_(sha256s)))
    return list(rows.all())
