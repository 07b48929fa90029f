"""The attack chain from sandbox code to the host, link by link: a cell plants an interpreter in its
workspace; a settings request that names it is refused, and a policy file edited by hand to name
it stops the worker before the planted file runs anywhere. A data dir that already exists (a
shared /tmp) keeps its mode.

Part of the escape suite (`uv run pytest -m escape`).
"""

from __future__ import annotations

import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from fleet_shared.config import Settings, load_settings
from fleet_worker.app import sandbox_provider
from fleet_worker.sandbox.errors import SandboxUnavailable
from fleet_worker.sandbox.local import prepare_workspace_root
from tests.integration.harness import Harness
from tests.integration.test_escape import HOST_FOLDERS, attack, workspace_folders
from tests.support.peer import peer_client

pytestmark = pytest.mark.escape
REPO = Path(__file__).resolve().parents[2]

# What the outside attacker's cell did: an executable that runs python3, planted in memory/ with
# its folders opened up; here it also leaves a mark beside itself whenever anything runs it.
PLANT = """
import os
script = '#!/bin/sh\\ntouch "$(dirname "$0")/ran"\\nexec /usr/bin/python3 "$@"\\n'
open('/workspace/memory/py', 'w').write(script)
os.chmod('/workspace/memory/py', 0o755)
os.chmod('/workspace/memory', 0o777)
os.chmod('/workspace', 0o755)
result = 'planted'
"""


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    return sqlite_url


def with_python(settings: Settings, python: str) -> Settings:
    """The settings a worker would load after someone wrote `python = ...` into the file."""
    sandbox = settings.profile.sandbox
    local = msgspec.structs.replace(sandbox.local, python=python)
    profile = msgspec.structs.replace(settings.profile, sandbox=msgspec.structs.replace(sandbox, local=local))
    return msgspec.structs.replace(settings, profile=profile)


async def test_an_interpreter_a_cell_plants_is_refused_by_request_and_by_startup(
    harness_factory: Callable[..., Harness],
    work_dir: Path,
    sqlite_url: str,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_REDIS_URL", redis_url)  # a change is checked with the gateway's env
    outcome = await attack(harness_factory, PLANT, local=HOST_FOLDERS)  # the planted file outlives it
    [workspace] = [f for f in workspace_folders(outcome) if not f.name.startswith("scratch-")]
    planted = workspace / "memory" / "py"
    assert outcome.answer == "planted" and planted.is_file()

    policy = work_dir / "policy"
    shutil.copytree(REPO / "config", policy)
    settings = load_settings(
        {
            "FLEET_CONFIG": str(policy / "fleet.toml"),
            "FLEET_DATABASE_URL": sqlite_url,
            "FLEET_REDIS_URL": redis_url,
        }
    )
    before = (policy / "fleet.toml").read_bytes()
    with peer_client(settings, "127.0.0.1") as client:
        revision = client.get("/api/settings").json()["revision"]
        change = {"profiles.offline.sandbox.local.python": str(planted)}
        response = client.patch("/api/settings", json={"revision": revision, "set": change})
    assert response.status_code == 422, response.text
    assert "only the file on disk" in response.json()["message"]
    assert (policy / "fleet.toml").read_bytes() == before

    with pytest.raises(SandboxUnavailable, match=r"inside .*where sandboxed code writes"):
        sandbox_provider(with_python(outcome.harness.settings, str(planted)))
    assert not (workspace / "memory" / "ran").exists(), "the planted interpreter ran on the host"


def test_a_data_dir_that_exists_keeps_its_mode(tmp_path: Path) -> None:
    """`data_dir = "/tmp"` made /tmp 0711 for every user on the host."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    root = prepare_workspace_root(shared / "workspaces")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert stat.S_IMODE(root.stat().st_mode) == 0o711  # what fleet made is its own
