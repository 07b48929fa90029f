"""What a cell wrote past the workspace budget is removed at its end (a non-root worker, with no
volume to refuse the writes), and what it leaves never raises the next cell's allowance."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fleet_worker.sandbox.workspace_budget import CLOCK_SLACK_NS, WorkspaceBudget

MIB = 2**20


def workspace(tmp_path: Path) -> Path:
    folder = tmp_path / "ws"
    for layout in ("memory", "skills", "attachments", "artifacts"):
        (folder / layout).mkdir(parents=True)
    kept = folder / "memory" / "kept.txt"
    kept.write_bytes(b"k" * 1000)
    while time.time_ns() <= kept.stat().st_ctime_ns + 2 * CLOCK_SLACK_NS:  # it predates any cell
        time.sleep(0.005)
    return folder


def test_a_back_dated_file_is_still_the_cells(tmp_path: Path) -> None:
    """Review of #29: the cell owns its files and can set their mtime to 1970; it cannot set ctime."""
    folder = workspace(tmp_path)
    budget = WorkspaceBudget(folder, MIB, 1000)
    budget.begin_cell()
    big = folder / "artifacts" / "big.bin"
    big.write_bytes(b"x" * 3 * MIB)
    os.utime(big, ns=(0, 0))
    removed = budget.prune(budget.cell_started_ns)
    assert removed == ["artifacts/big.bin"] and not big.exists()
    assert (folder / "memory" / "kept.txt").exists()


def test_folders_the_cell_made_go_too_and_the_allowance_does_not_grow(tmp_path: Path) -> None:
    folder = workspace(tmp_path)
    budget = WorkspaceBudget(folder, MIB, 50)
    for _ in range(3):
        budget.begin_cell()
        assert budget.allowed == (MIB, 50)
        for index in range(200):  # entries past the budget's 50, each an empty folder
            (folder / "memory" / f"d{index:03d}" / "inner").mkdir(parents=True, exist_ok=True)
        budget.prune(budget.cell_started_ns)
        entries = sum(len(dirs) + len(files) for _, dirs, files in os.walk(folder))
        assert entries <= 50
        assert budget.known[1] <= 50
    assert (folder / "memory" / "kept.txt").exists() and (folder / "artifacts").is_dir()


def test_what_cannot_be_removed_is_not_allowed_next_time(tmp_path: Path) -> None:
    """A file from before the cell stays; the next cell is allowed the budget, not what was left."""
    folder = workspace(tmp_path)
    budget = WorkspaceBudget(folder, MIB, 1000)
    budget.begin_cell()
    (folder / "memory" / "mine.bin").write_bytes(b"m" * 2 * MIB)
    budget.cell_started_ns += 10**12  # as if the file predated the cell: prune leaves it
    assert budget.prune(budget.cell_started_ns) == []
    budget.begin_cell()
    assert budget.allowed[0] == MIB
    assert budget.overrun() is not None
