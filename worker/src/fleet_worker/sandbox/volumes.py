"""A workspace's hard limit: on a root worker each workspace folder is a filesystem of its own,
an ext4 image in a sparse file, loop-mounted at the folder with `nosuid,nodev`. The kernel
refuses a write past its size (ENOSPC) and a file past its inode count, however fast or wide a
cell writes: nothing of the workspace can take more of the host's disk than the image holds.

The image is scratch, like the folder (versions live in the store): it is made when a lease
first needs the folder on this worker, kept mounted for the folder's next Runs (least
recently used first out, past `keep`), and unmounted and deleted when the worker stops. Several
workers on one host may share a data dir: a lease holds a shared lock on the volume's lock file,
and only a worker that gets it exclusively (no lease anywhere holds it) makes or removes the
volume; a mount a worker that died left behind is reused by the next lease of that folder.

ext4 rounds its inode count to whole inode-table blocks per group, so an image gets about twice
the budget's files (and the budget's own check, which stays, holds the count); its bytes are
the budget's, which is what fills a host's disk. A non-root worker cannot mount: its
workspaces keep the budget's check alone (docs/security.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import threading
from collections import OrderedDict
from pathlib import Path

import structlog

from fleet_worker.sandbox.errors import SandboxError

log = structlog.get_logger(__name__)
INODE_BYTES = 256  # ext4's inode size: the image's room for `inodes` of them
SLACK_BYTES = 4 << 20  # bitmaps, group descriptors and the root folder
TOOL_SECONDS = 30.0
HOLD_ATTEMPTS = 5
MKFS = "mkfs.ext4"


class WorkspaceVolumes:
    def __init__(self, images: Path, *, size_bytes: int, inodes: int, keep: int) -> None:
        self.images = images
        self.size_bytes = size_bytes
        self.inodes = inodes
        self.keep = keep
        self._mounted: OrderedDict[Path, Path] = OrderedDict()  # folder -> image, least recent first
        # Evicted while a lease held them: dropped once free (every hold tries, and close).
        self._evicted: set[Path] = set()
        self._lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        """Whether this process can make and mount images (root, with the tools on PATH)."""
        return os.geteuid() == 0 and all(shutil.which(tool) for tool in (MKFS, "mount", "umount"))

    def hold(self, folder: Path, owner: int | None) -> tuple[int, bool]:
        """`folder` as a mounted volume of its own (made now if it is not), its root owned by
        `owner`: the lock the lease keeps until it ends (close the fd), and whether the volume
        is new (a warm REPL bound to the folder before holds the one it replaced)."""
        self.images.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.lock_of(folder), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        made = False
        try:
            for _ in range(HOLD_ATTEMPTS):
                fcntl.flock(fd, fcntl.LOCK_SH)  # held: no worker drops it from here on
                if os.path.ismount(folder):
                    break
                fcntl.flock(fd, fcntl.LOCK_UN)
                fcntl.flock(fd, fcntl.LOCK_EX)  # alone: make it, then take it shared again
                if not os.path.ismount(folder):
                    self._make_room_for(folder, owner)
                    made = True
                fcntl.flock(fd, fcntl.LOCK_UN)
            else:
                raise SandboxError("the workspace's volume kept being removed while it was taken")
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._mounted[folder] = self.image_of(folder)
            self._mounted.move_to_end(folder)
            self._evicted.discard(folder)
            evicted = [*self._overflow(), *self._evicted]
        for old in evicted:
            self.try_drop(old)
        return fd, made

    def _make_room_for(self, folder: Path, owner: int | None) -> None:
        """Make the folder's volume; if that fails (the host's loop devices are all taken, say),
        drop every kept volume no lease holds and try once more."""
        try:
            self._make(folder, owner)
            return
        except SandboxError:
            with self._lock:
                idle = [kept for kept in self._mounted if kept != folder]
        if not any([self.try_drop(kept) for kept in idle]):
            raise SandboxError(
                "the workspace's volume could not be prepared (no kept volume was free to drop)"
            )
        self._make(folder, owner)

    def try_drop(self, folder: Path) -> bool:
        """drop(), remembering a folder a lease still holds so that a later hold drops it."""
        try:
            gone = self.drop(folder)
        except (SandboxError, OSError):
            gone = False
        if not gone:
            with self._lock:
                if folder not in self._mounted:
                    self._evicted.add(folder)
        return gone

    def lock_of(self, folder: Path) -> Path:
        return self.images / f"{folder.name}.lock"

    def image_of(self, folder: Path) -> Path:
        return self.images / f"{folder.name}.img"

    def _make(self, folder: Path, owner: int | None) -> None:
        self.images.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        image = self.image_of(folder)
        image.unlink(missing_ok=True)
        inodes = 2 * self.inodes + 64  # ext4 rounds the count down (the module's docstring)
        with open(image, "wb") as handle:  # sparse: it takes only what the workspace holds
            handle.truncate(self.size_bytes + inodes * INODE_BYTES + SLACK_BYTES)
        uid = owner if owner is not None else os.geteuid()
        try:
            run(
                MKFS, "-q", "-F", "-m", "0", "-O", "^has_journal", "-N", str(inodes),
                "-E", f"root_owner={uid}:{uid},lazy_itable_init=1", str(image),
            )  # fmt: skip
            # discard: blocks a cell frees go back to the host, so a kept image holds what its
            # workspace holds now, not the most it ever held.
            run("mount", "-o", "loop,nosuid,nodev,noatime,discard", str(image), str(folder))
        except SandboxError:
            image.unlink(missing_ok=True)
            raise
        os.chmod(folder, 0o700)
        lost = folder / "lost+found"
        with contextlib.suppress(OSError):
            lost.rmdir()

    def _overflow(self) -> list[Path]:
        evicted = []
        while len(self._mounted) > self.keep:
            folder, _image = self._mounted.popitem(last=False)
            evicted.append(folder)
        return evicted

    def drop(self, folder: Path) -> bool:
        """Unmount the folder's volume and delete its image (its contents go with it), unless a
        lease (of any worker) holds it; whether it went."""
        with self._lock:
            self._mounted.pop(folder, None)
        try:
            fd = os.open(self.lock_of(folder), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # in use: whoever holds it drops it in its turn
            if os.path.ismount(folder):
                # Lazily: a warm REPL's jail may still hold a bind of it; the loop device is
                # freed when the last one goes.
                run("umount", "-l", str(folder))
            self.image_of(folder).unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            folders = [*self._mounted, *self._evicted]
        for folder in folders:
            with contextlib.suppress(SandboxError, OSError):
                self.drop(folder)


def run(*argv: str) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, timeout=TOOL_SECONDS)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        stderr = detail[-500:].decode(errors="replace")
        log.error("sandbox.volume_failed", tool=argv[0], error=str(exc), stderr=stderr)
        raise SandboxError(f"the workspace's volume could not be prepared ({argv[0]} failed)") from None
