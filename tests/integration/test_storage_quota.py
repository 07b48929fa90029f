"""What the blob store keeps, on SQLite and PostgreSQL: an artifact is stored again only when its
content changed, and the per-session and per-deployment quotas refuse (and do not store) what
would pass them, in a Turn (a `data-warning`) and at an upload (507)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from litestar.testing import TestClient
from sqlalchemy import select

from fleet_gateway.app import create_app
from fleet_shared.blobs import open_blob_store
from fleet_shared.config import Settings
from fleet_shared.db import files, queries
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.db.models import Artifact
from fleet_shared.events import ArtifactCreated, RunEvent, RunWarning
from fleet_shared.ids import new_id
from fleet_shared.tenancy import OPERATOR
from tests.integration.harness import Harness
from tests.integration.test_escape import HarnessFactory
from tests.integration.test_files_api import settings_in

KIB = 1024
MIB = 1024 * KIB
UPLOAD = {"x-requested-with": "test"}  # an upload needs a header no plain web form can send
WRITE = (
    "import os, json\nart = '/workspace/artifacts'\n"
    "for name, text in json.loads(request).items():\n"
    "    if text is None:\n        os.utime(os.path.join(art, name))\n"
    "    else:\n        open(os.path.join(art, name), 'w').write(text)\n"
    "SUBMIT(answer='written')"
)


def writes(harness_factory: HarnessFactory, **storage: Any) -> Harness:
    """A harness whose Turns write what their request says: {name: text, or None to touch}."""
    return harness_factory({"lm": "root", "reasoning": "write", "code": WRITE}, storage=storage)


async def turn(
    harness: Harness, request: dict[str, str | None], session_id: str | None = None
) -> list[RunEvent]:
    run_id = await harness.submit(msgspec.json.encode(request).decode(), session_id=session_id, key=new_id())
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
    assert run is not None and run.status == "completed", run and run.failure_message
    return await harness.events(run_id)


def kept(events: list[RunEvent]) -> list[str]:
    return [e.name for e in events if isinstance(e, ArtifactCreated)]


def warnings(events: list[RunEvent]) -> dict[str, str]:
    """The artifacts' warnings by code (the workspace's own quota warning: `workspace_warning`)."""
    return {e.code: e.message for e in events if isinstance(e, RunWarning) and not is_workspace_warning(e)}


def is_workspace_warning(event: RunWarning) -> bool:
    return event.message.startswith("the workspace's changes were not kept")


def workspace_warning(events: list[RunEvent]) -> str | None:
    found = [e.message for e in events if isinstance(e, RunWarning) and is_workspace_warning(e)]
    return found[0] if found else None


async def session_of(harness: Harness, events: list[RunEvent]) -> str:
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, events[0].run_id)
    assert run is not None
    return run.session_id


def blob_count(settings: Settings) -> int:
    folder = settings.blobs_dir / "artifacts"
    return len(list(folder.iterdir())) if folder.exists() else 0


async def test_an_artifact_is_stored_again_only_when_its_content_changed(
    harness_factory: HarnessFactory,
) -> None:
    """Rewriting the same bytes or touching a file stores nothing and announces nothing; new
    bytes are stored, and so are bytes the name held before but not last."""
    harness = writes(harness_factory)
    first = await turn(harness, {"a.txt": "alpha", "b.txt": "beta"})
    session_id = await session_of(harness, first)
    second = await turn(harness, {"a.txt": "alpha", "b.txt": "beta, changed"}, session_id)
    third = await turn(harness, {"a.txt": None, "b.txt": "beta"}, session_id)
    assert (kept(first), kept(second), kept(third)) == (["a.txt", "b.txt"], ["b.txt"], ["b.txt"])
    async with harness.db_sessions() as db:
        rows = (await db.scalars(select(Artifact).where(Artifact.session_id == session_id))).all()
    stored = sorted((r.name, r.checksum_sha256) for r in rows)
    assert stored == sorted(
        [
            ("a.txt", sha("alpha")),
            ("b.txt", sha("beta")),
            ("b.txt", sha("beta, changed")),
            ("b.txt", sha("beta")),
        ]
    )
    assert blob_count(harness.settings) == 4


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def test_the_session_quota_refuses_what_would_pass_it(harness_factory: HarnessFactory) -> None:
    """1 MiB per session: of two 600 KiB files the second is refused, with one warning, and
    not stored; another session has a quota of its own."""
    harness = writes(harness_factory, quota_session_mb=1)
    big = "x" * 600 * KIB
    events = await turn(harness, {"one.txt": big, "two.txt": big + "y"})
    assert kept(events) == ["one.txt"]
    assert warnings(events) == {
        "storage_quota_exceeded": "1 file under artifacts/ not kept (two.txt): the session's stored "
        "files would pass storage.quota_session_mb (1 MiB)"
    }
    # The refused file stays in the workspace, whose version would store it: not kept either.
    assert "storage.quota_session_mb (1 MiB)" in (workspace_warning(events) or "")
    assert blob_count(harness.settings) == 1
    session_id = await session_of(harness, events)
    again = await turn(harness, {"three.txt": "x" * 300 * KIB, "four.txt": "x" * 200 * KIB}, session_id)
    assert kept(again) == ["four.txt"] and "three.txt" in warnings(again)["storage_quota_exceeded"]
    elsewhere = await turn(harness, {"two.txt": big})
    assert kept(elsewhere) == ["two.txt"] and warnings(elsewhere) == {}


async def deployment_headroom(database_url: str) -> tuple[int, int]:
    """A deployment quota (MiB) above what the shared test database holds now, and how many
    bytes more it lets in: between 1 and 2 MiB."""
    engine = create_engine(database_url)
    try:
        async with session_factory(engine)() as db:
            used = (await files.stored_bytes(db)).deployment
    finally:
        await engine.dispose()
    quota_mb = used // MIB + 2
    return quota_mb, quota_mb * MIB - used


async def test_the_deployment_quota_counts_attachments_and_every_session(
    harness_factory: HarnessFactory, database_url: str
) -> None:
    quota_mb, headroom = await deployment_headroom(database_url)
    harness = writes(harness_factory, quota_deployment_mb=quota_mb)
    await add_attachment(harness.settings, b"a" * (headroom - 500 * KIB))
    first = await turn(harness, {"one.txt": "x" * 300 * KIB})
    second = await turn(harness, {"two.txt": "x" * 300 * KIB})  # another session
    assert kept(first) == ["one.txt"] and kept(second) == []
    assert f"storage.quota_deployment_mb ({quota_mb} MiB)" in warnings(second)["storage_quota_exceeded"]
    assert blob_count(harness.settings) == 1


async def add_attachment(settings: Settings, data: bytes) -> None:
    """An uploaded attachment: its bytes in the blob store and its row."""
    attachment_id = new_id()
    source = settings.data_dir / "upload.tmp"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(data)
    open_blob_store(settings).put_file(f"attachments/{attachment_id}", source)
    engine = create_engine(settings.database_url)
    try:
        async with session_factory(engine)() as db:
            await files.add_attachment(
                db,
                attachment_id=attachment_id,
                filename="a.bin",
                media_type="application/octet-stream",
                byte_size=len(data),
                checksum_sha256=hashlib.sha256(data).hexdigest(),
                owner=OPERATOR,
            )
    finally:
        await engine.dispose()


@pytest.fixture
def quota_settings(tmp_path: Path, database_url: str, redis_url: str) -> tuple[Settings, int]:
    """Settings whose deployment quota lets in 1-2 MiB more; that many bytes."""
    quota_mb, headroom = asyncio.run(deployment_headroom(database_url))
    settings = settings_in(tmp_path, database_url, redis_url)
    storage = msgspec.structs.replace(settings.profile.storage, quota_deployment_mb=quota_mb)
    profile = msgspec.structs.replace(settings.profile, storage=storage)
    return msgspec.structs.replace(settings, profile=profile), headroom


def test_an_upload_past_the_deployment_quota_is_refused_and_not_stored(
    quota_settings: tuple[Settings, int],
) -> None:
    settings, headroom = quota_settings
    quota_mb = settings.profile.storage.quota_deployment_mb
    with TestClient(create_app(settings)) as client:

        def upload(size: int) -> Any:
            return client.post(
                "/api/attachments", files={"attachment": ("a.bin", b"z" * size, "text/plain")}, headers=UPLOAD
            )

        assert upload(headroom - 500 * KIB).status_code == 201
        refused = upload(600 * KIB)
        assert refused.status_code == 507, refused.text
        assert refused.json() == {
            "code": "storage_quota_exceeded",
            "message": "the attachment was not stored: the deployment's stored files would pass "
            f"storage.quota_deployment_mb ({quota_mb} MiB)",
        }
        assert len(list((settings.blobs_dir / "attachments").iterdir())) == 1
        assert list((settings.data_dir / "uploads").iterdir()) == []
        assert upload(400 * KIB).status_code == 201  # what still fits is stored
