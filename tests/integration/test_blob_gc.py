"""Garbage collection on a real database (SQLite and PostgreSQL) and both blob backends (a folder,
and moto's S3 server on loopback): exactly what nothing refers to and is old enough goes; what
a kept version, a fork, a row or the grace period protects stays; one gc runs at a time."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis
from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session as OrmSession

from fleet_shared import redis_keys
from fleet_shared.blob_gc import Collected, Collector, collect_on_schedule, collect_once
from fleet_shared.blobs import artifact_key, attachment_key
from fleet_shared.config_file import StorageSection
from fleet_shared.db import claims, queries, workspace_versions
from fleet_shared.db.engine import create_engine, dispose_engine, run_whole, session_factory
from fleet_shared.db.files import stored_bytes_on
from fleet_shared.db.models import (
    Artifact,
    Attachment,
    Session,
    Workspace,
    WorkspaceManifest,
    WorkspaceVersion,
)
from fleet_shared.db.workspace_versions import WorkspaceChange, add_manifest_on, delete_manifests, record_on
from fleet_shared.manifests import FileEntry, Manifest, object_key
from fleet_shared.tenancy import OPERATOR
from tests.integration.harness import Harness
from tests.support.blob_ages import AGE, Store, local_store, moto_server, s3_store
from tests.support.manifests import manifest_entries

GRACE = timedelta(hours=1)
Sessions = async_sessionmaker[AsyncSession]
HarnessFactory = Callable[..., Harness]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    yield from moto_server()


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return local_store(tmp_path / "blobs")
    endpoint = request.getfixturevalue("s3_endpoint")
    return s3_store(endpoint, f"gc-{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[Sessions]:
    engine = create_engine(database_url)
    yield session_factory(engine)
    await dispose_engine(engine)


def content(name: str, size: int = 100) -> bytes:
    return (name.encode() * size)[:size]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest(**files: bytes) -> Manifest:
    return Manifest.of(FileEntry(path, len(data), 0o644, sha(data), 0) for path, data in files.items())


async def put(store: Store, key: str, data: bytes, tmp: Path) -> None:
    source = tmp / f"put-{uuid.uuid4().hex}"
    source.write_bytes(data)
    await store.blobs.put_file_async(key, source)
    source.unlink()


async def put_contents(store: Store, tmp: Path, *datas: bytes) -> None:
    for data in datas:
        await put(store, object_key(sha(data)), data, tmp)


async def commit_version(
    sessions: Sessions, workspace_id: str, seen: int, new: Manifest, added: int, kept: int | None
) -> None:
    """What a Run's commit records of its workspace (record_on, in its own transaction)."""
    change = WorkspaceChange(
        workspace_id=workspace_id, seen_version=seen, manifest=new, added_bytes=added, versions_kept=kept
    )

    def work(db: OrmSession) -> None:
        assert record_on(db, change, None)
        db.commit()

    await run_whole(sessions, work)


async def versions_of(sessions: Sessions, workspace_id: str) -> list[int]:
    async with sessions() as db:
        rows = await db.scalars(
            select(WorkspaceVersion.version)
            .where(WorkspaceVersion.workspace_id == workspace_id)
            .order_by(WorkspaceVersion.version)
        )
        return list(rows.all())


async def new_session(sessions: Sessions) -> tuple[str, str]:
    async with sessions() as db:
        session = await queries.create_session(db, "gc", OPERATOR)
        return session.id, session.workspace_id


async def test_a_commit_drops_the_versions_past_those_kept_and_the_quota_still_counts_what_they_hold(
    sessions: Sessions,
) -> None:
    session_id, workspace_id = await new_session(sessions)
    big, small = content("big", 1000), content("small", 500)

    async def counted() -> int:
        return (await run_whole(sessions, lambda db: stored_bytes_on(db, session_id))).session

    await commit_version(sessions, workspace_id, 0, manifest(a=big), added=1000, kept=3)
    for seen in (1, 2, 3, 4):  # Runs that change nothing
        await commit_version(sessions, workspace_id, seen, manifest(a=big), added=0, kept=3)
    assert await versions_of(sessions, workspace_id) == [3, 4, 5]
    # The file version 1 added is still in every kept version: it still counts.
    assert await counted() == 1000
    await commit_version(sessions, workspace_id, 5, manifest(a=small), added=500, kept=3)
    assert await versions_of(sessions, workspace_id) == [4, 5, 6]
    assert await counted() == 1500  # versions 4 and 5 still hold the big file
    for seen in (6, 7):
        await commit_version(sessions, workspace_id, seen, manifest(a=small), added=0, kept=3)
    assert await versions_of(sessions, workspace_id) == [6, 7, 8]
    assert await counted() == 500  # no kept version holds the big file any more

    await commit_version(sessions, workspace_id, 8, manifest(a=small, b=big), added=1000, kept=1)
    assert await versions_of(sessions, workspace_id) == [9]
    assert await counted() == 1500


@dataclass
class World:
    """A deployment's rows and objects, some referenced and some garbage (see seed)."""

    garbage: set[str]  # keys gc must remove
    garbage_bytes: int
    kept: set[str]  # keys gc must leave
    dropped_manifest: str
    kept_manifests: set[str]


async def seed(sessions: Sessions, store: Store, tmp: Path) -> World:
    """A session's workspace that kept 2 versions of 4 and a fork of its first version;
    attachments and artifacts with and without their rows; objects old and fresh."""
    x1, x2, x3, x4, x5, x6, x7, x8 = (content(f"x{i}", 100 + i) for i in range(1, 9))
    session_id, parent = await new_session(sessions)
    m1, m2 = manifest(a=x1), manifest(a=x2, b=x6)
    m3, m4 = manifest(a=x3, d=x5), manifest(a=x3, c=x4)
    await put_contents(store, tmp, x1, x2, x3, x4, x5, x6, x7, x8)
    await commit_version(sessions, parent, 0, m1, 101, kept=2)
    fork = str(uuid.uuid4())  # a fork of version 1: a workspace whose version 1 is the parent's
    async with sessions() as db:
        db.add(Workspace(id=fork, name=f"fork-{fork}", version=1))
        await db.flush()
        db.add(WorkspaceVersion(workspace_id=fork, version=1, manifest_sha256=m1.sha256, added_bytes=0))
        await db.commit()
    await commit_version(sessions, parent, 1, m2, 208, kept=2)
    await commit_version(sessions, parent, 2, m3, 208, kept=2)
    await commit_version(sessions, parent, 3, m4, 104, kept=2)
    assert await versions_of(sessions, parent) == [3, 4]  # 1 and 2 dropped; m2 is referenced no more

    attachment, orphan_attachment, fresh_attachment = (str(uuid.uuid4()) for _ in range(3))
    artifact, orphan_artifact = str(uuid.uuid4()), str(uuid.uuid4())
    for key in map(attachment_key, (attachment, orphan_attachment, fresh_attachment)):
        await put(store, key, b"attached", tmp)
    for key in map(artifact_key, (artifact, orphan_artifact)):
        await put(store, key, b"made", tmp)
    await put(store, "workspaces/not-a-digest", b"?", tmp)  # no name fleet makes: left alone
    async with sessions() as db:
        db.add(
            Attachment(id=attachment, filename="a", media_type="text/plain", byte_size=8, checksum_sha256="0")
        )
        claimed = await claims.claim_turn(
            db,
            caller=OPERATOR,
            session_id=session_id,
            idempotency_key="k",
            fingerprint="f",
            text="t",
            model="m",
        )
        assert isinstance(claimed, claims.Claimed)
        db.add(
            Artifact(
                id=artifact,
                run_id=claimed.run.id,
                session_id=session_id,
                name="r.txt",
                media_type="text/plain",
                byte_size=4,
                checksum_sha256="0",
            )
        )
        await db.commit()
        # Everything is old but what stands for an upload or a commit under way.
        await db.execute(
            update(WorkspaceManifest)
            .where(WorkspaceManifest.sha256.in_([m.sha256 for m in (m1, m2, m3, m4)]))
            .values(created_at=datetime.now(UTC) - AGE)
        )
        await db.commit()
    fresh = {object_key(sha(x8)), attachment_key(fresh_attachment), "workspaces/not-a-digest"}
    store.age(*(store.keys() - fresh))
    garbage = {
        object_key(sha(x2)),  # only the dropped version 2 held it
        object_key(sha(x6)),
        object_key(sha(x7)),  # stored by a Run whose commit never happened
        attachment_key(orphan_attachment),
        artifact_key(orphan_artifact),
    }
    return World(
        garbage=garbage,
        garbage_bytes=len(x2) + len(x6) + len(x7) + len(b"attached") + len(b"made"),
        kept=store.keys() - garbage,
        dropped_manifest=m2.sha256,
        kept_manifests={m1.sha256, m3.sha256, m4.sha256},
    )


async def until(check: Callable[[], Awaitable[object]]) -> None:
    """Wait for `check` to hold (polled: what it watches has no event to wait on)."""
    async with asyncio.timeout(60):
        while not await check():  # noqa: ASYNC110 (polls Redis or the database)
            await asyncio.sleep(0.02)


async def manifests_present(sessions: Sessions, sha256s: set[str]) -> set[str]:
    async with sessions() as db:
        rows = await db.scalars(select(WorkspaceManifest.sha256).where(WorkspaceManifest.sha256.in_(sha256s)))
        return set(rows.all())


def collector(sessions: Sessions, store: Store, **kwargs: object) -> Collector:
    return Collector(sessions, store.blobs, older_than=datetime.now(UTC) - GRACE, **kwargs)  # type: ignore[arg-type]


async def test_gc_removes_exactly_what_nothing_refers_to_once_it_is_old(
    sessions: Sessions, store: Store, tmp_path: Path
) -> None:
    world = await seed(sessions, store, tmp_path)
    listed: list[tuple[str, int]] = []
    dry = await collector(sessions, store, dry_run=True, on_removed=lambda k, s: listed.append((k, s))).run()
    assert store.keys() == world.kept | world.garbage  # a dry run removes nothing
    assert {key for key, _ in listed} >= world.garbage | {f"manifest {world.dropped_manifest}"}
    assert {key for key, _ in listed if not key.startswith("manifest ")} == world.garbage

    collected = await collector(sessions, store).run()

    assert store.keys() == world.kept
    assert (collected.workspace_objects.count, collected.attachments.count, collected.artifacts.count) == (
        3,
        1,
        1,
    )
    assert collected.freed_bytes == world.garbage_bytes == dry.freed_bytes
    assert collected.unknown_keys == 1 and collected.finished
    assert (
        await manifests_present(sessions, world.kept_manifests | {world.dropped_manifest})
        == world.kept_manifests
    )
    again = await collector(sessions, store).run()
    assert again.freed_bytes == 0 and store.keys() == world.kept


async def test_an_object_put_again_after_gc_listed_it_is_kept(store: Store, tmp_path: Path) -> None:
    """A Run that stores a content gc found old and unreferenced puts it again (renewing it)
    before its commit refers to it; gc looks once more just before it deletes."""
    data = content("again")
    key = object_key(sha(data))
    await put(store, key, data, tmp_path)
    store.age(key)
    cutoff = datetime.now(UTC) - GRACE
    listed = [o for page in [p async for p in store.blobs.listing("workspaces/")] for o in page]
    assert [(o.key, o.last_modified < cutoff) for o in listed] == [(key, True)]
    await put(store, key, data, tmp_path)  # the Run's put
    assert not await store.blobs.delete_if_older(key, cutoff)
    assert store.keys() == {key}
    store.age(key)
    assert await store.blobs.delete_if_older(key, cutoff)
    assert store.keys() == set()


async def test_two_gcs_at_once_remove_each_object_once(
    sessions: Sessions, store: Store, tmp_path: Path, redis_client: aioredis.Redis
) -> None:
    world = await seed(sessions, store, tmp_path)
    queue = f"gc-test-{uuid.uuid4().hex[:8]}"
    runs = await asyncio.gather(
        *(collect_once(redis_client, queue, collector(sessions, store)) for _ in range(4))
    )
    ran = [r for r in runs if r is not None]
    assert len(ran) == 1  # the others found the lock held
    assert sum(r.workspace_objects.count + r.attachments.count + r.artifacts.count for r in ran) == len(
        world.garbage
    )
    assert store.keys() == world.kept
    assert not await redis_client.exists(redis_keys.gc_lock(queue))  # released


async def test_a_gc_waits_its_turn_while_another_holds_the_lock(
    sessions: Sessions, store: Store, tmp_path: Path, redis_client: aioredis.Redis
) -> None:
    world = await seed(sessions, store, tmp_path)
    queue = f"gc-test-{uuid.uuid4().hex[:8]}"
    async with redis_client.lock(redis_keys.gc_lock(queue), timeout=30):
        assert await collect_once(redis_client, queue, collector(sessions, store)) is None
        assert store.keys() == world.kept | world.garbage
    collected = await collect_once(redis_client, queue, collector(sessions, store))
    assert isinstance(collected, Collected) and store.keys() == world.kept


async def test_a_worker_collects_on_its_schedule(
    sessions: Sessions, store: Store, tmp_path: Path, redis_client: aioredis.Redis
) -> None:
    world = await seed(sessions, store, tmp_path)
    queue = f"gc-test-{uuid.uuid4().hex[:8]}"
    storage = msgspec.structs.replace(StorageSection(), gc_interval_seconds=0.05)
    stopping = asyncio.Event()
    schedule = asyncio.create_task(
        collect_on_schedule(
            redis_client, sessions, store.blobs, queue=queue, storage=storage, stopping=stopping
        )
    )
    try:
        await until(lambda: redis_client.exists(redis_keys.gc_done(queue)))
        assert store.keys() == world.kept
    finally:
        stopping.set()
        await asyncio.wait_for(schedule, 10)


async def test_a_commit_that_reuses_a_manifest_gc_is_removing_keeps_it(
    sessions: Sessions, database_url: str
) -> None:
    """A Run's commit adds its manifest (here one that no version refers to any more, and old)
    and then its version; a gc deleting that manifest in between must wait for the commit and
    leave it, not make the commit fail on its foreign key."""
    if not database_url.startswith("postgresql"):
        pytest.skip("SQLite runs one writer at a time: the two cannot interleave")
    _, workspace_id = await new_session(sessions)
    reused = manifest(a=content("reused"))
    old = datetime.now(UTC) - AGE
    async with sessions() as db:
        await db.run_sync(lambda sync: add_manifest_on(sync, reused))
        await db.execute(
            update(WorkspaceManifest).where(WorkspaceManifest.sha256 == reused.sha256).values(created_at=old)
        )
        await db.commit()
    cutoff = datetime.now(UTC) - GRACE
    async with sessions() as run_commit:
        await run_commit.run_sync(lambda sync: add_manifest_on(sync, reused))  # the commit, begun
        pid = await run_commit.scalar(text("SELECT pg_backend_pid()"))

        async def gc_delete() -> int:
            async with sessions() as db:
                return await delete_manifests(db, [reused.sha256], cutoff)

        deleting = asyncio.create_task(gc_delete())
        async with sessions() as watcher:  # the gc's DELETE waits on the commit's row lock
            await until(lambda: deleting_waits_on(watcher, pid, deleting))
        run_commit.add(WorkspaceVersion(workspace_id=workspace_id, version=1, manifest_sha256=reused.sha256))
        await run_commit.commit()
    assert await deleting == 0
    assert await manifests_present(sessions, {reused.sha256}) == {reused.sha256}


async def deleting_waits_on(watcher: AsyncSession, pid: int, deleting: asyncio.Task[int]) -> bool:
    if deleting.done():
        return True  # it did not wait: the assertions after the commit say what it did
    blocked = await watcher.scalar(
        text("SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"), {"pid": pid}
    )
    await watcher.rollback()
    return bool(blocked)


async def test_a_turns_commit_keeps_the_configured_versions(harness_factory: HarnessFactory) -> None:
    code = "import pathlib\npathlib.Path('/workspace/memory/n.txt').write_text(request)\nSUBMIT(answer='ok')"
    harness = harness_factory(
        {"lm": "root", "reasoning": "note", "code": code}, storage={"workspace_versions_kept": 2}
    )
    first = await harness.submit("one")
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, first)
        assert run is not None
        session = await db.get(Session, run.session_id)
        assert session is not None
    for turn, said in enumerate(("two", "three"), start=2):
        await harness.submit(said, session_id=session.id, key=f"k{turn}")
        await harness.work()
    assert await versions_of(harness.db_sessions, session.workspace_id) == [2, 3]
    async with harness.db_sessions() as db:
        latest = await workspace_versions.version_row(db, session.workspace_id)
        assert latest is not None
        kept = await manifest_entries(db, latest.manifest_sha256)
    assert kept is not None and [e.sha256 for e in kept.entries] == [sha(b"three")]
