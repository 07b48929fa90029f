"""A root worker's workspace volumes over their life (fleet_worker.sandbox.volumes), on real
loop mounts: one a lease held when it was evicted is dropped once free, a failed mount makes
room and leaves no image behind, and blocks a workspace frees go back to the host."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_worker.sandbox import volumes as volumes_module
from fleet_worker.sandbox.errors import SandboxError
from fleet_worker.sandbox.volumes import WorkspaceVolumes

pytestmark = pytest.mark.skipif(not WorkspaceVolumes.available(), reason="needs root, mkfs.ext4 and mount")
MIB = 2**20


@pytest.fixture
def volumes(tmp_path: Path) -> Iterator[WorkspaceVolumes]:
    made = WorkspaceVolumes(tmp_path / "ws-volumes", size_bytes=16 * MIB, inodes=1000, keep=1)
    yield made
    made.close()


def test_a_volume_evicted_while_held_is_dropped_once_free(tmp_path: Path, volumes: WorkspaceVolumes) -> None:
    """Review of #29: the eviction forgot a held volume, so nothing ever unmounted it."""
    first, second, third = (tmp_path / "ws" / name for name in ("a", "b", "c"))
    held, _ = volumes.hold(first, None)
    other, _ = volumes.hold(second, None)  # keep=1: `first` is evicted, but its lease holds it
    assert os.path.ismount(first)
    os.close(held)  # the lease ends
    last, _ = volumes.hold(third, None)
    assert not os.path.ismount(first) and not volumes.image_of(first).exists()
    for fd in (other, last):
        os.close(fd)


def test_close_drops_what_was_evicted_too(tmp_path: Path) -> None:
    volumes = WorkspaceVolumes(tmp_path / "ws-volumes", size_bytes=16 * MIB, inodes=1000, keep=1)
    first, second = tmp_path / "ws" / "a", tmp_path / "ws" / "b"
    held, _ = volumes.hold(first, None)
    other, _ = volumes.hold(second, None)
    for fd in (held, other):
        os.close(fd)
    volumes.close()
    assert not os.path.ismount(first) and not os.path.ismount(second)


def test_a_failed_mount_drops_an_idle_volume_and_tries_again(
    tmp_path: Path, volumes: WorkspaceVolumes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's loop devices all taken: a kept volume nobody holds gives its device back."""
    idle, fresh = tmp_path / "ws" / "idle", tmp_path / "ws" / "fresh"
    fd, _ = volumes.hold(idle, None)
    os.close(fd)
    volumes.keep = 8
    real_run, refused = volumes_module.run, []

    def loop_devices_taken_once(*argv: str) -> None:
        if argv[0] == "mount" and not refused:
            refused.append(argv)
            raise SandboxError("the workspace's volume could not be prepared (mount failed)")
        real_run(*argv)

    monkeypatch.setattr(volumes_module, "run", loop_devices_taken_once)
    fd, made = volumes.hold(fresh, None)
    os.close(fd)
    assert refused and made and os.path.ismount(fresh)
    assert not os.path.ismount(idle) and not volumes.image_of(idle).exists()


def test_a_mount_that_keeps_failing_leaves_no_image(
    tmp_path: Path, volumes: WorkspaceVolumes, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_run = volumes_module.run

    def no_mounts(*argv: str) -> None:
        if argv[0] == "mount":
            raise SandboxError("the workspace's volume could not be prepared (mount failed)")
        real_run(*argv)

    monkeypatch.setattr(volumes_module, "run", no_mounts)
    folder = tmp_path / "ws" / "x"
    with pytest.raises(SandboxError):
        volumes.hold(folder, None)
    assert not volumes.image_of(folder).exists()


def test_blocks_a_workspace_frees_go_back_to_the_host(tmp_path: Path, volumes: WorkspaceVolumes) -> None:
    folder = tmp_path / "ws" / "d"
    fd, _ = volumes.hold(folder, None)
    try:
        data = folder / "big.bin"
        data.write_bytes(os.urandom(8 * MIB))
        os.sync()
        full = os.stat(volumes.image_of(folder)).st_blocks * 512
        data.unlink()
        os.sync()
        emptied = os.stat(volumes.image_of(folder)).st_blocks * 512
        assert full - emptied >= 6 * MIB, (full, emptied)
    finally:
        os.close(fd)
