"""The `daytona` provider at the SDK's HTTP boundary. Daytona is unreachable here, so a fake
Daytona API runs on loopback (tests/support/fake_daytona.py): the real `daytona` SDK, our relay
and the bridge and REPL driver (as local processes) do the rest. Covered: create with labels and
a volume subpath, the frame round trip with an `llm_query`, state across cells, interrupt, a cell
timeout, reuse for the session's next Run, release, files in and out, the sweep, SDK errors as
Run failures, and startup refusals."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fleet_shared.config import DaytonaSection, load_settings
from fleet_worker.errors import SandboxFailed
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.daytona.provider import DaytonaAccess, DaytonaSandboxProvider, daytona_provider
from fleet_worker.sandbox.errors import CellInterrupted, CellTimeout, SandboxUnavailable
from tests.support.fake_daytona import FakeDaytona

REPO = Path(__file__).resolve().parents[2]
API_KEY = "dtn-test-key-must-not-leak"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeDaytona]:
    server = FakeDaytona().start()
    yield server
    server.stop()


@pytest.fixture
def provider(fake: FakeDaytona) -> DaytonaSandboxProvider:
    section = DaytonaSection(
        cell_timeout_seconds=8, startup_timeout_seconds=30, deployment=f"t{time.time_ns()}"
    )
    return DaytonaSandboxProvider(section, DaytonaAccess(API_KEY, f"{fake.url}/api", None), Caps())


def echo_upper(prompt: str) -> str:
    return prompt.upper()


def test_a_lease_creates_the_session_sandbox_and_runs_cells_over_the_frame_protocol(
    fake: FakeDaytona, provider: DaytonaSandboxProvider
) -> None:
    lease = provider.acquire("ws-a", "run-a1", "session-a")
    try:
        sandbox = fake.sandboxes[lease.sandbox.id]
        body = sandbox.body
        assert {k: v for k, v in body["labels"].items() if k.startswith("fleet.")} == {
            "fleet.deployment": provider.cfg.deployment,
            "fleet.session": "session-a",
            "fleet.run": "run-a1",
        }
        volume = fake.volumes[provider.cfg.volume]["id"]
        assert body["volumes"] == [{"volumeId": volume, "mountPath": "/workspace", "subpath": "ws-a"}]
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
    assert all(not s.sessions for s in fake.sandboxes.values())  # the remote commands are gone
    assert API_KEY not in repr(provider.access)


def running(fake: FakeDaytona, sandbox_id: str) -> int:
    """Session commands still running in a fake sandbox."""
    sessions = fake.sandboxes[sandbox_id].sessions.values()
    return sum(1 for commands in sessions for c in commands.values() if c.process.returncode is None)


def test_interrupt_and_timeout_kill_the_cell_and_a_fresh_repl_follows(
    fake: FakeDaytona, provider: DaytonaSandboxProvider
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
        assert running(fake, sandbox_id) == 0
        lost = repl.execute("print('state' in globals())", {}, {}, None)
        assert lost.stdout == "False\n"
        with pytest.raises(CellTimeout):
            repl.execute("import time\ntime.sleep(60)", {}, {}, None)
        assert repl.execute("print('alive')", {}, {}, None).stdout == "alive\n"
        assert running(fake, sandbox_id) == 1  # only the live REPL's command
        assert len(fake.sandboxes[sandbox_id].sessions) == 1
    finally:
        lease.release()
    assert running(fake, sandbox_id) == 0


def test_the_next_run_of_a_session_reuses_its_sandbox_with_a_fresh_repl(
    fake: FakeDaytona, provider: DaytonaSandboxProvider
) -> None:
    first = provider.acquire("ws-c", "run-c1", "session-c")
    first.interpreter_factory().execute(
        "kept = 'only in memory'\nopen('memory/note.txt', 'w').write('on disk')", {}, {}, None
    )
    first.release()
    second = provider.acquire("ws-c", "run-c2", "session-c")
    try:
        assert second.sandbox.id == first.sandbox.id
        assert fake.sandboxes[second.sandbox.id].labels["fleet.run"] == "run-c2"
        result = second.interpreter_factory().execute(
            "print('kept' in globals(), open('memory/note.txt').read())", {}, {}, None
        )
        assert result.stdout == "False on disk\n"
    finally:
        second.release()
    other = provider.acquire("ws-d", "run-d1", "session-d")
    other.release()
    assert other.sandbox.id != first.sandbox.id


def test_a_child_rlm_gets_a_throwaway_sandbox_without_the_volume_deleted_at_release(
    fake: FakeDaytona, provider: DaytonaSandboxProvider
) -> None:
    lease = provider.acquire_scratch("run-parent")
    sandbox_id = lease.inner.sandbox.id  # type: ignore[attr-defined]
    try:
        body = fake.sandboxes[sandbox_id].body
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
    assert sandbox_id not in fake.sandboxes
    lease.release()  # idempotent


def test_files_go_in_and_come_out_without_following_links(
    fake: FakeDaytona, provider: DaytonaSandboxProvider, tmp_path: Path
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
        with pytest.raises(ValueError):
            lease.files.export("artifacts/out/count.txt", io.BytesIO(), 0)
        with pytest.raises(FileNotFoundError):
            lease.files.export("artifacts/link", io.BytesIO(), 100)
        # Swapped for a huge file between the look and the copy: the copy stops at the cap.
        fake.swapped_on_download["/workspace/artifacts/out/count.txt"] = b"x" * 3_000_000
        capped = io.BytesIO()
        with pytest.raises(ValueError):
            lease.files.export("artifacts/out/count.txt", capped, 1000)
        assert len(capped.getvalue()) <= 1000
    finally:
        lease.release()


def test_the_sweep_deletes_only_sandboxes_whose_run_is_idle(
    fake: FakeDaytona, provider: DaytonaSandboxProvider
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
    assert busy.sandbox.id in fake.sandboxes and idle.sandbox.id not in fake.sandboxes


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
    fake: FakeDaytona, provider: DaytonaSandboxProvider, status: int, message: str, code: str
) -> None:
    fake.fail_next["POST /api/sandbox"] = (status, message)
    with pytest.raises(SandboxFailed) as raised:
        provider.acquire("ws-h", f"run-{status}", f"session-h-{status}")
    assert raised.value.code == code
    assert API_KEY not in raised.value.message and fake.url not in raised.value.message


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


def cli_env(fake: FakeDaytona, tmp_path: Path) -> dict[str, str]:
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
        "FLEET_DAYTONA_API_URL": f"{fake.url}/api",
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


def test_fleet_doctor_daytona_runs_a_cell_in_a_disposable_sandbox(fake: FakeDaytona, tmp_path: Path) -> None:
    before = set(fake.sandboxes)
    done = fleet_cli(cli_env(fake, tmp_path), "doctor", "daytona")
    assert done.returncode == 0, done.stderr
    assert "daytona: ok" in done.stdout and "42 (3, 11)" in done.stdout
    assert set(fake.sandboxes) == before  # deleted in `finally`
    assert API_KEY not in done.stdout + done.stderr


def test_fleet_daytona_snapshot_pins_the_repl_python(fake: FakeDaytona, tmp_path: Path) -> None:
    done = fleet_cli(cli_env(fake, tmp_path), "daytona", "snapshot")
    assert done.returncode == 0, done.stderr
    body = fake.snapshots["fleet-repl"]
    assert "python:3.11" in body["buildInfo"]["dockerfileContent"]


def test_fleet_worker_refuses_an_unconfigured_daytona_profile_with_one_line(
    fake: FakeDaytona, tmp_path: Path
) -> None:
    env = cli_env(fake, tmp_path)
    del env["FLEET_DAYTONA_API_KEY"]
    done = fleet_cli(env, "worker")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("fleet:")]
    assert len(lines) == 1 and "FLEET_DAYTONA_API_KEY" in lines[0]


async def test_a_whole_turn_runs_in_daytona(
    fake: FakeDaytona, harness_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real arq worker with `sandbox.provider = "daytona"`: the Turn's cells, its llm_query and
    its artifact all go through the SDK to the fake, and the Turn commits."""
    from fleet_shared.db import queries
    from fleet_shared.events import ArtifactCreated

    code = (
        "reply = llm_query(prompt='say hi')\nimport os\nos.makedirs('artifacts', exist_ok=True)\n"
        "open('artifacts/reply.txt', 'w').write(reply)\nSUBMIT(answer=reply)"
    )
    harness = harness_factory(
        {"lm": "root", "reasoning": "ask, keep, answer", "code": code},
        {"lm": "sub", "text": "hello from the sub-LM"},
    )
    monkeypatch.setenv("FLEET_DAYTONA_API_KEY", API_KEY)
    monkeypatch.setenv("FLEET_DAYTONA_API_URL", f"{fake.url}/api")
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
    async with harness.sessions() as db:
        run = await queries.get_run(db, run_id)
    assert run is not None and run.status == "completed", run.failure_message if run else None
    [artifact] = [e for e in await harness.events(run_id) if isinstance(e, ArtifactCreated)]
    assert artifact.name == "reply.txt" and artifact.byte_size == len("hello from the sub-LM")
    labelled = [s for s in fake.sandboxes.values() if s.labels.get("fleet.run") == run_id]
    assert len(labelled) == 1 and labelled[0].labels["fleet.session"] == run.session_id
