"""Attachments and artifacts: the rows that describe bytes kept in the blob store, and the
quotas on those bytes.

The quotas are counted from the rows (`byte_size`), so every gateway and worker sees the same
usage. Bytes stored but never recorded (an upload whose row failed, a Run whose commit failed)
are not counted; nor are a Run's own artifacts until its commit, so Runs and uploads storing at
the same moment may each pass the check and go over a quota by what they store together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, ScalarSelect, func, literal, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.config_file import QuotaLimits, StorageSection
from fleet_shared.db.models import Artifact, Attachment, Session, WorkspaceVersion, utcnow
from fleet_shared.tenancy import Principal

MIB = 2**20


@dataclass(frozen=True)
class StorageQuota:
    """Bytes the blob store may hold for one session (its artifacts and its workspace versions),
    for its tenant (the same, over all its sessions, and its attachments), and for the whole
    deployment (artifacts, attachments and workspace versions); 0 is no quota. A version counts
    what its Run put in the store, the files it changed; a fork's copies count again."""

    session_bytes: int
    deployment_bytes: int
    tenant_bytes: int = 0

    @classmethod
    def of(cls, storage: StorageSection, tenant: QuotaLimits | None = None) -> StorageQuota:
        tenant_mb = tenant.storage_mb if tenant is not None else 0
        return cls(storage.quota_session_mb * MIB, storage.quota_deployment_mb * MIB, tenant_mb * MIB)


@dataclass(frozen=True)
class StoredBytes:
    """What the rows say is stored: one session's, its tenant's, and everything."""

    session: int
    deployment: int
    tenant: int = 0

    def plus(self, size: int) -> StoredBytes:
        return StoredBytes(self.session + size, self.deployment + size, self.tenant + size)


def quota_refusal(quota: StorageQuota, stored: StoredBytes, adding: int) -> str | None:
    """Why `adding` more bytes may not be stored (naming the key to raise), or None if they may."""
    if quota.session_bytes and stored.session + adding > quota.session_bytes:
        return (
            "the session's stored files would pass storage.quota_session_mb "
            f"({quota.session_bytes // MIB} MiB)"
        )
    if quota.tenant_bytes and stored.tenant + adding > quota.tenant_bytes:
        return f"the tenant's stored files would pass quotas.storage_mb ({quota.tenant_bytes // MIB} MiB)"
    if quota.deployment_bytes and stored.deployment + adding > quota.deployment_bytes:
        return (
            "the deployment's stored files would pass storage.quota_deployment_mb "
            f"({quota.deployment_bytes // MIB} MiB)"
        )
    return None


def stored_bytes_on(db: OrmSession, session_id: str | None = None, tenant: str | None = None) -> StoredBytes:
    """The bytes recorded for the session `session_id` (0 without one), for a tenant (the
    session's, or `tenant`; 0 with neither) and for the deployment, in one statement."""

    def total(column: InstrumentedAttribute[int], *where: ColumnElement[bool]) -> ScalarSelect[int]:
        return select(func.coalesce(func.sum(column), 0)).where(*where).scalar_subquery()

    session: ColumnElement[int] = literal(0)
    versions: ColumnElement[int] = literal(0)
    if session_id:
        workspace = select(Session.workspace_id).where(Session.id == session_id).scalar_subquery()
        session = total(Artifact.byte_size, Artifact.session_id == session_id)
        versions = total(WorkspaceVersion.added_bytes, WorkspaceVersion.workspace_id == workspace)
    owner: ColumnElement[str] | None = literal(tenant) if tenant is not None else None
    if owner is None and session_id:
        owner = select(Session.tenant_id).where(Session.id == session_id).scalar_subquery()
    in_tenant: list[ColumnElement[int]] = [literal(0), literal(0), literal(0)]
    if owner is not None:
        sessions_of_tenant = select(Session.id).where(Session.tenant_id == owner)
        workspaces_of_tenant = select(Session.workspace_id).where(Session.tenant_id == owner)
        in_tenant = [
            total(Artifact.byte_size, Artifact.session_id.in_(sessions_of_tenant)),
            total(Attachment.byte_size, Attachment.tenant_id == owner),
            total(WorkspaceVersion.added_bytes, WorkspaceVersion.workspace_id.in_(workspaces_of_tenant)),
        ]
    row = db.execute(
        select(
            session,
            versions,
            total(Artifact.byte_size),
            total(Attachment.byte_size),
            total(WorkspaceVersion.added_bytes),
            *in_tenant,
        )
    ).one()
    return StoredBytes(
        int(row[0]) + int(row[1]),
        int(row[2]) + int(row[3]) + int(row[4]),
        int(row[5]) + int(row[6]) + int(row[7]),
    )


async def version_bytes(db: AsyncSession, workspace_id: str) -> int:
    """What a workspace's versions count: what a fork of its session adds to the counts."""
    query = select(func.coalesce(func.sum(WorkspaceVersion.added_bytes), 0))
    return int(await db.scalar(query.where(WorkspaceVersion.workspace_id == workspace_id)) or 0)


async def stored_bytes(
    db: AsyncSession, session_id: str | None = None, tenant: str | None = None
) -> StoredBytes:
    return await db.run_sync(stored_bytes_on, session_id, tenant)


def latest_checksums_on(db: OrmSession, session_id: str, names: Sequence[str]) -> dict[str, str]:
    """The checksum of the artifact last stored under each of `names` in the session."""
    if not names:
        return {}
    rows = db.execute(
        select(Artifact.name, Artifact.checksum_sha256)
        .where(Artifact.session_id == session_id, Artifact.name.in_(list(names)))
        .order_by(Artifact.created_at)
    ).all()
    return {name: checksum for name, checksum in rows}  # in commit order: the latest stays


async def add_attachment(
    db: AsyncSession,
    *,
    attachment_id: str,
    filename: str,
    media_type: str,
    byte_size: int,
    checksum_sha256: str,
    owner: Principal,
) -> Attachment:
    row = Attachment(
        id=attachment_id,
        tenant_id=owner.tenant,
        owner_id=owner.user,
        filename=filename,
        media_type=media_type,
        byte_size=byte_size,
        checksum_sha256=checksum_sha256,
        created_at=utcnow(),
    )
    db.add(row)
    await db.commit()
    return row


def get_attachments_on(db: OrmSession, ids: Sequence[str]) -> list[Attachment]:
    """get_attachments on a synchronous session (fleet_shared.db.engine.run_whole)."""
    if not ids:
        return []
    rows = db.scalars(select(Attachment).where(Attachment.id.in_(list(ids)))).all()
    found = {row.id: row for row in rows}
    return [found[i] for i in ids if i in found]
