"""The workspace folders a worker keeps between Runs (a session's next Run here starts from what
it knows), removed once their workspace is gone from the database: the session was deleted
(fleet_shared.db.purge), so no Run of it will come again. A folder a lease of this worker holds
is left for a later sweep; with volumes, one whose volume any worker's lease holds too."""

from __future__ import annotations

from pathlib import Path

import structlog

from fleet_shared.ids import parse_uuid
from fleet_worker.sandbox.pool import WarmPool
from fleet_worker.sandbox.removal import remove_tree
from fleet_worker.sandbox.volumes import WorkspaceVolumes

log = structlog.get_logger(__name__)


def workspace_folders(root: Path) -> list[str]:
    """The names of the workspace folders in `root` (a workspace id each; scratch folders, lock
    files and the rest are not)."""
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    return sorted(
        p.name for p in entries if parse_uuid(p.name) == p.name and p.is_dir() and not p.is_symlink()
    )


def remove_workspaces(root: Path, names: list[str], pool: WarmPool, volumes: WorkspaceVolumes | None) -> int:
    """Remove these workspaces' folders (their warm REPLs first), but those leased now; how many
    went."""
    removed = 0
    for name in names:
        folder = (root / name).resolve()
        if folder.parent != root.resolve() or pool.leased(folder):
            continue
        pool.discard(folder)
        if volumes is not None and not volumes.drop(folder):
            continue  # a lease holds its volume: a later sweep
        try:
            remove_tree(folder)
        except OSError as exc:
            log.warning("sandbox.workspace_not_removed", workspace_id=name, error=str(exc))
            continue
        removed += 1
    if removed:
        log.info("sandbox.workspaces_removed", folders=removed, detail="their sessions were deleted")
    return removed
