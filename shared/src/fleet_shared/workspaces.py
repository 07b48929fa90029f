"""Where the local provider keeps session workspaces, for the worker and the gateway alike.

A workspace lives in `<data_dir>/workspaces/<workspace id>`, unless a root worker's sandbox uid
cannot search that far (a checkout under /root): then the worker relocates every workspace to
a stable folder under /var/lib/fleet derived from the preferred path, and the gateway's files
API looks there too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

RELOCATED_ROOT = Path("/var/lib/fleet")


def create_dirs(path: Path, mode: int) -> None:
    """`path` and any missing folder above it, each created with `mode`. A folder that already
    exists keeps its own mode and owner: the configured data dir may be a shared one (/tmp, a
    home), and changing its mode would change it for everyone who uses it."""
    missing = [folder for folder in (path, *path.parents) if not folder.exists()]
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=mode)
        except FileExistsError:
            continue  # made by someone else meanwhile: theirs, left as it is
        folder.chmod(mode)  # mkdir's mode passes through the umask


def relocated_root(preferred: Path) -> Path:
    digest = hashlib.sha256(str(preferred.resolve()).encode()).hexdigest()[:16]
    return RELOCATED_ROOT / digest / "workspaces"


def find_workspace(preferred: Path, workspace_id: str) -> Path | None:
    """The folder of an existing workspace, or None (never created, or not on this machine)."""
    if not workspace_id or "/" in workspace_id or workspace_id in (".", ".."):
        return None
    for root in (preferred.resolve(), relocated_root(preferred)):
        candidate = root / workspace_id
        if candidate.is_dir() and not candidate.is_symlink():
            return candidate
    return None
