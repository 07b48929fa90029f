"""Whether the worker may run an interpreter at all: the one file it executes outside every jail's
rules (its driver compile) and binds into every jail (its install prefix).

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


def untrusted_interpreter(python: str, sandbox_roots: Iterable[Path]) -> str | None:
    """Why `python` must not be run by the worker, or None when it may be."""
    real = Path(os.path.realpath(python))
    for root in sandbox_roots:
        resolved = Path(os.path.realpath(root))
        if real == resolved or resolved in real.parents:
            return f"the sandbox interpreter {real} is inside {resolved}, where sandboxed code writes"
    trusted_owners = {0, os.geteuid()}
    for path in (real, *real.parents):
        try:
            info = os.stat(path)
        except OSError as exc:
            return f"the sandbox interpreter {real} cannot be checked: {exc.strerror}"
        if info.st_uid not in trusted_owners:
            return (
                f"the sandbox interpreter {real} cannot be trusted: {path} is owned by uid "
                f"{info.st_uid}, not root or the worker's user"
            )
        sticky = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
        if info.st_mode & stat.S_IWOTH and not sticky:
            return f"the sandbox interpreter {real} cannot be trusted: anyone may write {path}"
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
