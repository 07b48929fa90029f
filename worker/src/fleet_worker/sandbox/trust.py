"""Whether the worker may run an interpreter at all: the one file it executes outside every jail's
rules (its driver compile) and binds into every jail (its install prefix); and whether it may
bind the cells' packages (sandbox.python) into every jail.

Sandboxed code writes files on the host (its workspace, as its own uid or, on a non-root worker,
as the worker's). An interpreter the worker trusts must be out of reach of that: not under any
folder sandboxes write, and neither the file nor any folder above it replaceable by anyone but
root or the worker's own user.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterable
from pathlib import Path

from fleet_shared.config import Settings
from fleet_shared.workspaces import relocated_root


def sandbox_roots(settings: Settings) -> tuple[Path, ...]:
    """Where sandboxed code writes on this host: the data dir, the workspaces (and where they are
    moved when a sandbox uid cannot reach them), the local blob store."""
    workspaces = settings.workspaces_dir
    return (settings.data_dir, workspaces, relocated_root(workspaces), settings.blobs_dir)


def untrusted_interpreter(python: str, sandbox_roots: Iterable[Path]) -> str | None:
    """Why `python` must not be run by the worker, or None when it may be."""
    real = Path(os.path.realpath(python))
    for root in sandbox_roots:
        resolved = Path(os.path.realpath(root))
        if real == resolved or resolved in real.parents:
            return f"the sandbox interpreter {real} is inside {resolved}, where sandboxed code writes"
    return untrusted_path(real, f"the sandbox interpreter {real}")


def untrusted_path(path: Path, what: str) -> str | None:
    """Why `what` at `path` (resolved) must not be trusted, or None: it and every folder above it
    must be owned by root or the worker's user, and writable by no one else (a sticky folder
    aside, whose entries only their owners may replace)."""
    real = Path(os.path.realpath(path))
    trusted_owners = {0, os.geteuid()}
    for step in (real, *real.parents):
        try:
            info = os.stat(step)
        except OSError as exc:
            return f"{what} cannot be checked: {exc.strerror}"
        if info.st_uid not in trusted_owners:
            owner = f"is owned by uid {info.st_uid}, not root or the worker's user"
            return f"{what} cannot be trusted: {step} {owner}"
        sticky = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
        if info.st_mode & stat.S_IWOTH and not sticky:
            return f"{what} cannot be trusted: anyone may write {step}"
    return None


def uid_range_clash(base: int, count: int) -> str | None:
    """Why sandboxes must not run as uids [base, base + count), or None: an account on this host
    with one of them would own what a cell writes, and a cell could act as it."""
    for account in pwd.getpwall():
        if base <= account.pw_uid < base + count:
            return (
                f"sandbox.local.uid_base {base} (+{count}) covers uid {account.pw_uid}, "
                f"the account {account.pw_name!r} on this host"
            )
    return None
