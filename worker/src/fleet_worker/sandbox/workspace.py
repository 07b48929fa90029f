"""The host's side of a workspace, which sandboxed code writes: treated as hostile.

Host code never follows a link inside a workspace (everything goes through directory fds with
`O_NOFOLLOW` / `follow_symlinks=False`), replaces whatever sits where a directory is expected,
strips setuid/setgid bits and removes device, fifo and socket files. Between Runs the workspace
holds no symbolic link either: a host reader that followed one by mistake finds none.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from fleet_shared.confined import DIR_FLAGS, MAX_DEPTH, opened_dir, opened_inside, parts_of, walk
from fleet_shared.manifests import WORKSPACE_DIRS
from fleet_worker.sandbox.provider import FileStamp, Writable
from fleet_worker.sandbox.removal import empty_folder, grant_owner

SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID


def prepare_layout(workspace: Path) -> None:
    """`workspace/` and its `memory/ skills/ attachments/ artifacts/`, as real directories.

    The workspace folder itself is created by the host under a root the sandbox never sees; its
    subfolders are the sandbox's to play with, so anything in their place (a symlink to a host
    path, a file) is removed, never followed."""
    workspace.mkdir(mode=0o700, parents=True, exist_ok=True)
    with opened_dir(workspace) as root:
        for name in WORKSPACE_DIRS:
            ensure_dir(root, name)


def ensure_dir(parent: int, name: str) -> None:
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        os.mkdir(name, 0o700, dir_fd=parent)
        return
    if stat.S_ISDIR(info.st_mode):
        return
    os.unlink(name, dir_fd=parent)
    os.mkdir(name, 0o700, dir_fd=parent)


def sanitize(workspace: Path, owner: int | None, *, between_runs: bool = False) -> None:
    """Walk the workspace without following links: strip setuid/setgid bits, remove device,
    fifo and socket files, and (root hosts) hand every entry to the sandbox's uid.

    `between_runs` (a lease's start and end, when no cell runs) removes every symbolic link too
    (a Run's own links serve it only while it runs; versions never hold links), the folders
    nested deeper than the walk goes (a link could hide there; the budget already refuses such
    a tree and versions never hold it), and gives its owner back the access to a folder that
    the sandbox took away, so that nothing inside is out of the pass's reach.

    Hard-linked files keep their owner: a link to a file outside could otherwise redirect the
    chown (the jail cannot link across mounts, but the host never relies on that). An entry
    that fails does not stop the pass: the first failure is raised once the walk is done."""
    if owner is not None:
        os.chown(workspace, owner, owner, follow_symlinks=False)
    failure: OSError | None = None
    for dir_fd, name, info, path in walk(workspace):
        try:
            if between_runs and not between_runs_entry(dir_fd, name, info, path):
                continue
            sanitize_entry(dir_fd, name, info, owner)
        except FileNotFoundError:  # the sandbox may still be changing it (not between Runs)
            continue
        except OSError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def between_runs_entry(dir_fd: int, name: str, info: os.stat_result, path: str) -> bool:
    """The pass between Runs on one entry, before the walk would enter it; False when it is
    gone. It runs when the walk yields the entry, which is before the walk opens a folder."""
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        os.unlink(name, dir_fd=dir_fd)
        return False
    if not stat.S_ISDIR(mode):
        return True
    if path.count("/") >= MAX_DEPTH:  # the walk does not enter it: what it holds goes with it
        empty_folder(dir_fd, name)
        os.rmdir(name, dir_fd=dir_fd)
        return False
    if stat.S_IMODE(mode) & stat.S_IRWXU != stat.S_IRWXU:  # made unreadable or unwritable
        grant_owner(dir_fd, name)
    return True


def sanitize_entry(dir_fd: int, name: str, info: os.stat_result, owner: int | None) -> None:
    mode = info.st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        os.unlink(name, dir_fd=dir_fd)  # a device, fifo or socket: nothing a workspace needs
        return
    if mode & SPECIAL_BITS and not stat.S_ISLNK(mode):
        flags = (os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC) | (
            os.O_DIRECTORY if stat.S_ISDIR(mode) else 0
        )
        fd = os.open(name, flags, dir_fd=dir_fd)
        try:
            os.fchmod(fd, stat.S_IMODE(mode) & ~SPECIAL_BITS)
        finally:
            os.close(fd)
    if stat.S_ISREG(mode) and info.st_nlink > 1:
        return
    if owner is not None and info.st_uid != owner:
        os.chown(name, owner, owner, dir_fd=dir_fd, follow_symlinks=False)


def unreachable_ancestor(path: Path, uid: int) -> Path | None:
    """The first directory above `path` that `uid` (not owner, not in group) cannot search."""
    for ancestor in reversed(path.parents):
        info = ancestor.stat()
        bit = stat.S_IXUSR if info.st_uid == uid else stat.S_IXOTH
        if not info.st_mode & bit:
            return ancestor
    return None


class HostPaths:
    """Host paths that must never reach a client (or the RLM): replaced in any text shown."""

    def __init__(self) -> None:
        self.prefixes: set[str] = set()

    def add(self, path: Path | str) -> None:
        self.prefixes.add(str(path))

    def scrub(self, text: str) -> str:
        for prefix in sorted(self.prefixes, key=len, reverse=True):
            if prefix and prefix in text:
                text = text.replace(prefix, "<host>")
        return text


HOST_PATHS = HostPaths()


COPY_CHUNK = 1 << 20


class LocalWorkspaceFiles:
    """The host's way into a workspace on this machine (see provider.WorkspaceFiles): every
    step goes through directory fds, no link is followed, and only regular files are read."""

    def __init__(self, workspace: Path, owner: int | None) -> None:
        self.workspace = workspace
        self.owner = owner  # the sandbox's uid on a root worker: staged files become its own

    def put(self, relative: str, source: Path) -> None:
        *folders, name = parts_of(relative)
        fd = os.open(self.workspace, DIR_FLAGS)
        try:
            for folder in folders:
                ensure_dir(fd, folder)
                child = os.open(folder, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    raise IsADirectoryError(relative)
                os.unlink(name, dir_fd=fd)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            out = os.open(name, flags, 0o644, dir_fd=fd)
            with os.fdopen(out, "wb") as target, source.open("rb") as origin:
                while chunk := origin.read(COPY_CHUNK):
                    target.write(chunk)
                if self.owner is not None:
                    os.fchown(target.fileno(), self.owner, self.owner)
        finally:
            os.close(fd)

    def stamps(self, folder: str, limit: int) -> dict[str, FileStamp]:
        found: dict[str, FileStamp] = {}
        try:
            with opened_inside(self.workspace, parts_of(folder)) as (fd, info):
                if not stat.S_ISDIR(info.st_mode):
                    return found
                for _parent, _name, entry, path in walk(fd):
                    if stat.S_ISREG(entry.st_mode):
                        found[path] = FileStamp(entry.st_size, entry.st_mtime_ns)
                        if len(found) >= limit:
                            break
        except FileNotFoundError:
            pass
        return found

    def export(self, relative: str, sink: Writable, max_bytes: int) -> int:
        with opened_inside(self.workspace, parts_of(relative)) as (fd, info):
            if not stat.S_ISREG(info.st_mode):
                raise FileNotFoundError(relative)
            if info.st_size > max_bytes:
                raise ValueError(f"{relative} is {info.st_size} bytes, more than {max_bytes}")
            total = 0
            while chunk := os.read(fd, COPY_CHUNK):
                total += len(chunk)
                if total > max_bytes:  # it grew while we read
                    raise ValueError(f"{relative} is more than {max_bytes} bytes")
                sink.write(chunk)
            return total
