"""A stored workspace manifest, read back as the tests check it."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_shared.db.models import WorkspaceManifest
from fleet_shared.manifests import Manifest


async def manifest_entries(db: AsyncSession, sha256: str) -> Manifest | None:
    """The manifest stored under `sha256`, or None when no such row exists."""
    entries = await db.scalar(select(WorkspaceManifest.entries).where(WorkspaceManifest.sha256 == sha256))
    return Manifest.decode(entries) if entries is not None else None
