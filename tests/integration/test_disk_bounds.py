"""Disk that sandbox code can make the host spend, through real Turns (arq worker, bwrap, SQLite,
Redis): sparse artifacts, files touched again, and a child's scratch workspace too deep for a
recursive removal. Part of the escape suite (`uv run pytest -m escape`)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from fleet_shared.db import queries
from fleet_shared.events import ArtifactCreated, CellOutput, ChildProgress, RunEvent, RunWarning
from tests.integration.test_escape import HarnessFactory
from tests.unit.worker.test_tree_removal import hold_scratch, nest

pytestmark = pytest.mark.escape

SPARSE_FILES = 20
SPARSE_MIB = 64


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: the sandbox and the blob store are the subject here."""
    return sqlite_url


def action(code: str, lm: str = "root") -> dict[str, Any]:
    return {"lm": lm, "reasoning": "step", "code": code}


def stored_bytes(folder: Path) -> int:
    """What the blob store's folder takes on disk (as `du` counts it)."""
    total = 0
    for parent, _dirs, names in os.walk(folder):
        for name in names:
            total += os.lstat(os.path.join(parent, name)).st_blocks * 512
    return total


def of(events: list[RunEvent], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


async def test_sparse_artifacts_touched_again_do_not_fill_the_blob_store(
    harness_factory: HarnessFactory,
) -> None:
    """A first Turn makes 20 sparse files of 64 MiB (a few KiB allocated) under artifacts/; the
    next Turn only touches them. The workspace counts their apparent size (the cell that made
    them is over its budget), the blob store keeps no more than the session's quota, and the
    touch stores nothing."""
    code = (
        "import os\nart = '/workspace/artifacts'\n"
        "if request == 'make':\n"
        f"    for i in range({SPARSE_FILES}):\n"
        f"        with open(f'{{art}}/sparse{{i:02}}.bin', 'wb') as f:\n"
        f"            f.truncate({SPARSE_MIB} * 2**20)\n"
        "else:\n"
        "    for name in os.listdir(art):\n"
        "        os.utime(os.path.join(art, name))\n"
        "print('cell done')"
    )
    harness = harness_factory(
        action(code), action("SUBMIT(answer='done')"), storage={"quota_session_mb": 3 * SPARSE_MIB}
    )
    blobs = harness.settings.blobs_dir
    blobs.mkdir(parents=True, exist_ok=True)
    before = stored_bytes(blobs)
    first = await harness.submit("make")
    await harness.work()
    after_first = stored_bytes(blobs)
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, first)
        assert run is not None and run.status == "completed", run
    second = await harness.submit("touch", session_id=run.session_id, key="touch")
    await harness.work()
    after_second = stored_bytes(blobs)
    print(f"blob store bytes: before {before}, after Turn 1 {after_first}, after Turn 2 {after_second}")

    events = await harness.events(first)
    errors = [o.error for o in of(events, CellOutput) if o.error]
    assert errors and "sandbox.local.workspace_mb" in errors[0], "apparent size is not counted"
    kept = of(events, ArtifactCreated)
    assert len(kept) == 3 and all(a.byte_size == SPARSE_MIB * 2**20 for a in kept)
    refused, workspace = [w for w in of(events, RunWarning) if w.code == "storage_quota_exceeded"]
    # The cell went past its 1 GiB budget (20 files of 64 MiB): what it wrote past it was removed at
    # its end (with the 4 MiB slack a workspace volume gives the check, one file more); 3 of what is
    # left fit the session's quota, and a warning names the rest.
    assert "removed what this cell wrote past it" in errors[0]
    assert re.match(r"1[23] files under artifacts/ not kept \(sparse03.bin, ", refused.message)
    # The workspace's version would store the refused files: it is not kept either.
    assert workspace.message.startswith("the workspace's changes were not kept: the session's stored")
    assert "more): the session's stored files would pass storage.quota_session_mb" in refused.message
    assert after_first - before <= 3 * SPARSE_MIB * 2**20 + 2**20
    touched = await harness.events(second)
    assert of(touched, ArtifactCreated) == []  # unchanged content is not stored, nor announced
    assert after_second == after_first


async def test_a_childs_deep_tree_is_removed_with_its_scratch_workspace(
    harness_factory: HarnessFactory,
) -> None:
    """A child's cell nests 2,000 folders (far past Python's recursion limit); its release
    still removes the whole scratch workspace, and says so."""
    deep = (
        "import os\nos.chdir('/workspace/memory')\n"
        "for _ in range(2000):\n    os.mkdir('d')\n    os.chdir('d')\n"
        "os.chdir('/workspace')\nprint('nested')"
    )
    harness = harness_factory(
        action("c = rlm_query('nest folders')\nprint(c)"),
        action("SUBMIT(answer=c)"),
        action(deep, lm="child"),
        action("SUBMIT(answer='nested')", lm="child"),
        rlm={"recursion": True},
        local={"cell_timeout_seconds": 30},
    )
    run_id = await harness.submit()
    await harness.work()
    events = await harness.events(run_id)
    progress = [(p.state, p.cleanup_state) for p in of(events, ChildProgress)]
    assert progress == [("started", "pending"), ("completed", "released")]
    workspaces = harness.settings.data_dir / "workspaces"
    assert sorted(p.name for p in workspaces.iterdir() if p.name.startswith("scratch-")) == []


async def test_scratch_folders_left_by_a_dead_worker_are_swept_when_a_worker_starts(
    harness_factory: HarnessFactory,
) -> None:
    """A worker died holding a child's scratch folder (a deep tree in it); another still holds
    one. The next worker's start removes the first, keeps the second."""
    harness = harness_factory(action("SUBMIT(answer='ok')"))
    workspaces = harness.settings.workspaces_dir
    workspaces.mkdir(parents=True)
    dead, dead_key = hold_scratch(workspaces)
    nest(workspaces / f"scratch-{dead_key}" / "memory" / "deep", 1500)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    alive, alive_key = hold_scratch(workspaces)
    try:
        await harness.submit()
        await harness.work()
        left = sorted(p.name for p in workspaces.iterdir() if p.name.startswith("scratch-"))
        assert left == [f"scratch-{alive_key}", f"scratch-{alive_key}.lock"]
    finally:
        alive.send_signal(signal.SIGKILL)
        alive.wait()
