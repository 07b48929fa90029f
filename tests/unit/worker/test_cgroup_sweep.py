"""The start-up sweep of leftover REPL cgroups spares a neighbour's group that is still empty
because its REPL has not joined it yet (two workers starting at once on one host)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fleet_worker.sandbox.cgroups import SWEEP_AFTER_SECONDS, Cgroups, Limits

DEAD_PID = "4194304"  # above the kernel's pid_max ceiling: no process has it


def group(base: Path, name: str, age_seconds: float) -> Path:
    path = base / name
    path.mkdir()
    stamp = time.time() - age_seconds
    os.utime(path, (stamp, stamp))
    return path


def test_the_sweep_removes_only_old_groups_of_dead_workers(tmp_path: Path) -> None:
    old = SWEEP_AFTER_SECONDS + 60
    neighbours_new = group(tmp_path, f"repl-{DEAD_PID}-a1", 0.5)  # just made, REPL not in yet
    live_owner = group(tmp_path, f"repl-{os.getpid()}-b2", old)
    crashed = group(tmp_path, f"repl-{DEAD_PID}-c3", old)
    legacy = group(tmp_path, "repl-0123456789ab", old)
    Cgroups((tmp_path,), 2).sweep()
    assert neighbours_new.exists() and live_owner.exists()
    assert not crashed.exists() and not legacy.exists()


def test_groups_are_named_after_their_worker(tmp_path: Path) -> None:
    # create() only makes a directory and writes limit files, which a plain directory accepts.
    made = Cgroups((tmp_path,), 2).create(Limits(memory_bytes=64 << 20, pids=64, cpus=1.0))
    assert made.dirs[0].name.startswith(f"repl-{os.getpid()}-")
    Cgroups((tmp_path,), 2).sweep()  # the owner (this process) is alive: kept
    assert made.dirs[0].exists()
