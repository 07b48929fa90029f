"""`fleet doctor` reads cgroups and writes nothing: checked against a cgroup v2 layout laid out in
a temporary directory (the files a cgroup2 mount shows), and against what the worker's own setup
writes on the same layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleet_worker.sandbox.cgroups import CONTROLLERS, GROUP, LEAF, Cgroups, find_v1, find_v2, inspect
from fleet_worker.sandbox.doctor import check_cgroups
from fleet_worker.sandbox.jail import LocalSandboxConfig

OWN = "/kubepods/burstable/pod-1/worker"


def cgroup2(tmp_path: Path, *, prepared: bool = False) -> tuple[dict[str, Path], Path]:
    """A cgroup2 mount with the worker container's cgroup at OWN (two processes in it); with
    `prepared`, the layout a worker's setup leaves, one REPL group of it still empty."""
    mount = tmp_path / "cgroup2"
    own = mount / OWN.lstrip("/")
    own.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("")
    (own / "cgroup.procs").write_text("1\n7\n")
    if prepared:
        (own / "cgroup.procs").write_text("")
        (own / LEAF).mkdir()
        (own / LEAF / "cgroup.procs").write_text("1\n7\n")
        (own / "cgroup.subtree_control").write_text("cpu memory pids\n")
        base = own / GROUP
        (base / "repl-starting").mkdir(parents=True)
        (base / "cgroup.controllers").write_text("cpu memory pids\n")
        (base / "cgroup.subtree_control").write_text("cpu memory pids\n")
    return {"": mount}, own


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file's and directory's content and modification time under root."""
    return {
        str(path.relative_to(root)): (
            path.read_text() if path.is_file() else "<dir>",
            path.stat().st_mtime_ns,
        )
        for path in sorted(root.rglob("*"))
    }


def test_an_unprepared_v2_cgroup_is_reported_and_left_alone(tmp_path: Path) -> None:
    mounts, own = cgroup2(tmp_path)
    before = snapshot(tmp_path)
    view = inspect(mounts, {"": OWN})
    cgroups = Cgroups.prepared(view)
    assert snapshot(tmp_path) == before
    assert (view.version, view.available, view.prepared) == (2, CONTROLLERS, ())
    assert f"moves the 2 process(es) of {own} into {LEAF}/" in view.needs
    assert cgroups.bases == () and cgroups.mode == "none"
    check = check_cgroups(LocalSandboxConfig(), view)
    if os.geteuid() == 0:
        assert check.status == "ok" and "limits were not exercised" in check.detail, check
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("inside", [OWN, f"{OWN}/{LEAF}"])
def test_a_v2_group_a_worker_prepared_is_used_as_it_is(tmp_path: Path, inside: str) -> None:
    """Seen from the worker's cgroup, or from the leaf it moved into (where `kubectl exec` lands)."""
    mounts, own = cgroup2(tmp_path, prepared=True)
    before = snapshot(tmp_path)
    view = inspect(mounts, {"": inside})
    cgroups = Cgroups.prepared(view)
    assert snapshot(tmp_path) == before  # the empty repl-starting group of a live worker included
    assert view.prepared == (own / GROUP,) and view.needs == ""
    if os.geteuid() == 0:
        assert cgroups.bases == (own / GROUP,) and cgroups.mode == "cgroup-v2"


def test_v1_and_missing_controllers_are_read_only_too(tmp_path: Path) -> None:
    mounts = {c: tmp_path / c for c in CONTROLLERS}
    for mount in mounts.values():
        (mount / "fleet").mkdir(parents=True)
    before = snapshot(tmp_path)
    view = inspect(mounts, dict.fromkeys(CONTROLLERS, "/fleet"))
    assert (view.version, view.available, view.prepared) == (1, CONTROLLERS, ())
    assert f"creates {GROUP}/" in view.needs
    assert inspect({}, {}).version == 0
    assert snapshot(tmp_path) == before


def test_the_workers_own_setup_does_write_this_layout(tmp_path: Path) -> None:
    """What the doctor no longer does: the snapshot above sees these writes."""
    _mounts, own = cgroup2(tmp_path)
    before = snapshot(tmp_path)
    assert find_v2(own) == ((own / GROUP,), 2)
    after = snapshot(tmp_path)
    assert after != before
    assert (own / LEAF / "cgroup.procs").read_text() == "7\n"  # each pid written in turn
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids +cpu\n"


def test_a_host_that_refuses_the_cpu_weight_keeps_the_sandbox_cgroups(tmp_path: Path) -> None:
    """The weight only orders who runs first: failing to write it must not cost the limits."""
    own = {controller: tmp_path / controller / "worker" for controller in CONTROLLERS}
    for path in own.values():
        path.mkdir(parents=True)
    (own["cpu"] / GROUP / "cpu.shares").mkdir(parents=True)  # a write to it fails (EISDIR)
    assert find_v1(own) == (tuple(own[c] / GROUP for c in CONTROLLERS), 1)


def test_the_doctor_says_who_holds_the_workspace_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet_worker.sandbox import doctor

    monkeypatch.setattr(doctor.WorkspaceVolumes, "available", staticmethod(lambda: True))
    held = doctor.check_workspace_budget(LocalSandboxConfig(workspace_mb=64))
    assert held.status == "ok" and "ext4 volume of 64 MiB" in held.detail
    off = doctor.check_workspace_budget(LocalSandboxConfig(workspace_volumes=False))
    assert off.status == "warn" and "workspace_volumes = false" in off.detail and off.fix is None
    monkeypatch.setattr(doctor.WorkspaceVolumes, "available", staticmethod(lambda: False))
    unable = doctor.check_workspace_budget(LocalSandboxConfig())
    assert unable.status == "warn" and "cannot mount" in unable.detail and "privileged" in (unable.fix or "")
