"""Workspace versions in the database: the latest one a Run starts from, one a reader asks for,
and the new one a Run's commit records (fleet_shared.manifests says what a version is)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import BigInteger, String, insert, literal, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db.models import Workspace, WorkspaceManifest, WorkspaceVersion, utcnow
from fleet_shared.manifests import EMPTY, Manifest, WorkspaceState


class WorkspaceChange(msgspec.Struct, frozen=True, kw_only=True):
    """What a Run's commit records of its workspace: the version it read, and what it left."""

    workspace_id: str
    seen_version: int
    manifest: Manifest
    added_bytes: int = 0  # what the Run put in the store for it


def state_on(db: OrmSession, workspace_id: str) -> WorkspaceState:
    """The workspace's latest committed version and its manifest."""
    workspace = db.get(Workspace, workspace_id)
    version = workspace.version if workspace is not None else 0
    if version == 0:
        return WorkspaceState(workspace_id=workspace_id, version=0)
    entries = db.scalar(
        select(WorkspaceManifest.entries)
        .join(WorkspaceVersion, WorkspaceVersion.manifest_sha256 == WorkspaceManifest.sha256)
        .where(WorkspaceVersion.workspace_id == workspace_id, WorkspaceVersion.version == version)
    )
    manifest = Manifest.decode(entries) if entries is not None else EMPTY
    return WorkspaceState(workspace_id=workspace_id, version=version, manifest=manifest)


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


async def manifest_entries(db: AsyncSession, sha256: str) -> Manifest | None:
    entries = await db.scalar(select(WorkspaceManifest.entries).where(WorkspaceManifest.sha256 == sha256))
    return Manifest.decode(entries) if entries is not None else None


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
    sha256 = add_manifest_on(db, change.manifest)
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
    return True


def add_manifest_on(db: OrmSession, manifest: Manifest) -> str:
    """The manifest's row, unless one with its sha256 is there already (the same content)."""
    encoded = manifest.encode()
    sha256 = manifest.sha256
    values: dict[str, Any] = {
        "sha256": sha256,
        "file_count": len(manifest.entries),
        "byte_size": manifest.byte_size,
        "entries": encoded.decode(),
        "created_at": utcnow(),
    }
    dialect = db.get_bind().dialect.name
    insert = postgresql_insert if dialect == "postgresql" else sqlite_insert
    db.execute(insert(WorkspaceManifest).values(**values).on_conflict_do_nothing(index_elements=["sha256"]))
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
    caller's transaction. Rows only: the manifests and their objects are shared, and the copies
    add no bytes (`added_bytes` 0), so no quota counts them twice."""
    copied = select(
        literal(target_id, String),
        WorkspaceVersion.version,
        WorkspaceVersion.manifest_sha256,
        WorkspaceVersion.run_id,
        literal(0, BigInteger),
        WorkspaceVersion.created_at,
    ).where(WorkspaceVersion.workspace_id == source_id, WorkspaceVersion.version <= up_to)
    columns = ["workspace_id", "version", "manifest_sha256", "run_id", "added_bytes", "created_at"]
    db.execute(insert(WorkspaceVersion).from_select(columns, copied))
