"""A worker's workspace folders of deleted sessions: found by their names, removed unless a lease
of this worker holds them; scratch folders, lock files and other names are never touched."""

from __future__ import annotations

import uuid
from pathlib import Path

from fleet_worker.sandbox.leftovers import remove_workspaces, workspace_folders
from fleet_worker.sandbox.pool import WarmPool


def test_only_workspace_folders_no_lease_holds_are_removed(tmp_path: Path) -> None:
    gone, leased = str(uuid.uuid4()), str(uuid.uuid4())
    for name in (gone, leased, "scratch-abc"):
        (tmp_path / name / "memory").mkdir(parents=True)
        (tmp_path / name / "memory" / "note.txt").write_text("x")
    (tmp_path / "scratch-abc.lock").write_text("")
    (tmp_path / str(uuid.uuid4())).write_text("a file with a workspace's name")
    assert workspace_folders(tmp_path) == sorted([gone, leased])
    pool = WarmPool(size=0, max_idle_seconds=1)
    try:
        pool.lease_out((tmp_path / leased).resolve())
        assert remove_workspaces(tmp_path, [gone, leased], pool, None) == 1
        assert not (tmp_path / gone).exists() and (tmp_path / leased / "memory" / "note.txt").exists()
        assert pool.lease_back()  # its release begins: the worker is idle, the folder still held
        assert remove_workspaces(tmp_path, [leased], pool, None) == 0
        pool.returned((tmp_path / leased).resolve())  # the release is over
        assert remove_workspaces(tmp_path, [leased, "../escape"], pool, None) == 1
        assert not (tmp_path / leased).exists() and (tmp_path / "scratch-abc" / "memory").exists()
    finally:
        pool.close()
    assert workspace_folders(tmp_path / "missing") == []
