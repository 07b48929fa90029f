"""What a sandbox leaves on the host, and what of the host it can see (issue #29, items 4 to 6),
each against the real bwrap jail: links planted in the workspace, host paths and pids in the
jail's mount table, what /usr/local shows, and the REPL's own leaks (closed stdio, zombies, a
process the memory limit killed)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_shared.confined import MAX_DEPTH
from fleet_worker.sandbox.boundary import Caps, CellResult
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.lease import LocalSandboxLease
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.session import ReplSession
from fleet_worker.sandbox.volumes import WorkspaceVolumes

REPO = Path(__file__).resolve().parents[2]
WORKSPACE = "ws-leaks"
# Plain folders (a non-root worker's way), and a root worker's volumes where this host has them.
FOLDER_KINDS = [
    pytest.param(False, id="folder"),
    pytest.param(
        True,
        id="volume",
        marks=pytest.mark.skipif(not WorkspaceVolumes.available(), reason="needs root, mkfs.ext4 and mount"),
    ),
]


class Sandboxes:
    """Providers placed in a data dir of their own, as a worker places them."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.providers: list[LocalSandboxProvider] = []
        self.leases: list[LocalSandboxLease] = []

    def lease(self, **settings: Any) -> LocalSandboxLease:
        cfg = LocalSandboxConfig(**{"cell_timeout_seconds": 30.0, "workspace_mb": 64, **settings})
        provider = LocalSandboxProvider(cfg, caps=Caps(max_output_chars=20_000))
        provider.place_workspaces(self.data_dir / "workspaces", self.data_dir / "relocated")
        self.providers.append(provider)
        lease = provider.acquire(WORKSPACE, "run-leaks")
        self.leases.append(lease)
        return lease

    def close(self) -> None:
        for lease in self.leases:
            lease.release()
        for provider in self.providers:
            provider.close()


@pytest.fixture
def sandboxes(traversable_dir: Path) -> Iterator[Sandboxes]:
    made = Sandboxes(traversable_dir / "data")
    yield made
    made.close()


def run(session: ReplSession, code: str) -> CellResult:
    return session.execute(code, {}, {}, None)


def planted_on_host(root: Path) -> list[str]:
    """Every link, device, fifo and socket under `root`, found without following any."""
    found = []
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            mode = os.lstat(os.path.join(folder, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found)


PLANT = f"""
import os, socket
art = '/workspace/artifacts'
os.symlink('/etc/shadow', art + '/shadow_link')
os.symlink('/usr', art + '/host_folder')
os.symlink('../memory', art + '/inside_link')
os.mkdir(art + '/nested')
os.symlink('/etc/passwd', art + '/nested/passwd_link')
os.mkfifo(art + '/nested/fifo')
listener = socket.socket(socket.AF_UNIX)
listener.bind(art + '/nested/socket')
os.mkdir(art + '/locked')
os.symlink('/etc', art + '/locked/etc_link')
os.chmod(art + '/locked', 0)
path = art + '/deep'
for _ in range({MAX_DEPTH + 6}):
    path += '/d'
os.makedirs(path)
os.symlink('/etc/shadow', path + '/deep_link')
open(art + '/kept.txt', 'w').write('kept')
print(sorted(os.listdir(art)))
"""


@pytest.mark.parametrize("volumes", FOLDER_KINDS)
def test_a_runs_links_devices_and_fifos_are_gone_from_the_host_when_it_ends(
    sandboxes: Sandboxes, volumes: bool
) -> None:
    lease = sandboxes.lease(workspace_volumes=volumes)
    result = run(lease.interpreter_factory(), PLANT)
    assert "shadow_link" in result.stdout  # (the deep tree is over the budget: the cell is told)
    assert planted_on_host(lease.workspace)  # planted, and on the host while the Run lasts

    lease.release()

    assert planted_on_host(lease.workspace) == []
    artifacts = lease.workspace / "artifacts"
    assert (artifacts / "kept.txt").read_text() == "kept"  # the Run's files stay
    assert (artifacts / "locked").is_dir()  # a folder the sandbox locked is reachable again
    deepest = max(len(Path(folder).relative_to(lease.workspace).parts) for folder, *_ in os.walk(artifacts))
    assert deepest <= MAX_DEPTH  # what the walk would not reach is gone, with the link inside
