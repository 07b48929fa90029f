"""`fleet gc` as an operator runs it, a process of its own over the deployment's database, Redis
and an S3-compatible store (moto's server on loopback, named by FLEET_BLOB_URL): a dry run lists
what it would remove and removes nothing; a gc that finds another holding the lock does nothing
and says so (exit 75); then it removes exactly the old unreferenced objects and reports them."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet_shared import redis_keys
from fleet_shared.blobs import attachment_key
from fleet_shared.config import load_settings
from fleet_shared.db import queries
from fleet_shared.db.engine import create_engine, dispose_engine, run_whole, session_factory
from fleet_shared.db.workspace_versions import WorkspaceChange, record_on
from fleet_shared.manifests import FileEntry, Manifest, object_key
from fleet_shared.tenancy import OPERATOR
from tests.e2e.conftest import REPO
from tests.support.blob_ages import S3_ENV, Store, moto_server, s3_store
from tests.support.servers import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    yield from moto_server()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def fleet(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet_cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def seed(database_url: str, store: Store, tmp: Path) -> dict[str, str]:
    """A workspace version that refers to one object; an object and an attachment no row refers
    to (both old); and a fresh object no row refers to yet (an upload under way)."""
    contents = {name: f"{name} bytes".encode() for name in ("referenced", "stray", "fresh")}
    keys = {name: object_key(hashlib.sha256(data).hexdigest()) for name, data in contents.items()}
    keys["orphan_attachment"] = attachment_key(str(uuid.uuid4()))
    for name, key in keys.items():
        source = tmp / name
        source.write_bytes(contents.get(name, b"uploaded"))
        await store.blobs.put_file_async(key, source)
    referenced = contents["referenced"]
    entry = FileEntry("memory/note.txt", len(referenced), 0o644, hashlib.sha256(referenced).hexdigest(), 0)
    engine = create_engine(database_url)
    try:
        sessions = session_factory(engine)
        async with sessions() as db:
            session = await queries.create_session(db, "gc", OPERATOR)
        change = WorkspaceChange(
            workspace_id=session.workspace_id, seen_version=0, manifest=Manifest.of([entry])
        )

        def commit(db: object) -> None:
            assert record_on(db, change, None)  # type: ignore[arg-type]
            db.commit()  # type: ignore[attr-defined]

        await run_whole(sessions, commit)
    finally:
        await dispose_engine(engine)
    store.age(keys["referenced"], keys["stray"], keys["orphan_attachment"])
    return keys


async def test_fleet_gc_as_a_process(tmp_path: Path, s3_endpoint: str, private_redis: RedisServer) -> None:
    bucket = f"gc-e2e-{uuid.uuid4().hex[:12]}"
    store = s3_store(s3_endpoint, bucket)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "AWS_"))}
    env.update(
        S3_ENV,
        AWS_ENDPOINT_URL=s3_endpoint,
        FLEET_CONFIG=str(REPO / "config" / "fleet.toml"),
        FLEET_PROFILE="offline",
        FLEET_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path / 'fleet.db'}",
        FLEET_REDIS_URL=private_redis.url(0),
        FLEET_BLOB_URL=f"s3://{bucket}/fleet",
    )
    assert fleet(env, tmp_path, "db", "upgrade").returncode == 0
    keys = await seed(env["FLEET_DATABASE_URL"], store, tmp_path)
    everything = set(keys.values())
    garbage = {keys["stray"], keys["orphan_attachment"]}

    dry = fleet(env, tmp_path, "gc", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert {
        line.split()[2] for line in dry.stdout.splitlines() if line.startswith("would remove ")
    } == garbage
    assert (
        "would remove 0 manifest(s), 1 workspace object(s) (11 bytes), 1 attachment(s) (8 bytes)"
        in dry.stdout
    )
    assert store.keys() == everything

    queue = load_settings(env, lm_credentials=False).profile.worker.queue_name
    client = redis.Redis.from_url(private_redis.url(0))
    with client.lock(redis_keys.gc_lock(queue), timeout=60):  # a worker's scheduled gc, running
        busy = fleet(env, tmp_path, "gc")
    assert busy.returncode == 75 and "another gc is running" in busy.stdout
    assert store.keys() == everything

    done = fleet(env, tmp_path, "gc")
    assert done.returncode == 0, done.stderr
    assert "removed 0 manifest(s), 1 workspace object(s) (11 bytes), 1 attachment(s) (8 bytes)" in done.stdout
    assert "freed 19 bytes" in done.stdout
    assert '"event": "gc.finished"' in done.stderr and '"freed_bytes": 19' in done.stderr
    assert store.keys() == everything - garbage  # the referenced and the fresh stay
    assert not client.exists(redis_keys.gc_lock(queue))

    # With the fresh object's grace given up, it goes too; and no Redis is needed without the lock.
    unlocked = {k: v for k, v in env.items() if k != "FLEET_REDIS_URL"}
    last = fleet(unlocked, tmp_path, "gc", "--no-lock", "--grace-seconds", "0")
    assert last.returncode == 0, last.stderr
    assert "removed 0 manifest(s), 1 workspace object(s) (11 bytes)" in last.stdout
    assert store.keys() == {keys["referenced"]}
    client.close()
