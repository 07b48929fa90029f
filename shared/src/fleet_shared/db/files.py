"""Attachments and artifacts: the rows that describe bytes kept in the blob store."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db.models import Artifact, Attachment
from fleet_shared.db.queries import now


async def add_attachment(
    db: AsyncSession,
    *,
    attachment_id: str,
    filename: str,
    media_type: str,
    byte_size: int,
    checksum_sha256: str,
) -> Attachment:
    row = Attachment(
        id=attachment_id,
        filename=filename,
        media_type=media_type,
        byte_size=byte_size,
        checksum_sha256=checksum_sha256,
        created_at=now(),
    )
    db.add(row)
    await db.commit()
    return row


async def get_attachment(db: AsyncSession, attachment_id: str) -> Attachment | None:
    return await db.get(Attachment, attachment_id)


async def get_attachments(db: AsyncSession, ids: Sequence[str]) -> list[Attachment]:
    """The attachments with these ids, in the order asked (unknown ids are left out)."""
    return await db.run_sync(get_attachments_on, ids) if ids else []


def get_attachments_on(db: OrmSession, ids: Sequence[str]) -> list[Attachment]:
    """get_attachments on a synchronous session (fleet_shared.db.engine.run_whole)."""
    if not ids:
        return []
    rows = db.scalars(select(Attachment).where(Attachment.id.in_(list(ids)))).all()
    found = {row.id: row for row in rows}
    return [found[i] for i in ids if i in found]


async def get_artifact(db: AsyncSession, artifact_id: str) -> Artifact | None:
    return await db.get(Artifact, artifact_id)
