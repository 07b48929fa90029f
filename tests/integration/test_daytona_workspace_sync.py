"""A Daytona sandbox's workspace synced with the store at a lease's start and end, at the SDK's
HTTP boundary (the fake_daytona Daytona of tests/support/fake_daytona.py; its sandboxes are folders, so
"the Run" and "someone else" change files by writing there). The store is a local blob store.
Covered: a version materialised and captured again unchanged, a second Turn that sends and
fetches only what changed, a sandbox changed out of band corrected at the next lease, a capture
over quota that stores nothing, a worker with no record (restarted) converging, an overgrown
workspace reset, and a sandbox from before the sync never reused."""

from __future__ import annotations

import hashlib
import io
import os
import time
from pathlib import Path

import pytest
from obstore.store import LocalStore

from fleet_shared.blobs import BlobStore
from fleet_shared.config import DaytonaSection
from fleet_shared.manifests import FileEntry, Manifest
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.daytona.provider import DaytonaAccess, DaytonaLease, DaytonaSandboxProvider
from fleet_worker.sandbox.daytona.sync import DaytonaVersions
from fleet_worker.sandbox.provider import OverQuota
from fleet_worker.workspace_objects import WorkspaceObjects
from tests.support.fake_daytona import FakeDaytona

BIG = 3 * 2**20  # past the size that is sent in memory: streamed alone


@pytest.fixture
def objects(tmp_path: Path) -> WorkspaceObjects:
    folder = tmp_path / "blobs"
    folder.mkdir()
    blobs = BlobStore(LocalStore(prefix=folder, mkdir=True), "local", folder)
    return WorkspaceObjects(blobs, tmp_path / "cache", 64 * 2**20)


@pytest.fixture
def deployment() -> str:
    return f"sync{time.time_ns()}"


def worker(
    fake_daytona: FakeDaytona, objects: WorkspaceObjects, deployment: str, files: int = 1000
) -> DaytonaSandboxProvider:
    """A worker's provider: a new one is a worker that knows nothing of any sandbox."""
    section = DaytonaSection(deployment=deployment, workspace_files=files, startup_timeout_seconds=30)
    versions = DaytonaVersions(objects, section.workspace_files)
    return DaytonaSandboxProvider(
        section, DaytonaAccess("k", f"{fake_daytona.url}/api", None), Caps(), versions=versions
    )


def version(objects: WorkspaceObjects, files: dict[str, tuple[bytes, int]]) -> Manifest:
    """A version holding `files` (path: bytes, mode), their bytes in the store."""
    entries = []
    for path, (data, mode) in files.items():
        sha256, size = objects.store(io.BytesIO(data))
        entries.append(FileEntry(path, size, mode, sha256, 1_700_000_000_123_456_789))
    return Manifest.of(entries)


def workspace(fake_daytona: FakeDaytona, lease: DaytonaLease) -> Path:
    return fake_daytona.sandboxes[lease.sandbox.id].root / "workspace"


def held(folder: Path) -> dict[str, tuple[bytes, int]]:
    """The regular files under a fake_daytona sandbox's workspace: path: (bytes, mode)."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mode & 0o777)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def sent(fake_daytona: FakeDaytona, since: int) -> list[str]:
    """Workspace files uploaded since `since` (the REPL's own files go on every lease)."""
    return sorted(p for p in fake_daytona.uploaded[since:] if p.startswith("/workspace/"))


def content(manifest: Manifest) -> dict[str, tuple[int, int, str]]:
    """What a version holds, its files' times aside."""
    return {e.path: (e.size, e.mode, e.sha256) for e in manifest.entries}


def stored_objects(objects: WorkspaceObjects) -> set[str]:
    assert objects.blobs.folder is not None
    return {p.name for p in (objects.blobs.folder / "workspaces").glob("*")}


def rewrite(path: Path, data: bytes) -> None:
    """A change the listing must see: new bytes, and a time no upload had."""
    path.write_bytes(data)
    os.utime(path, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))


FIRST = {
    "memory/note.txt": (b"first note", 0o644),
    "memory/deep/er/tool.sh": (b"#!/bin/sh\necho hi\n", 0o755),
    "skills/empty.md": (b"", 0o600),
    "memory/big.bin": (bytes(range(256)) * (BIG // 256), 0o644),
}


def test_a_version_is_materialised_and_captured_again_unchanged(
    fake_daytona: FakeDaytona, objects: WorkspaceObjects, deployment: str
) -> None:
    provider = worker(fake_daytona, objects, deployment)
    manifest = version(objects, FIRST)
    lease = provider.acquire("ws-1", "run-1", "session-1", manifest)
    try:
        assert held(workspace(fake_daytona, lease)) == FIRST
        downloads = len(fake_daytona.downloaded)
        captured = lease.capture()
    finally:
        lease.release()
    assert content(captured.manifest) == content(manifest) and captured.added_bytes == 0
    assert len(fake_daytona.downloaded) == downloads  # nothing changed, nothing fetched
    # The SDK cannot set a file's time: the version names the sandbox's, so any worker can tell
    # the file unchanged by listing it (the next test but two).
    assert {e.mtime_ns for e in captured.manifest.entries} != {e.mtime_ns for e in manifest.entries}


def test_a_second_turn_sends_and_fetches_only_what_changed(
    fake_daytona: FakeDaytona, objects: WorkspaceObjects, deployment: str
) -> None:
    provider = worker(fake_daytona, objects, deployment)
    first = provider.acquire("ws-2", "run-2a", "session-2", version(objects, FIRST))
    folder = workspace(fake_daytona, first)
    (folder / "memory" / "note.txt").write_text("the second note")  # the Run's changes
    (folder / "artifacts" / "out.txt").write_text("result")
    (folder / "memory" / "deep" / "er" / "tool.sh").unlink()
    os.symlink("/etc/passwd", folder / "memory" / "link")
    fetched = len(fake_daytona.downloaded)
    captured = first.capture(counted=frozenset({"artifacts/out.txt"}))
    first.release()
    assert sorted(fake_daytona.downloaded[fetched:]) == [
        "/workspace/artifacts/out.txt",
        "/workspace/memory/note.txt",
    ]
    files = {e.path: e for e in captured.manifest.entries}
    assert sorted(files) == ["artifacts/out.txt", "memory/big.bin", "memory/note.txt", "skills/empty.md"]
    assert files["memory/note.txt"].sha256 == hashlib.sha256(b"the second note").hexdigest()
    assert captured.added_bytes == len("the second note")  # the artifact is counted as one

    uploads = len(fake_daytona.uploaded)
    second = provider.acquire("ws-2", "run-2b", "session-2", captured.manifest)
    try:
        assert second.sandbox.id == first.sandbox.id
        assert sent(fake_daytona, uploads) == []  # the sandbox holds the version already
        assert not (folder / "memory" / "link").exists()  # not part of the version: gone
        (folder / "skills" / "empty.md").write_text("now full")
        fetched = len(fake_daytona.downloaded)
        again = second.capture()
    finally:
        second.release()
    assert fake_daytona.downloaded[fetched:] == ["/workspace/skills/empty.md"]
    assert again.added_bytes == len("now full")


def test_a_sandbox_changed_out_of_band_is_corrected_at_the_next_lease(
    fake_daytona: FakeDaytona, objects: WorkspaceObjects, deployment: str
) -> None:
    """Another worker's Turn, or one that crashed before its commit, changed the sandbox: the
    next lease makes it hold the version again, sending only what differs."""
    provider = worker(fake_daytona, objects, deployment)
    manifest = version(objects, FIRST)
    lease = provider.acquire("ws-3", "run-3a", "session-3", manifest)
    lease.release()
    folder = workspace(fake_daytona, lease)
    rewrite(folder / "memory" / "note.txt", b"other note")  # same size, other bytes
    (folder / "memory" / "stray.txt").write_text("not in the version")
    (folder / "memory" / "odd\\name.txt").write_text("a name no client path can hold")
    (folder / "junk" / "a").mkdir(parents=True)
    (folder / "junk" / "a" / "b.txt").write_text("deep")
    (folder / "skills" / "empty.md").unlink()
    os.symlink("/etc/passwd", folder / "skills" / "empty.md")
    os.chmod(folder / "memory" / "deep" / "er" / "tool.sh", 0o600)
    uploads = len(fake_daytona.uploaded)
    again = provider.acquire("ws-3", "run-3b", "session-3", manifest)
    again.release()
    assert held(folder) == FIRST
    assert not (folder / "skills" / "empty.md").is_symlink()
    assert sorted(p.name for p in folder.iterdir()) == ["artifacts", "attachments", "memory", "skills"]
    assert sent(fake_daytona, uploads) == ["/workspace/memory/note.txt", "/workspace/skills/empty.md"]


def test_a_capture_over_quota_stores_nothing(
    fake_daytona: FakeDaytona, objects: WorkspaceObjects, deployment: str
) -> None:
    provider = worker(fake_daytona, objects, deployment)
    lease = provider.acquire("ws-4", "run-4", "session-4", Manifest())
    try:
        folder = workspace(fake_daytona, lease)
        (folder / "memory" / "big.txt").write_bytes(b"x" * 1000)
        (folder / "artifacts" / "report.txt").write_bytes(b"y" * 400)
        asked: list[int] = []

        def room(size: int) -> str | None:
            asked.append(size)
            return "the session's quota of 0.5 KiB" if size > 500 else None

        before = stored_objects(objects)
        with pytest.raises(OverQuota, match="quota"):
            lease.capture(room, frozenset({"artifacts/report.txt"}))
        assert asked == [1000]  # the artifact is counted elsewhere
        assert stored_objects(objects) == before
        (folder / "memory" / "big.txt").write_bytes(b"x" * 100)
        captured = lease.capture(room, frozenset({"artifacts/report.txt"}))
    finally:
        lease.release()
    assert [e.path for e in captured.manifest.entries] == ["artifacts/report.txt", "memory/big.txt"]
    assert captured.added_bytes == 100


def test_a_worker_with_no_record_converges(
    fake_daytona: FakeDaytona, objects: WorkspaceObjects, deployment: str
) -> None:
    """A worker that restarted, or another worker, knows nothing of the sandbox: a file listed
    with the size and time its version names was captured so and is kept (whether the Run wrote
    it or a lease sent it); the others are sent again."""
    first_worker = worker(fake_daytona, objects, deployment)
    lease = first_worker.acquire("ws-5", "run-5a", "session-5", version(objects, FIRST))
    folder = workspace(fake_daytona, lease)
    (folder / "memory" / "a.txt").write_text("written by the Run")
    captured = lease.capture()
    lease.release()
    rewrite(folder / "memory" / "note.txt", b"other note")  # after the commit: not in the version
    (folder / "memory" / "c.txt").write_text("left by a crashed Turn")

    restarted = worker(fake_daytona, objects, deployment)
    uploads = len(fake_daytona.uploaded)
    again = restarted.acquire("ws-5", "run-5b", "session-5", captured.manifest)
    try:
        assert again.sandbox.id == lease.sandbox.id
        assert sent(fake_daytona, uploads) == ["/workspace/memory/note.txt"]
        assert held(folder) == {**FIRST, "memory/a.txt": (b"written by the Run", 0o644)}
        assert content(again.capture().manifest) == content(captured.manifest)
    finally:
        again.release()


def test_an_overgrown_workspace_is_emptied_and_written_again(
    fake_daytona: FakeDaytona, objects: WorkspaceObjects, deployment: str
) -> None:
    provider = worker(fake_daytona, objects, deployment, files=10)
    manifest = version(objects, {"memory/keep.txt": (b"kept", 0o644)})
    lease = provider.acquire("ws-6", "run-6a", "session-6", manifest)
    lease.release()
    folder = workspace(fake_daytona, lease)
    for index in range(40):
        (folder / "memory" / f"junk-{index}.txt").write_text("junk")
    again = provider.acquire("ws-6", "run-6b", "session-6", manifest)
    again.release()
    assert held(folder) == {"memory/keep.txt": (b"kept", 0o644)}
    assert sorted(p.name for p in folder.iterdir()) == ["artifacts", "attachments", "memory", "skills"]


def test_a_sandbox_from_before_the_sync_is_not_reused(
    fake_daytona: FakeDaytona, objects: WorkspaceObjects, deployment: str
) -> None:
    """A session sandbox made with the workspace on a Daytona Volume (no `fleet.workspace`
    label) is left to the sweep; the session gets a new one, synced from the store."""
    provider = worker(fake_daytona, objects, deployment)
    lease = provider.acquire("ws-7", "run-7a", "session-7", Manifest())
    lease.release()
    legacy = fake_daytona.sandboxes[lease.sandbox.id]
    del legacy.labels["fleet.workspace"]
    again = provider.acquire("ws-7", "run-7b", "session-7", Manifest())
    again.release()
    assert again.sandbox.id != legacy.id
    assert fake_daytona.sandboxes[again.sandbox.id].labels["fleet.workspace"] == "synced"
    assert (
        "volumes" not in fake_daytona.sandboxes[again.sandbox.id].body
        or not fake_daytona.sandboxes[again.sandbox.id].body["volumes"]
    )
