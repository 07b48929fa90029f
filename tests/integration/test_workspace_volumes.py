"""The workspace budget as a hard limit (a root worker's volumes, fleet_worker.sandbox.volumes):
a cell writing as fast and as wide as it can never takes the host's workspace folder past the
budget; the kernel refuses the write (ENOSPC), the Run goes on, and the next Turn works.

Part of the escape suite (`uv run pytest -m escape`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from fleet_worker.sandbox.volumes import WorkspaceVolumes
from tests.integration.harness import Harness
from tests.integration.test_escape import attack, workspace_folders

pytestmark = pytest.mark.escape
needs_volumes = pytest.mark.skipif(not WorkspaceVolumes.available(), reason="needs root, mkfs.ext4 and mount")
BUDGET_MIB = 64
WRITERS = 4
WRITER = (
    "import os\n"
    "while True:\n"
    "    name = '/workspace/memory/%d-%s' % (os.getpid(), os.urandom(4).hex())\n"
    "    try:\n"
    "        with open(name, 'wb') as out:\n"
    "            for _ in range(16):\n"
    "                out.write(b'x' * 2**20)\n"
    "    except OSError as exc:\n"
    "        print(exc.strerror)\n"
    "        break\n"
)
FLOOD = (
    "import subprocess, sys\n"
    f"code = {WRITER!r}\n"
    "run = lambda: subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)\n"
    f"procs = [run() for _ in range({WRITERS})]\n"
    "result = sorted(set(p.communicate()[0].strip() for p in procs))"
)


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    return sqlite_url


def allocated(root: Path) -> int:
    total = 0
    for folder, _dirs, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


class Watch:
    """The most the workspaces folder held at any moment (sampled every 10 ms)."""

    def __init__(self, root: Path) -> None:
        self.root, self.most = root, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.done.wait(0.01):
            if self.root.exists():
                self.most = max(self.most, allocated(self.root))

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.done.set()
        self.thread.join()


@needs_volumes
async def test_a_workspace_never_holds_more_than_its_budget(harness_factory: Callable[..., Harness]) -> None:
    probe = harness_factory()
    with Watch(Path(probe.settings.workspaces_dir)) as watch:
        outcome = await attack(
            harness_factory,
            FLOOD,
            local={"workspace_mb": BUDGET_MIB, "max_file_mb": 64, "cell_timeout_seconds": 30},
        )
    assert outcome.answer == "['No space left on device']", outcome.cell_outputs
    budget = BUDGET_MIB * 2**20
    # Slack: the blocks ext4 spends on a file's extent tree beyond its data, a few per file.
    assert watch.most <= budget + 2**20, f"the workspace held {watch.most / 2**20:.0f} MiB"
    print(f"most held: {watch.most / 2**20:.1f} MiB against a {BUDGET_MIB} MiB budget")


async def test_without_volumes_what_a_cell_writes_past_the_budget_is_removed(
    harness_factory: Callable[..., Harness],
) -> None:
    """A non-root worker (no volumes) checks the budget on every watch of a running cell: a cell
    writing past it is stopped, and what it wrote past it is removed once it is killed."""
    outcome = await attack(
        harness_factory,
        FLOOD,
        local={
            "workspace_mb": BUDGET_MIB,
            "max_file_mb": 64,
            "cell_timeout_seconds": 30,
            "workspace_volumes": False,
        },
    )
    stopped = next(o.error for o in outcome.cell_outputs if o.error)
    assert "grew past its 64 MiB budget" in stopped and "removed what this cell wrote past it" in stopped
    [folder] = [f for f in workspace_folders(outcome) if f.is_dir()]
    assert allocated(folder) <= BUDGET_MIB * 2**20
