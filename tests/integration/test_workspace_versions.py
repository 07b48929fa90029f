"""A session's workspace as versions in an S3-compatible store (moto's server on loopback), through
real Turns on two workers that share no disk: each has its own data dir, and they share only
the database, Redis and the store. What one Run writes, the next finds on the other worker;
every version stays readable; a file no Run changed is neither hashed nor stored again."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import msgspec
import pytest
from moto.server import ThreadedMotoServer

from fleet_shared.config import ResolvedBlobs, Settings
from fleet_shared.db import queries, workspace_versions
from fleet_shared.db.models import Session
from fleet_shared.manifests import object_key
from tests.integration.harness import Harness
from tests.support.manifests import manifest_entries
from tests.support.servers import free_port

HarnessFactory = Callable[..., Harness]
BUCKET = "fleet-workspaces"
CODE = """
import os, pathlib
ws = pathlib.Path('/workspace')
if request == 'write':
    (ws / 'memory' / 'note.txt').write_text('first note')
    (ws / 'memory' / 'deep' / 'er').mkdir(parents=True)
    (ws / 'memory' / 'deep' / 'er' / 'kept.bin').write_bytes(bytes(range(256)))
    os.chmod(ws / 'memory' / 'deep' / 'er' / 'kept.bin', 0o750)
    os.symlink('/etc/passwd', ws / 'memory' / 'link')
    answer = 'wrote'
elif request == 'change':
    answer = (ws / 'memory' / 'note.txt').read_text()
    (ws / 'memory' / 'note.txt').write_text('second note')
    (ws / 'memory' / 'extra.txt').write_text('extra')
else:
    files = sorted(str(p.relative_to(ws)) for p in ws.rglob('*') if p.is_file() or p.is_symlink())
    mode = oct(os.stat(ws / 'memory' / 'deep' / 'er' / 'kept.bin').st_mode & 0o777)
    answer = repr((files, (ws / 'memory' / 'note.txt').read_text(), mode))
SUBMIT(answer=answer)
"""


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    return sqlite_url


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    yield endpoint
    server.stop()


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, work_dir: Path) -> Any:
    """A fresh bucket, and the AWS_* variables the store's client reads (as FLEET_BLOB_URL says)."""
    for name, value in {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    name = f"{BUCKET}-{work_dir.name.lower().replace('_', '-')}"[:60]
    client.create_bucket(Bucket=name)
    return client, name


def on_disk_of_its_own(harness: Harness, data_dir: Path, bucket_name: str) -> Harness:
    """The same harness as a pod of its own: another data dir, the shared store."""
    blobs = ResolvedBlobs(backend="s3", s3_bucket=bucket_name, s3_prefix="fleet", from_url=True)
    settings: Settings = msgspec.structs.replace(harness.settings, data_dir=data_dir, blobs=blobs)
    return Harness(settings, harness.db_sessions, harness.redis)


async def answer_of(harness: Harness, run_id: str) -> str:
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None and run.status == "completed", (
            (run.status, run.failure_message) if run else None
        )
        turns = await queries.list_turns(db, run.session_id, after_sequence=run.user_sequence, limit=1)
    return "".join(p.get("text", "") for p in turns[0].parts if p["type"] == "text")


async def test_a_session_moves_between_workers_that_share_no_disk(
    harness_factory: HarnessFactory, work_dir: Path, bucket: Any
) -> None:
    client, bucket_name = bucket
    base = harness_factory({"lm": "root", "reasoning": "work", "code": CODE})
    first = on_disk_of_its_own(base, work_dir / "pod-a", bucket_name)
    second = on_disk_of_its_own(base, work_dir / "pod-b", bucket_name)

    wrote = await first.submit("write")
    await first.work()
    assert await answer_of(first, wrote) == "wrote"
    async with first.db_sessions() as db:
        run = await queries.get_run(db, wrote)
        assert run is not None
        session = await db.get(Session, run.session_id)
        assert session is not None
        v1 = await workspace_versions.version_row(db, session.workspace_id)
        assert v1 is not None and (v1.version, v1.run_id) == (1, wrote)
        manifest = await manifest_entries(db, v1.manifest_sha256)
    assert manifest is not None
    files = {e.path: e for e in manifest.entries}
    assert sorted(files) == ["memory/deep/er/kept.bin", "memory/note.txt"]  # no link, no folder
    assert files["memory/deep/er/kept.bin"].mode == 0o750
    note = files["memory/note.txt"]
    assert note.sha256 == hashlib.sha256(b"first note").hexdigest()
    stored = client.get_object(Bucket=bucket_name, Key=f"fleet/{object_key(note.sha256)}")["Body"].read()
    assert stored == b"first note"

    shutil.rmtree(work_dir / "pod-a")  # the first pod is gone, its disk with it
    changed = await second.submit("change", session_id=session.id, key="k2")
    await second.work()
    assert await answer_of(second, changed) == "first note"  # found on another disk
    looked = await second.submit("look", session_id=session.id, key="k3")
    await second.work()
    assert await answer_of(second, looked) == repr(
        (
            ["memory/deep/er/kept.bin", "memory/extra.txt", "memory/note.txt"],
            "second note",
            "0o750",
        )
    )
    async with second.db_sessions() as db:
        v1_again = await workspace_versions.version_row(db, session.workspace_id, version=1)
        latest = await workspace_versions.version_row(db, session.workspace_id)
        assert v1_again is not None and latest is not None and latest.version == 3
        old = await manifest_entries(db, v1_again.manifest_sha256)
    assert old is not None and {e.path: e.sha256 for e in old.entries}["memory/note.txt"] == note.sha256


async def test_a_file_no_run_changed_is_not_stored_again(
    harness_factory: HarnessFactory, work_dir: Path, bucket: Any
) -> None:
    client, bucket_name = bucket
    base = harness_factory({"lm": "root", "reasoning": "work", "code": CODE})
    pod = on_disk_of_its_own(base, work_dir / "pod", bucket_name)
    wrote = await pod.submit("write")
    await pod.work()
    async with pod.db_sessions() as db:
        run = await queries.get_run(db, wrote)
        assert run is not None
    # A versioned bucket keeps one object version per PUT: the count is what was stored.
    client.put_bucket_versioning(Bucket=bucket_name, VersioningConfiguration={"Status": "Enabled"})
    key = f"fleet/{object_key(hashlib.sha256(bytes(range(256))).hexdigest())}"
    looked = await pod.submit("look", session_id=run.session_id, key="k2")
    await pod.work()
    assert "kept.bin" in await answer_of(pod, looked)
    puts = client.list_object_versions(Bucket=bucket_name, Prefix=key).get("Versions", [])
    assert [v["IsLatest"] for v in puts] == [True]  # the first Turn's PUT, and none since
