"""The `daytona` provider at the SDK's HTTP boundary. Daytona is unreachable here, so a fake_daytona
Daytona API runs on loopback (tests/support/fake_daytona.py): the real `daytona` SDK, our relay
and the bridge and REPL driver (as local processes) do the rest. Covered: create with labels and
no Volume, the frame round trip with an `llm_query`, state across cells, interrupt, a cell
timeout, reuse for the session's next Run, release, files in and out, the sweep, SDK errors as
Run failures, startup refusals, and whole Turns that keep the workspace as versions (the sync
itself: test_daytona_workspace_sync.py)."""

from __future__ import annotations

import hashlib
import io
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fleet_shared.config import DaytonaSection, SandboxPythonSection, load_settings
from fleet_shared.config_file import DEFAULT_SANDBOX_PACKAGES
from fleet_shared.db.models import Session
from fleet_worker.errors import SandboxFailed
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.daytona.provider import DaytonaAccess, DaytonaSandboxProvider, daytona_provider
from fleet_worker.sandbox.errors import CellInterrupted, CellTimeout, SandboxUnavailable
from fleet_worker.sandbox.jail import SITE_MOUNT
from tests.support.fake_daytona import FakeDaytona
from tests.support.manifests import manifest_entries

REPO = Path(__file__).resolve().parents[2]
API_KEY = "dtn-test-key-must-not-leak"


@pytest.fixture
def provider(fake_daytona: FakeDaytona) -> DaytonaSandboxProvider:
    section = DaytonaSection(
        cell_timeout_seconds=8, startup_timeout_seconds=30, deployment=f"t{time.time_ns()}"
    )
    return DaytonaSandboxProvider(section, DaytonaAccess(API_KEY, f"{fake_daytona.url}/api", None), Caps())


def echo_upper(prompt: str) -> str:
    return prompt.upper()


def test_a_lease_creates_the_session_sandbox_and_runs_cells_over_the_frame_protocol(
    fake_daytona: FakeDaytona, provider: DaytonaSandboxProvider
) -> None:
    lease = provider.acquire("ws-a", "run-a1", "session-a")
    try:
        sandbox = fake_daytona.sandboxes[lease.sandbox.id]
        body = sandbox.body
        assert {k: v for k, v in body["labels"].items() if k.startswith("fleet.")} == {
            "fleet.deployment": provider.cfg.deployment,
            "fleet.session": "session-a",
            "fleet.run": "run-a1",
            "fleet.workspace": "synced",
        }
        assert not body.get("volumes")  # the workspace is synced with the store, on the sandbox's disk
        assert body["networkBlockAll"] is True and body["snapshot"] == provider.cfg.snapshot
        assert sorted(p.name for p in (sandbox.root / "workspace").iterdir()) == [
            "artifacts",
            "attachments",
            "memory",
            "skills",
        ]
        repl = lease.interpreter_factory()
        first = repl.execute(
            "x = llm_query(prompt='hi there')\nprint('got', x)", {}, {"llm_query": echo_upper}, None
        )
        assert first.error is None and first.stdout == "got HI THERE\n"
        second = repl.execute("print(x * 2)", {}, {}, None)
        assert second.stdout == "HI THEREHI THERE\n"  # one persistent REPL across cells
        final = repl.execute("SUBMIT(answer=x.lower())", {}, {}, ["answer"])
        assert final.final == {"answer": "hi there"}
    finally:
        lease.release()
    assert all(not s.sessions for s in fake_daytona.sandboxes.values())  # the remote commands are gone
    assert API_KEY not in repr(provider.access)


def running(fake_daytona: FakeDaytona, sandbox_id: str) -> int:
    """Session commands still running in a fake_daytona sandbox."""
    sessions = fake_daytona.sandboxes[sandbox_id].sessions.values()
    return sum(1 for commands in sessions for c in commands.values() if c.process.returncode is None)


def test_interrupt_and_timeout_kill_the_cell_and_a_fresh_repl_follows(
    fake_daytona: FakeDaytona, provider: DaytonaSandboxProvider
) -> None:
    """The relay of a killed cell cannot end its remote command, so the lease does at once:
    nothing keeps spinning in the sandbox, and the next REPL opens a session of its own."""
    lease = provider.acquire("ws-b", "run-b1", "session-b")
    sandbox_id = lease.sandbox.id
    try:
        repl = lease.interpreter_factory()
        repl.execute("state = 1", {}, {}, None)
        timer = threading.Timer(2.0, lease.interrupt)
        timer.start()
        with pytest.raises(CellInterrupted):
            repl.execute("while True:\n    pass", {}, {}, None)
        timer.join()
        assert running(fake_daytona, sandbox_id) == 0
        lost = repl.execute("print('state' in globals())", {}, {}, None)
        assert lost.stdout == "False\n"
        with pytest.raises(CellTimeout):
            repl.execute("import time\ntime.sleep(60)", {}, {}, None)
        assert repl.execute("print('alive')", {}, {}, None).stdout == "alive\n"
        assert running(fake_daytona, sandbox_id) == 1  # only the live REPL's command
        assert len(fake_daytona.sandboxes[sandbox_id].sessions) == 1
    finally:
        lease.release()
    assert running(fake_daytona, sandbox_id) == 0


def test_the_next_run_of_a_session_reuses_its_sandbox_with_a_fresh_repl(
    fake_daytona: FakeDaytona, provider: DaytonaSandboxProvider
) -> None:
    first = provider.acquire("ws-c", "run-c1", "session-c")
    first.interpreter_factory().execute(
        "kept = 'only in memory'\nopen('memory/note.txt', 'w').write('on disk')", {}, {}, None
    )
    first.release()
    second = provider.acquire("ws-c", "run-c2", "session-c")
    try:
        assert second.sandbox.id == first.sandbox.id
        assert fake_daytona.sandboxes[second.sandbox.id].labels["fleet.run"] == "run-c2"
        result = second.interpreter_factory().execute(
            "print('kept' in globals(), open('memory/note.txt').read())", {}, {}, None
        )
        assert result.stdout == "False on disk\n"
    finally:
        second.release()
    other = provider.acquire("ws-d", "run-d1", "session-d")
    other.release()
    assert other.sandbox.id != first.sandbox.id


def test_a_child_rlm_gets_a_throwaway_sandbox_deleted_at_release(
    fake_daytona: FakeDaytona, provider: DaytonaSandboxProvider
) -> None:
    lease = provider.acquire_scratch("run-parent")
    sandbox_id = lease.inner.sandbox.id  # type: ignore[attr-defined]
    try:
        body = fake_daytona.sandboxes[sandbox_id].body
        assert {k: v for k, v in body["labels"].items() if k.startswith("fleet.")} == {
            "fleet.deployment": provider.cfg.deployment,
            "fleet.run": "run-parent",
            "fleet.child": "1",
        }
        assert not body.get("volumes") and body["networkBlockAll"] is True
        result = lease.interpreter_factory().execute(
            "import os\nprint(sorted(os.listdir('.')))", {}, {}, None
        )
        assert result.stdout == "['artifacts', 'attachments', 'memory', 'skills']\n"
    finally:
        lease.release()
    assert sandbox_id not in fake_daytona.sandboxes
    lease.release()  # idempotent


def test_files_go_in_and_come_out_without_following_links(
    fake_daytona: FakeDaytona, provider: DaytonaSandboxProvider, tmp_path: Path
) -> None:
    lease = provider.acquire("ws-e", "run-e1", "session-e")
    try:
        source = tmp_path / "report.csv"
        source.write_bytes(b"a,b\n1,2\n")
        lease.files.put("attachments/report.csv", source)
        before = lease.files.stamps("artifacts", 100)
        repl = lease.interpreter_factory()
        repl.execute(
            "import os\nrows = open('attachments/report.csv').read().splitlines()\n"
            "os.makedirs('artifacts/out', exist_ok=True)\n"
            "open('artifacts/out/count.txt', 'w').write(str(len(rows)))\n"
            "os.symlink('/etc/passwd', 'artifacts/link')",
            {},
            {},
            None,
        )
        after = lease.files.stamps("artifacts", 100)
        assert before == {} and sorted(after) == ["out/count.txt"]
        sink = io.BytesIO()
        assert lease.files.export("artifacts/out/count.txt", sink, 100) == 1 and sink.getvalue() == b"2"
        (fake_daytona.sandboxes[lease.sandbox.id].root / "workspace" / "artifacts" / "empty.txt").touch()
        assert lease.files.export("artifacts/empty.txt", io.BytesIO(), 100) == 0
        with pytest.raises(ValueError):
            lease.files.export("artifacts/out/count.txt", io.BytesIO(), 0)
        with pytest.raises(FileNotFoundError):
            lease.files.export("artifacts/link", io.BytesIO(), 100)
        # Swapped for a huge file between the look and the copy: the copy stops at the cap.
        fake_daytona.swapped_on_download["/workspace/artifacts/out/count.txt"] = b"x" * 3_000_000
        capped = io.BytesIO()
        with pytest.raises(ValueError):
            lease.files.export("artifacts/out/count.txt", capped, 1000)
        assert len(capped.getvalue()) <= 1000
    finally:
        lease.release()


def test_the_sweep_deletes_only_sandboxes_whose_run_is_idle(
    fake_daytona: FakeDaytona, provider: DaytonaSandboxProvider
) -> None:
    busy = provider.acquire("ws-f", "run-busy", "session-f")
    idle = provider.acquire("ws-g", "run-idle", "session-g")
    for lease in (busy, idle):
        lease.release()
    asked: list[str | None] = []

    def is_idle(run_id: str | None) -> bool:
        asked.append(run_id)
        return run_id == "run-idle"

    assert provider.sweep(is_idle) == 1
    assert sorted(a for a in asked if a) == ["run-busy", "run-idle"]
    assert busy.sandbox.id in fake_daytona.sandboxes and idle.sandbox.id not in fake_daytona.sandboxes


@pytest.mark.parametrize(
    ("status", "message", "code"),
    [
        (401, "Invalid API key", "sandbox_auth"),
        (429, "Too many requests", "sandbox_quota"),
        (403, "Organization quota exceeded: max sandboxes", "sandbox_quota"),
        (404, "Snapshot fleet-repl not found", "sandbox_snapshot_missing"),
        (500, "boom", "sandbox_unavailable"),
    ],
)
def test_sdk_errors_become_clear_run_failures(
    fake_daytona: FakeDaytona, provider: DaytonaSandboxProvider, status: int, message: str, code: str
) -> None:
    fake_daytona.fail_next["POST /api/sandbox"] = (status, message)
    with pytest.raises(SandboxFailed) as raised:
        provider.acquire("ws-h", f"run-{status}", f"session-h-{status}")
    assert raised.value.code == code
    assert API_KEY not in raised.value.message and fake_daytona.url not in raised.value.message


def settings_for(profile: str) -> Any:
    return load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_PROFILE": profile,
            "FLEET_REDIS_URL": "redis://127.0.0.1:1/0",
            "FLEET_LM_MODEL": "openai/x",
            "FLEET_LM_API_KEY": "k",
            "FLEET_LM_BASE_URL": "http://127.0.0.1:1/v1",
        }
    )


def test_an_unconfigured_provider_is_refused_at_startup_with_one_line() -> None:
    settings = settings_for("daytona")
    with pytest.raises(SandboxUnavailable) as missing_key:
        daytona_provider(settings, {"FLEET_DAYTONA_API_URL": "http://127.0.0.1:1/api"})
    assert "FLEET_DAYTONA_API_KEY" in str(missing_key.value) and "\n" not in str(missing_key.value)
    with pytest.raises(SandboxUnavailable, match="FLEET_DAYTONA_API_URL"):
        daytona_provider(settings, {"FLEET_DAYTONA_API_KEY": "k"})
    sandbox = msgspec.structs.replace(settings.profile.sandbox, daytona=None)
    bare = msgspec.structs.replace(
        settings, profile=msgspec.structs.replace(settings.profile, sandbox=sandbox)
    )
    with pytest.raises(SandboxUnavailable, match=r"no \[sandbox.daytona\] table"):
        daytona_provider(bare, {"FLEET_DAYTONA_API_KEY": "k"})
    provider = daytona_provider(
        settings, {"FLEET_DAYTONA_API_KEY": "k", "FLEET_DAYTONA_API_URL": "http://x/api"}
    )
    assert provider.mode.startswith("daytona")


def cli_env(fake_daytona: FakeDaytona, tmp_path: Path) -> dict[str, str]:
    import os

    return {
        **os.environ,
        "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
        "FLEET_PROFILE": "daytona",
        "FLEET_REDIS_URL": "redis://127.0.0.1:1/0",
        "FLEET_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'fleet.db'}",
        "FLEET_LM_MODEL": "openai/x",
        "FLEET_LM_API_KEY": "k",
        "FLEET_LM_BASE_URL": "http://127.0.0.1:1/v1",
        "FLEET_DAYTONA_API_KEY": API_KEY,
        "FLEET_DAYTONA_API_URL": f"{fake_daytona.url}/api",
    }


def fleet_cli(env: dict[str, str], *args: str) -> Any:
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "fleet_cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_fleet_doctor_daytona_runs_a_cell_in_a_disposable_sandbox(
    fake_daytona: FakeDaytona, tmp_path: Path
) -> None:
    before = set(fake_daytona.sandboxes)
    done = fleet_cli(cli_env(fake_daytona, tmp_path), "doctor", "daytona")
    assert done.returncode == 0, done.stderr
    assert "daytona: ok" in done.stdout and "42 (3, 11)" in done.stdout
    assert set(fake_daytona.sandboxes) == before  # deleted in `finally`
    assert API_KEY not in done.stdout + done.stderr


def test_fleet_daytona_snapshot_pins_the_repl_python(fake_daytona: FakeDaytona, tmp_path: Path) -> None:
    done = fleet_cli(cli_env(fake_daytona, tmp_path), "daytona", "snapshot")
    assert done.returncode == 0, done.stderr
    body = fake_daytona.snapshots["fleet-repl"]
    dockerfile = body["buildInfo"]["dockerfileContent"]
    assert "python:3.11" in dockerfile
    # The profile's packages, wheels only, where the REPL looks for them (as in a local jail).
    (install,) = [line for line in dockerfile.splitlines() if "pip install" in line and "--target" in line]
    assert all(package in install for package in DEFAULT_SANDBOX_PACKAGES), install
    assert f"--only-binary=:all: --target {SITE_MOUNT}" in install


@pytest.mark.parametrize(
    ("python", "args"),
    [
        (SandboxPythonSection(preload=("pandas",)), f" --site {SITE_MOUNT} --preload pandas"),
        (SandboxPythonSection(), f" --site {SITE_MOUNT}"),
        (SandboxPythonSection(packages=()), ""),  # the standard library only: nothing to add
    ],
)
def test_the_daytona_repl_adds_the_snapshots_packages_to_its_path(
    fake_daytona: FakeDaytona, python: SandboxPythonSection, args: str
) -> None:
    access = DaytonaAccess(API_KEY, f"{fake_daytona.url}/api", None)
    provider = DaytonaSandboxProvider(DaytonaSection(), access, Caps(), python=python)
    assert provider.site_args() == args


def test_fleet_worker_refuses_an_unconfigured_daytona_profile_with_one_line(
    fake_daytona: FakeDaytona, tmp_path: Path
) -> None:
    env = cli_env(fake_daytona, tmp_path)
    del env["FLEET_DAYTONA_API_KEY"]
    done = fleet_cli(env, "worker")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("fleet:")]
    assert len(lines) == 1 and "FLEET_DAYTONA_API_KEY" in lines[0]


async def test_whole_turns_run_in_daytona_and_keep_the_workspace_as_versions(
    fake_daytona: FakeDaytona, harness_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real arq worker with `sandbox.provider = "daytona"`: the Turn's cells, its llm_query and
    its artifact all go through the SDK to the fake_daytona, and the Turn commits its workspace as a
    version. The session's next Turn, on a new worker (no record of the sandbox), finds its
    note without a file being sent again, and leaves the same version."""
    from fleet_shared.db import queries, workspace_versions
    from fleet_shared.events import ArtifactCreated

    code = (
        "if request == 'read':\n    SUBMIT(answer=open('memory/note.txt').read())\n"
        "reply = llm_query(prompt='say hi')\nimport os\nos.makedirs('artifacts', exist_ok=True)\n"
        "open('artifacts/reply.txt', 'w').write(reply)\nopen('memory/note.txt', 'w').write('kept')\n"
        "SUBMIT(answer=reply)"
    )
    harness = harness_factory(
        {"lm": "root", "reasoning": "ask, keep, answer", "code": code},
        {"lm": "sub", "text": "hello from the sub-LM"},
    )
    monkeypatch.setenv("FLEET_DAYTONA_API_KEY", API_KEY)
    monkeypatch.setenv("FLEET_DAYTONA_API_URL", f"{fake_daytona.url}/api")
    section = DaytonaSection(
        api_url_env="FLEET_DAYTONA_API_URL",
        cell_timeout_seconds=20,
        startup_timeout_seconds=30,
        deployment="turn",
    )
    sandbox = msgspec.structs.replace(harness.settings.profile.sandbox, provider="daytona", daytona=section)
    profile = msgspec.structs.replace(harness.settings.profile, sandbox=sandbox)
    harness.settings = msgspec.structs.replace(harness.settings, profile=profile)
    run_id = await harness.submit("hi")
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None and run.status == "completed", run.failure_message if run else None
        session = await db.get(Session, run.session_id)
        assert session is not None
        first = await workspace_versions.version_row(db, session.workspace_id)
        assert first is not None and (first.version, first.run_id) == (1, run_id)
        manifest = await manifest_entries(db, first.manifest_sha256)
    [artifact] = [e for e in await harness.events(run_id) if isinstance(e, ArtifactCreated)]
    assert artifact.name == "reply.txt" and artifact.byte_size == len("hello from the sub-LM")
    labelled = [s for s in fake_daytona.sandboxes.values() if s.labels.get("fleet.run") == run_id]
    assert len(labelled) == 1 and labelled[0].labels["fleet.session"] == run.session_id
    assert manifest is not None
    assert {e.path: e.sha256 for e in manifest.entries} == {
        "artifacts/reply.txt": artifact.checksum_sha256,
        "memory/note.txt": hashlib.sha256(b"kept").hexdigest(),
    }
    assert first.added_bytes == len("kept")  # the artifact is counted as an artifact

    uploads = len(fake_daytona.uploaded)
    read = await harness.submit("read", session_id=run.session_id, key="k2")
    await harness.work()
    async with harness.db_sessions() as db:
        second = await workspace_versions.version_row(db, session.workspace_id)
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    assert second is not None and (second.version, second.run_id) == (2, read)
    assert second.manifest_sha256 == first.manifest_sha256 and second.added_bytes == 0
    assert "kept" in [p.get("text") for t in turns for p in t.parts if p["type"] == "text"]
    assert [p for p in fake_daytona.uploaded[uploads:] if p.startswith("/workspace/")] == []
