"""Where the local provider keeps its scratch copies of session workspaces, on a worker.

A workspace's folder is `<data_dir>/workspaces/<workspace id>`, unless a root worker's sandbox
uid cannot search that far (a checkout under /root): then the worker relocates every workspace
to a stable folder under /var/lib/fleet derived from the preferred path. The folder is scratch:
a workspace's versions live in the database and the blob store, and no other process reads it.
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
